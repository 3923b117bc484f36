"""IQ3_S dequant-GEMV with packed half2 arithmetic (T <= 8): the decode-path variant of `gemv_iq3_s`.

Why: the fp32 variant gathers one word per 4 weights from a 32 KB table through L1. A warp's 32 random
indices there touch ~30 distinct 128-byte lines, one L1 wavefront each, so the gathers alone cap it near
11 % of copy bandwidth (the H200 measured 8-14 %). Here:

* the table is the 512 unsigned grid points (2 KB), gathered from shared memory with `tl.gather` (Triton
  stores the source tensor to shared memory once per call: one call per tile for every 4-weight group the
  thread holds). Shared memory banks are 4 bytes wide, so 32 random indices cost ~3.5 wavefronts, not ~30;
* a grid word holds coordinates (c0, c1, c2, c3) at bits (6..9, 2..5, 22..25, 18..21). With the signs
  XOR-ed in at bits 15, 11, 31, 27 (one `lop3` from the spread sign word), `u & 0x83C083C0` is the f16x2
  pair (w0, w2) and `(u << 4) & 0x83C083C0` the pair (w1, w3): +-c * 2**-18 as f16 subnormals, exact;
* the repacked sign word puts weight 4k + j's sign where one shift by k moves all four to those bits
  (`gemv_iq3_s.SIGN_BITS`): spread = (s << 8 & 0xFFFF00) | s << 16 serves all four groups (bits 16..23
  are junk that no shift reads);
* activations: as `gemv_nvfp4_h2` (|x'| < 2**14 per CTA and T column), in the pair order of the weights;
  16 HFMA2 per 32-weight sub-block accumulate in f16 (|sum| < 32 * 15 * 2**-4), then one fp32 FMA by the
  sub-block scale d * (1 + 2 * s4) * 2**18, and 1 / up at the end;
* XPRE (prepared activations, `ninfer_kernels.x16`: |x'| < 2**14 per 128-chunk, so the weights need no other
  scaling and no CTA makes a pass over x): the prepared words pair (j, j + 4) and the weights (4m + lo,
  4m + lo + 2), so each of a sub-block's 16 pairs is the low or the high halves of two of its 16 words (one
  byte permute); the chunk's back joins the sub-block scale.

Written per thread, like `gemv_nvfp4_mma` (every tensor [NT] = [32 * NW], element e = thread e): a tile-wide
[BN, BG] layout would not survive the flattening that `tl.gather` needs (Triton re-lays the whole loop out
with one row per thread, and the activations are then converted once per weight). Thread e holds one 32-weight
sub-block column (groups 2h, 2h + 1 of the tile: one 8-byte load of grid bytes, one sign word, one qh byte,
one scale) of R rows, RB = NT / (BG / 2) rows apart; its activations are converted once and serve all R rows.
Precision: the f16 sub-block sum rounds at ~2**-11 of its magnitude, as in the other h2 variants.
"""
from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from .gemv_common import finish_at
from .gemv_h2_common import _EMULATE, compile_consts, factory, hfma2, lanes_f32, pack2, row_scale
from .gemv_iq3_s import SIGNED_WORDS, check_h2_tile
from .gemv_mma_common import join_tree, split_tree, stack_all
from .pdl import pdl_wait

_PAIR = tl.constexpr(0x83C083C0)           # f16 bits 15 and 9..6 of both lanes
_SIGNS = tl.constexpr(0x88008800)          # the sign bits of both pairs: 15/31 (w0, w2), 11/27 (w1, w3)
_H2_TABLE = tl.constexpr(SIGNED_WORDS)     # offset of this variant's table in the "grid" tensor
_UP_BIAS = tl.constexpr(267)               # up = 2**(140 - E): |x'| < 2**14
_BACK_BIAS = tl.constexpr(-13)             # back = 2**(E - 140) = 1 / up (the scale carries the 2**18)
_SCALE = tl.constexpr(262144.0)            # 2**18: the weights' f16 fields are c * 2**-18
_FIELD_SHIFTS = (6, 2, 22, 18)             # bit offsets of coordinates 0..3 in a grid word


def h2_grid_words(grid: np.ndarray) -> np.ndarray:
    """int64 [512] words of this variant's table from the [512, 4] coordinates (1..15)."""
    return sum(grid[:, j].astype(np.int64) << s for j, s in enumerate(_FIELD_SHIFTS))


@triton.jit
def _gather(tab, idx, LOG: tl.constexpr):
    """tab[idx] for a tuple of 2**LOG [NT] int32 index tensors: one shared-memory gather over all of them."""
    t = join_tree(idx, LOG)
    NT: tl.constexpr = idx[0].shape[0]
    v = tl.reshape(tl.gather(tab, tl.reshape(t, [NT << LOG]), 0), t.shape)
    return split_tree(v, LOG)


@triton.jit
def _load_row(qs, signs, qh, sc, d, row, h, G):
    """(8 grid indices, the two groups' spread sign words, the scale) of sub-block h of one row per thread."""
    q = tl.load(qs.to(tl.pointer_type(tl.int64), bitcast=True) + row * (G // 2) + h)
    sw = tl.load(signs.to(tl.pointer_type(tl.int32), bitcast=True) + row * (G // 2) + h)
    hb = tl.load(qh + row * (G // 2) + h).to(tl.int32)
    s4 = (tl.load(sc + row * (G // 4) + h // 2).to(tl.int32) >> (4 * (h % 2))) & 0xF
    s = tl.load(d + row * (G // 16) + h // 8).to(tl.float32) * ((1 + 2 * s4).to(tl.float32) * _SCALE)
    words = (q.to(tl.int32), (q >> 32).to(tl.int32))
    idx = ()
    for m in tl.static_range(8):
        idx = idx + (((words[m // 4] >> (8 * (m % 4))) & 0xFF) | (((hb >> m) & 1) << 8),)
    su = sw.to(tl.uint32, bitcast=True)
    spread = (((su << 8) & 0xFFFF00) | (su << 16), ((su >> 8) & 0xFFFF00) | (su & 0xFFFF0000))
    return idx, spread, s


@triton.jit
def _load_tile(qs, signs, qh, sc, d, rows, h, G, R: tl.constexpr):
    lds = ()
    for j in tl.static_range(R):
        lds = lds + (_load_row(qs, signs, qh, sc, d, rows[j], h, G),)
    return lds


@triton.jit
def _w_pairs(v, spread, m: tl.constexpr):
    """f16x2 bits of weights (4m, 4m+2) and (4m+1, 4m+3) of the sub-block from grid word v."""
    u = v.to(tl.uint32, bitcast=True) ^ ((spread[m // 4] << (m % 4)) & _SIGNS)
    return (u & _PAIR).to(tl.int32, bitcast=True), ((u << 4) & _PAIR).to(tl.int32, bitcast=True)


@triton.jit
def _x_pairs(x_ptr, row, k0, up, H2_MODE: tl.constexpr):
    """The sub-block's 32 activations * up as 16 f16x2 [NT] tensors in `_w_pairs` order: pair 2m + lo is
    (4m + lo, 4m + lo + 2). Loaded 8 at a time: a [NT, 32] load would be laid out 4 threads per row (for
    16-byte loads) and converted to the per-thread layout through shared memory."""
    NT: tl.constexpr = k0.shape[0]
    p = ()
    for c in tl.static_range(4):          # weights 8c..8c+7: m = 2c, 2c + 1
        xv = tl.load(x_ptr + row + k0[:, None] + (8 * c + tl.arange(0, 8))[None, :]).to(tl.float32) * up
        hi0, hi1 = tl.split(tl.permute(tl.reshape(xv, [NT, 2, 2, 2]), [0, 1, 3, 2]))   # weight 4m + 2hi + lo
        p = p + split_tree(tl.permute(pack2(hi0, hi1, H2_MODE), [0, 2, 1]), 2)          # index lo + 2 * m
    return p


@triton.jit
def _halves(a, b, HI: tl.constexpr, H2_MODE: tl.constexpr):
    """(a's low half, b's low half) as one word, or (HI) their high halves: one `prmt` (ptxas made two
    instructions of the bit operations)."""
    if H2_MODE == _EMULATE:
        if HI:
            return ((a >> 16) & 0xFFFF) | (b & -65536)
        else:
            return (a & 0xFFFF) | (b << 16)
    else:
        sel: tl.constexpr = "0x7632" if HI else "0x5410"
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, " + sel + ";", "=r,r,r", [a, b], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def x16_sub_block(x_ptr, row, h, G):
    """(the 16 prepared words of sub-block h of one row per thread as four [NT, 4] loads of 16 bytes, the back
    factor of its 128-chunk): word 4c + j holds activations (8c + j, 8c + j + 4) of the sub-block."""
    words = ()
    for c in tl.static_range(4):
        words = words + (tl.load(x_ptr + row + h[:, None] * 16 + (4 * c + tl.arange(0, 4))[None, :]),)
    return words, tl.load(x_ptr + row + G * 8 + h // 4).to(tl.float32, bitcast=True)


@triton.jit
def _x16_pairs(x_ptr, row, h, G, H2_MODE: tl.constexpr):
    """(`_x_pairs` from a prepared row, the chunk's back factor): pair 2m + lo of m = 2c + hi is the low (hi = 0) or
    high (hi = 1) halves of words 4c + lo and 4c + lo + 2 of the sub-block's 16 (`x16_sub_block`)."""
    NT: tl.constexpr = h.shape[0]
    words, back = x16_sub_block(x_ptr, row, h, G)
    p = ()
    for c in tl.static_range(4):
        e, o = tl.split(tl.reshape(words[c], [NT, 2, 2]))      # words (4c, 4c + 2), (4c + 1, 4c + 3)
        w0, w2 = tl.split(e)
        w1, w3 = tl.split(o)
        p = p + (_halves(w0, w2, False, H2_MODE), _halves(w1, w3, False, H2_MODE), _halves(w0, w2, True, H2_MODE),
                 _halves(w1, w3, True, H2_MODE))
    return p, back


@triton.jit
def _column_pairs(x_ptr, row, h, up, G, H2_MODE: tl.constexpr, XPRE: tl.constexpr):
    """(the 16 pairs of one T column, what the sub-block scale is multiplied by: XPRE the chunk's back, else 1,
    which the compiler folds)."""
    if XPRE:
        return _x16_pairs(x_ptr, row, h, G, H2_MODE)
    else:
        return _x_pairs(x_ptr, row, h * 32, up, H2_MODE), 1.0


@triton.jit
def _rows_dot(tab, lds, xp, xb, R: tl.constexpr, LOG_R: tl.constexpr, T_TILE: tl.constexpr,
              H2_MODE: tl.constexpr):
    """Per row and T column: the sub-block's f16 dot product as fp32 times its scale and the column's factor xb
    (`_column_pairs`; row-major tuple)."""
    idx = ()
    for j in tl.static_range(R):
        idx = idx + lds[j][0]
    v = _gather(tab, idx, 3 + LOG_R)
    out = ()
    for j in tl.static_range(R):
        w = ()
        for m in tl.static_range(8):
            w = w + _w_pairs(v[8 * j + m], lds[j][1], m)
        for tt in tl.static_range(T_TILE):
            acc = hfma2(w[0], xp[tt][0], tl.zeros_like(lds[j][0][0]), H2_MODE)
            for i in tl.static_range(1, 16):
                acc = hfma2(w[i], xp[tt][i], acc, H2_MODE)
            out = out + (lanes_f32(acc, H2_MODE) * (lds[j][2] * xb[tt]),)
    return out


@triton.jit
def thread_rows(N, BLOCK_N: tl.constexpr, GC: tl.constexpr, RB: tl.constexpr, R: tl.constexpr,
                NW: tl.constexpr):
    """(thread index e [NT], its sub-block column gc in the tile, its R rows, RB apart): GC threads per row. Tail
    rows re-read the last row and are never stored."""
    e = tl.arange(0, 32 * NW)
    gc, rb = e % GC, e // GC
    rows = ()
    for j in tl.static_range(R):
        rows = rows + (tl.minimum(tl.program_id(0) * BLOCK_N + rb + j * RB, N - 1),)
    return e, gc, rows


@triton.jit
def column_scales(x_ptr, T, G, split, stride_xt, fscale, T_TILE: tl.constexpr, BLOCK_G: tl.constexpr,
                  XPRE: tl.constexpr):
    """(t0, the CTA's group range g_lo..g_hi, and per T column its row offset, up and back): plain activations are
    scaled to |x'| < 2**14 over the CTA's K range (`row_scale`) and back * fscale undoes it; prepared ones carry
    each chunk's back into the sub-block scales, so up is 1 and back is fscale."""
    t0 = tl.program_id(2) * T_TILE
    g_per = tl.cdiv(tl.cdiv(G, split), BLOCK_G) * BLOCK_G
    g_lo = tl.program_id(1) * g_per
    g_hi = tl.minimum(G, g_lo + g_per)
    xrows, ups, backs = (), (), ()
    for tt in tl.static_range(T_TILE):
        xr = tl.minimum(t0 + tt, T - 1) * stride_xt
        if XPRE:
            xrows, ups, backs = xrows + (xr,), ups + (1.0,), backs + (fscale,)
        else:
            up, back = row_scale(x_ptr, xr, g_lo * 16, g_hi * 16, 512, _UP_BIAS, _BACK_BIAS)
            xrows, ups, backs = xrows + (xr,), ups + (up,), backs + (back * fscale,)
    return t0, g_lo, g_hi, xrows, ups, backs


@triton.jit
def iq3_s_h2_gemv_kernel(x_ptr, qs, signs, qh, sc, d, grid, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G,
                         split, stride_xt, stride_ot, stride_rt, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_G: tl.constexpr, USE_SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
                         DOT_KIND: tl.constexpr, EPI: tl.constexpr, EVEN_G: tl.constexpr,
                         FOLD: tl.constexpr, STAGES: tl.constexpr, H2_MODE: tl.constexpr, XPRE: tl.constexpr,
                         NW: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_wait(PDL)    # ninfer_kernels.pdl: before any load or store; finish_at triggers after the K loop
    # USE_DOT / DOT_KIND / FOLD / STAGES are accepted for the shared launcher and unused here; every K range is
    # whole tiles (K % 256 == 0, BLOCK_G divides 16), so EVEN_G is too. One mode, load then decode: a register
    # double buffer (191 registers) lost 25-30 % on the H200; an L2 prefetch of the next tile was never the
    # tuner's pick (bench/NOTES.md §8, §9). XPRE: x_ptr holds prepared activations (`ninfer_kernels.x16`)
    GC: tl.constexpr = BLOCK_G // 2       # threads per row: one sub-block (2 groups) each
    RB: tl.constexpr = 32 * NW // GC      # rows per pass of the CTA's threads
    R: tl.constexpr = BLOCK_N // RB       # rows per thread
    LOG_R: tl.constexpr = R.bit_length() - 1
    tl.static_assert(BLOCK_G >= 2 and BLOCK_G <= 16 and R >= 1 and R * RB == BLOCK_N and (1 << LOG_R) == R)
    tl.static_assert(T_TILE <= 8)
    e, gc, rows = thread_rows(N, BLOCK_N, GC, RB, R, NW)
    t0, g_lo, g_hi, xrows, ups, backs = column_scales(x_ptr, T, G, split, stride_xt, fscale, T_TILE, BLOCK_G,
                                                      XPRE)
    tab = tl.load(grid + _H2_TABLE + tl.arange(0, 512))
    accs = ()
    for _ in tl.static_range(R * T_TILE):
        accs = accs + (tl.zeros(e.shape, tl.float32),)
    for g0 in range(g_lo, g_hi, BLOCK_G):
        h = g0 // 2 + gc                  # the thread's sub-block
        lds = _load_tile(qs, signs, qh, sc, d, rows, h, G, R)
        xp, xb = (), ()
        for tt in tl.static_range(T_TILE):
            p, b = _column_pairs(x_ptr, xrows[tt], h, ups[tt], G, H2_MODE, XPRE)
            xp, xb = xp + (p,), xb + (b,)
        part = _rows_dot(tab, lds, xp, xb, R, LOG_R, T_TILE, H2_MODE)
        for i in tl.static_range(R * T_TILE):
            accs = accs[:i] + (accs[i] + part[i],) + accs[i + 1:]
    _epilogue(accs, backs, t0, N, T, split, out_ptr, stride_ot, res_ptr, stride_rt, ws_ptr, cnt_ptr, R, RB, GC,
              T_TILE, EPI, USE_SPLIT, PDL)


@triton.jit
def _epilogue(accs, backs, t0, N, T, split, out_ptr, stride_ot, res_ptr, stride_rt, ws_ptr, cnt_ptr,
              R: tl.constexpr, RB: tl.constexpr, GC: tl.constexpr, T_TILE: tl.constexpr, EPI: tl.constexpr,
              USE_SPLIT: tl.constexpr, PDL: tl.constexpr):
    """Each row's GC partial sums added across its threads (lanes), then all values in one split-K pass."""
    rb = tl.arange(0, RB)
    vals, rows, cols = (), (), ()
    for j in tl.static_range(R):
        for tt in tl.static_range(T_TILE):
            v = tl.sum(tl.reshape(accs[j * T_TILE + tt], [RB, GC]), axis=1) * backs[tt]
            vals = vals + (v,)
            rows = rows + (tl.program_id(0) * (R * RB) + rb + j * RB,)
            cols = cols + (tl.zeros_like(rb) + (t0 + tt),)
    LOG: tl.constexpr = (R * T_TILE).bit_length() - 1
    finish_at(stack_all(vals, LOG), stack_all(cols, LOG), stack_all(rows, LOG), N, T, split, out_ptr, stride_ot,
              res_ptr, stride_rt, ws_ptr, cnt_ptr, EPI, USE_SPLIT, T_TILE, R * RB, PDL)


h2_kernel = factory(iq3_s_h2_gemv_kernel, "iq3_s_gemv_kernel", per_thread=True,   # gemv_iq3_s registers it
                    check=check_h2_tile)


def kernel_for(fmt: str = "iq3_s_h2", dequant: bool = False, cc: int = 90):
    """(kernel, signature of its weight arguments, extra constexprs) for compile checks."""
    if dequant:
        raise ValueError("iq3_s_h2 has no dequantizer of its own (gemv_iq3_s's serves both)")
    sig = {"qs": "*i32", "signs": "*i16", "qh": "*u8", "sc": "*u8", "d": "*fp16", "grid": "*i32"}
    return iq3_s_h2_gemv_kernel, sig, {**compile_consts(cc), "NW": 4}
