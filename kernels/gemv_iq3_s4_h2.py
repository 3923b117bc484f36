"""IQ3_S 4-bit-code GEMV with packed half2 arithmetic (T <= 8): the decode-path variant of `gemv_iq3_s4`.

Decode: per word of 8 codes, the pairs (j, j + 4) -- the order of the prepared activations (`ninfer_kernels.x16`)
and of the warp-MMA lanes -- come without a table or a conversion: 2v sits at bits 1..4 (j = 0) or 5..8 (j = 1) of
both halves, and after one rotate by 8 the same for j = 2, 3. Masked out, a half is the f16 subnormal 2v * 2**-24
(or 32v * 2**-24), and one HFMA2 (x 2**15 or 2**11, - 15 * 2**-9) leaves (2v - 15) * 2**-9, exact: 9 instructions
per 8 weights (one rotate, four `lop3`, four HFMA2). (With the exponent OR-ed in instead, ptxas made two `lop3` of
each mask-and-or: it folds one immediate per instruction.)

Written per thread like `gemv_iq3_s_h2` (every tensor [NT] = [32 * NW], element e = thread e): thread e holds one
32-weight sub-block column (16 bytes of codes, one scale nibble, one d) of R rows, RB = NT / (BG / 2) rows apart, and
its 16 activation pairs serve all R rows. A tile-wide [BN, BG] layout (`gemv_h2_common.h2_body`) spent 300 of its
860 loop instructions per 256 weights on the sub-block scales: Triton loaded the scale bytes in another layout and
converted them through shared memory with four barriers per tile (sm_90 SASS).
Activations: prepared (XPRE): the sub-block's 16 words are its pairs as they are (four 16-byte loads) and the chunk's
back joins the scale; plain: scaled by a power of two per (CTA, T column) to |x'| < 2**14 and paired. Either way a
32-weight f16 sum stays below 32 * 15 * 2**5; the sub-block scale d * (1 + 2 * s4) carries the 2**9 back.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gemv_h2_common import _EMULATE, compile_consts, factory, hfma2, lanes_f32, pack2
from .gemv_iq3_s import check_h2_tile
from .gemv_iq3_s_h2 import _epilogue, column_scales, thread_rows, x16_sub_block
from .gemv_mma_common import split_all
from .pdl import pdl_wait

_LOW = tl.constexpr(0x001E001E)            # 2v of j = 0 (and of j = 2 after the rotate): bits 1..4 of each half
_HIGH = tl.constexpr(0x01E001E0)           # 2v * 16 of j = 1 (and 3): bits 5..8
_MUL_LOW = tl.constexpr(0x78007800)        # f16x2 (2**15, 2**15): 2v * 2**-24 -> 2v * 2**-9
_MUL_HIGH = tl.constexpr(0x68006800)       # f16x2 (2**11, 2**11): 32v * 2**-24 -> 2v * 2**-9
_NEG15 = tl.constexpr(-1484740736)         # f16x2 (-15 * 2**-9, ..) = 0xA780A780 as int32
WEIGHT_SHIFT = 9                           # the pairs are (2v - 15) * 2**-WEIGHT_SHIFT
_UNSCALE = tl.constexpr(float(1 << WEIGHT_SHIFT))


@triton.jit
def rot8(w, H2_MODE: tl.constexpr):
    """int32 w rotated right by 8 bits: one funnel shift (`shf.r.wrap`, sm_32+)."""
    if H2_MODE == _EMULATE:
        return ((w >> 8) & 0xFFFFFF) | (w << 24)
    else:
        return tl.inline_asm_elementwise("shf.r.wrap.b32 $0, $1, $1, 8;", "=r,r", [w], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def word_pairs(w, H2_MODE: tl.constexpr):
    """f16x2 (2v - 15) * 2**-9 of weights (j, j + 4), j = 0..3, of a word of 8 codes (module docstring)."""
    m_lo, m_hi = tl.full(w.shape, _MUL_LOW, tl.int32), tl.full(w.shape, _MUL_HIGH, tl.int32)
    neg = tl.full(w.shape, _NEG15, tl.int32)
    r = rot8(w, H2_MODE)
    return (hfma2(w & _LOW, m_lo, neg, H2_MODE), hfma2(w & _HIGH, m_hi, neg, H2_MODE),
            hfma2(r & _LOW, m_lo, neg, H2_MODE), hfma2(r & _HIGH, m_hi, neg, H2_MODE))


@triton.jit
def sub_block_pairs(words, H2_MODE: tl.constexpr):
    """The 16 pairs of a 32-weight sub-block from its 4 words of codes: pair 4o + j = pair j of word o."""
    return word_pairs(words[0], H2_MODE) + word_pairs(words[1], H2_MODE) + word_pairs(words[2], H2_MODE) \
        + word_pairs(words[3], H2_MODE)


@triton.jit
def _load_row(codes, sc, d, row, h, G):
    """(the 4 words of codes of sub-block h of one row per thread, its scale d * (1 + 2 * s4) * 2**9)."""
    q = tl.load(codes + (row * G + 2 * h)[:, None] + tl.arange(0, 2)[None, :])       # [NT, 2] int64: 16 bytes
    qa, qb = tl.split(q)
    s4 = (tl.load(sc + row * (G // 4) + h // 2).to(tl.int32) >> (4 * (h % 2))) & 0xF
    s = tl.load(d + row * (G // 16) + h // 8).to(tl.float32) * ((1 + 2 * s4).to(tl.float32) * _UNSCALE)
    return (qa.to(tl.int32), (qa >> 32).to(tl.int32), qb.to(tl.int32), (qb >> 32).to(tl.int32)), s


@triton.jit
def _x_pairs(x_ptr, row, k0, up, H2_MODE: tl.constexpr):
    """The sub-block's 32 activations * up as 16 f16x2 [NT] tensors: pair 4o + j is (8o + j, 8o + j + 4). Loaded 8 at
    a time: a [NT, 32] load would be laid out 4 threads per row and converted through shared memory."""
    NT: tl.constexpr = k0.shape[0]
    p = ()
    for o in tl.static_range(4):
        xv = tl.load(x_ptr + row + k0[:, None] + (8 * o + tl.arange(0, 8))[None, :]).to(tl.float32) * up
        lo, hi = tl.split(tl.permute(tl.reshape(xv, [NT, 2, 4]), [0, 2, 1]))      # x[8o + j], x[8o + 4 + j]
        p = p + split_all(pack2(lo, hi, H2_MODE), 2)
    return p


@triton.jit
def _column_pairs(x_ptr, row, h, up, G, H2_MODE: tl.constexpr, XPRE: tl.constexpr):
    """(the 16 pairs of one T column, what the sub-block scale is multiplied by: XPRE the chunk's back, else 1)."""
    if XPRE:      # prepared word 4o + j of the sub-block is pair 4o + j
        words, back = x16_sub_block(x_ptr, row, h, G)
        return split_all(words[0], 2) + split_all(words[1], 2) + split_all(words[2], 2) + split_all(words[3], 2), back
    else:
        return _x_pairs(x_ptr, row, h * 32, up, H2_MODE), 1.0


@triton.jit
def _rows_dot(lds, xp, xb, R: tl.constexpr, T_TILE: tl.constexpr, H2_MODE: tl.constexpr):
    """Per row and T column: the sub-block's f16 dot product as fp32 times its scale and the column's factor."""
    out = ()
    for j in tl.static_range(R):
        words, s = lds[j]
        w = sub_block_pairs(words, H2_MODE)
        for tt in tl.static_range(T_TILE):
            acc = hfma2(w[0], xp[tt][0], tl.zeros_like(words[0]), H2_MODE)
            for i in tl.static_range(1, 16):
                acc = hfma2(w[i], xp[tt][i], acc, H2_MODE)
            out = out + (lanes_f32(acc, H2_MODE) * (s * xb[tt]),)
    return out


@triton.jit
def iq3_s4_h2_gemv_kernel(x_ptr, codes, sc, d, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split,
                          stride_xt, stride_ot, stride_rt, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_G: tl.constexpr, USE_SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
                          DOT_KIND: tl.constexpr, EPI: tl.constexpr, EVEN_G: tl.constexpr,
                          FOLD: tl.constexpr, STAGES: tl.constexpr, H2_MODE: tl.constexpr, XPRE: tl.constexpr,
                          NW: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_wait(PDL)    # ninfer_kernels.pdl: before any load or store; finish_at triggers after the K loop
    # USE_DOT / DOT_KIND / FOLD / STAGES / EVEN_G: accepted for the shared launcher, unused (whole tiles: K % 256 == 0
    # and BLOCK_G divides 16). Grid, split-K and tail rows as `gemv_iq3_s_h2`
    GC: tl.constexpr = BLOCK_G // 2       # threads per row: one sub-block (2 groups) each
    RB: tl.constexpr = 32 * NW // GC      # rows per pass of the CTA's threads
    R: tl.constexpr = BLOCK_N // RB       # rows per thread
    tl.static_assert(BLOCK_G >= 2 and BLOCK_G <= 16 and R >= 1 and R * RB == BLOCK_N and T_TILE <= 8)
    e, gc, rows = thread_rows(N, BLOCK_N, GC, RB, R, NW)
    t0, g_lo, g_hi, xrows, ups, backs = column_scales(x_ptr, T, G, split, stride_xt, fscale, T_TILE, BLOCK_G,
                                                      XPRE)
    accs = ()
    for _ in tl.static_range(R * T_TILE):
        accs = accs + (tl.zeros(e.shape, tl.float32),)
    for g0 in range(g_lo, g_hi, BLOCK_G):
        h = g0 // 2 + gc                  # the thread's sub-block
        lds = ()
        for j in tl.static_range(R):
            lds = lds + (_load_row(codes, sc, d, rows[j], h, G),)
        xp, xb = (), ()
        for tt in tl.static_range(T_TILE):
            p, b = _column_pairs(x_ptr, xrows[tt], h, ups[tt], G, H2_MODE, XPRE)
            xp, xb = xp + (p,), xb + (b,)
        part = _rows_dot(lds, xp, xb, R, T_TILE, H2_MODE)
        for i in tl.static_range(R * T_TILE):
            accs = accs[:i] + (accs[i] + part[i],) + accs[i + 1:]
    _epilogue(accs, backs, t0, N, T, split, out_ptr, stride_ot, res_ptr, stride_rt, ws_ptr, cnt_ptr, R, RB, GC,
              T_TILE, EPI, USE_SPLIT, PDL)


h2_kernel = factory(iq3_s4_h2_gemv_kernel, "iq3_s4_gemv_kernel", per_thread=True,   # gemv_iq3_s4 registers it
                    check=check_h2_tile)


def kernel_for(fmt: str = "iq3_s4_h2", dequant: bool = False, cc: int = 90):
    """(kernel, signature of its weight arguments, extra constexprs) for compile checks."""
    if dequant:
        raise ValueError("iq3_s4_h2 has no dequantizer of its own (gemv_iq3_s4's serves both)")
    return iq3_s4_h2_gemv_kernel, {"codes": "*i64", "sc": "*u8", "d": "*fp16"}, {**compile_consts(cc), "NW": 4}
