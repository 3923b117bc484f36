"""NVFP4 dequant-GEMV on tensor cores without shared memory (T = 1..16, sm_80+): the `mma` variant of `gemv_nvfp4`.

Layout of the work (see `gemv_mma_common` for the per-thread formulation): a warp owns 16 * M_REP rows; per
K chunk of 128 weights (8 NVFP4 groups) the four lanes of a quad split a row's 64 code bytes into one 16-byte
load each (two groups, and their two E4M3 scale bytes as one u16). Lane (g, q) decodes rows g and g + 8 of
every m-tile into f16x2 pairs with the packed-half2 decode of `gemv_nvfp4_h2` (pairs (j, j+4) of each 32-bit
code word, e2m1 * 2**-14 exactly) times its group's scale as f16x2 (e4m3 * 2**7: the scale's 7 bits at f16
bits 13..7 are e4m3 * 2**-8 for every code, subnormals included, then one HMUL2 by 2**15), i.e. weight * 2**-7
exactly in f16. Pair 2s and 2s + 1 of a row are A's k slots of MMA s (8 MMAs per chunk and m-tile); B gets
the activations of the same real k of column t0 + g (and t0 + 8 + g for T tiles of 16), scaled per chunk and
quad into f16. So T = 1..8 cost the same MMAs and T = 16 twice as many, against the decode of every weight
once -- no weight tile goes through shared memory.

Requires G % BLOCK_G == 0 with BLOCK_G in {8, 16} (K a multiple of 128 or 256; every Qwen3.8 shape). Any
activation dtype works (all are rounded to f16 after the power-of-two scaling); the tuner offers this variant
for fp16/bf16 only. Weights as in `gemv_nvfp4` (codes int64 [N, K/16], E4M3 scales u8 [N, K/16], 16-byte
aligned). Output as the other GEMVs (split-K workspace, residual).

XPRE: x_ptr holds prepared activations (`ninfer_kernels.x16`: int32 words, stride_xt in words): each lane loads
its 16 pairs of a chunk and the chunk's back factor instead of converting, bounding and scaling 32 activations.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gemv_common import _tset, finish_at
from .gemv_h2_common import compile_consts, factory, hmul2, pack2
from .gemv_mma_common import col_back, mma, quad_max, split_all, stack_all, x_scale
from .gemv_nvfp4_h2 import _split_signs, _wpair

_F16_2_15 = tl.constexpr(0x78007800)        # 2**15 in both f16 lanes
_W_EXP = tl.constexpr(128.0)                # the f16 weights carry 2**-7


@triton.jit
def _load_chunk(x_ptr, codes, scales, rows, cols, gk, q, G, stride_xt, M_REP: tl.constexpr, NB: tl.constexpr,
                XPRE: tl.constexpr):
    """The raw bytes of chunk gk for this thread: per column block four 16-byte activation loads
    (x[col, 16 gk + 32q + 0..31]; a [NT, 32] load would be spread over 4 lanes by Triton; XPRE: the 16 prepared
    words of those activations and, fifth, the chunk's back factor), per row one 16-byte code load (groups
    gk + 2q, gk + 2q + 1) and one u16 of their two scale bytes."""
    ks = tl.multiple_of(gk * 16 + 32 * q, 32)
    xr = ()
    for nb in tl.static_range(NB):
        if XPRE:
            for h in tl.static_range(4):
                xr = xr + (tl.load(x_ptr + (cols[nb] * stride_xt + ks // 2 + 4 * h)[:, None]
                                   + tl.arange(0, 4)[None, :]),)
            xr = xr + (tl.load(x_ptr + cols[nb] * stride_xt + G * 8 + gk // 8),)
        else:
            for h in tl.static_range(4):
                xr = xr + (tl.load(x_ptr + (cols[nb] * stride_xt + ks + 8 * h)[:, None] + tl.arange(0, 8)[None, :]),)
    wr = ()
    for r in tl.static_range(2 * M_REP):
        off = tl.multiple_of(rows[r] * G + gk + 2 * q, 2)
        wr = wr + (tl.load(codes + off[:, None] + tl.arange(0, 2)[None, :]),
                   tl.load(scales.to(tl.pointer_type(tl.int16)) + off // 2))
    return xr, wr


@triton.jit
def _x_pairs(xr, nb: tl.constexpr, NW: tl.constexpr, MODE: tl.constexpr, XPRE: tl.constexpr):
    """(16 f16x2 B pairs, back) from column block nb's 32 activations: pair 4w + j holds elements
    (8w + j, 8w + j + 4), as the weight pairs; back undoes the quad's power-of-two scale."""
    if XPRE:                             # already in that order, with the chunk's back
        return _x16_pairs(xr, nb)
    else:
        return _bf16_pairs(xr, nb, NW, MODE)


@triton.jit
def _x16_pairs(xr, nb: tl.constexpr):
    p = ()
    for w in tl.static_range(4):
        p = p + split_all(xr[5 * nb + w], 2)
    return p, xr[5 * nb + 4].to(tl.float32, bitcast=True)


@triton.jit
def _bf16_pairs(xr, nb: tl.constexpr, NW: tl.constexpr, MODE: tl.constexpr):
    f = ()
    amax = tl.zeros(xr[0].shape[:1], tl.int32)
    for h in tl.static_range(4):
        xs = split_all(xr[4 * nb + h], 3)
        for i in tl.static_range(8):
            fi = xs[i].to(tl.float32)
            f = f + (fi,)
            amax = tl.maximum(amax, fi.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    up, back = x_scale(quad_max(amax, NW, MODE))
    p = ()
    for w in tl.static_range(4):
        for j in tl.static_range(4):
            p = p + (pack2(f[8 * w + j] * up, f[8 * w + j + 4] * up, MODE),)
    return p, back


@triton.jit
def _w_pairs(words, s16, MODE: tl.constexpr):
    """16 f16x2 A pairs (weight * 2**-7) of one row from its 16 code bytes and u16 of scale bytes."""
    ga, gb = tl.split(words)
    s = s16.to(tl.int32)
    sa, sb = s & 0x7F, (s >> 8) & 0x7F
    two15 = tl.full(s.shape, _F16_2_15, tl.int32)
    sc_a = hmul2((sa << 7) | (sa << 23), two15, MODE)
    sc_b = hmul2((sb << 7) | (sb << 23), two15, MODE)
    ws = (ga.to(tl.int32), (ga >> 32).to(tl.int32), gb.to(tl.int32), (gb >> 32).to(tl.int32))
    p = ()
    for w in tl.static_range(4):
        even, odd = _split_signs(ws[w], MODE)
        sc = sc_a if w < 2 else sc_b
        for j in tl.static_range(4):
            p = p + (hmul2(_wpair(even, odd, j), sc, MODE),)
    return p


@triton.jit
def _chunk(accs, loaded, M_REP: tl.constexpr, NB: tl.constexpr, NW: tl.constexpr, MODE: tl.constexpr,
           XPRE: tl.constexpr):
    """accs[(m * NB + nb) * 4 + i] += a loaded chunk's D fragment i of m-tile m and column block nb, times back."""
    xr, wr = loaded
    xps, backs = (), ()
    for nb in tl.static_range(NB):
        xp, back = _x_pairs(xr, nb, NW, MODE, XPRE)
        xps, backs = xps + (xp,), backs + (col_back(back, NW, MODE),)
    for m in tl.static_range(M_REP):
        top = _w_pairs(wr[4 * m], wr[4 * m + 1], MODE)
        bot = _w_pairs(wr[4 * m + 2], wr[4 * m + 3], MODE)
        for nb in tl.static_range(NB):
            z = tl.zeros(top[0].shape, tl.float32)
            d0, d1, d2, d3 = z, z, z, z
            for s in tl.static_range(8):
                d0, d1, d2, d3 = mma(top[2 * s], bot[2 * s], top[2 * s + 1], bot[2 * s + 1], xps[nb][2 * s],
                                     xps[nb][2 * s + 1], d0, d1, d2, d3, NW, MODE)
            accs = _add4(accs, (m * NB + nb) * 4, d0, d1, d2, d3, backs[nb])
    return accs


@triton.jit
def _load_step(x_ptr, codes, scales, rows, cols, g0, q, G, stride_xt, BLOCK_G: tl.constexpr,
               M_REP: tl.constexpr, NB: tl.constexpr, XPRE: tl.constexpr):
    """Every chunk of one K step (BLOCK_G / 8 of them)."""
    ld = ()
    for kc in tl.static_range(BLOCK_G // 8):
        ld = ld + (_load_chunk(x_ptr, codes, scales, rows, cols, g0 + kc * 8, q, G, stride_xt, M_REP, NB, XPRE),)
    return ld


@triton.jit
def _step(accs, ld, BLOCK_G: tl.constexpr, M_REP: tl.constexpr, NB: tl.constexpr, NW: tl.constexpr,
          MODE: tl.constexpr, XPRE: tl.constexpr):
    for kc in tl.static_range(BLOCK_G // 8):
        accs = _chunk(accs, ld[kc], M_REP, NB, NW, MODE, XPRE)
    return accs


@triton.jit
def _k_loop(accs, x_ptr, codes, scales, rows, cols, g_lo, g_hi, q, G, stride_xt, BLOCK_G: tl.constexpr,
            M_REP: tl.constexpr, NB: tl.constexpr, NW: tl.constexpr, STAGES: tl.constexpr, MODE: tl.constexpr,
            XPRE: tl.constexpr):
    """STAGES 1: load a step, then decode it (ptxas interleaves the loads with the previous m-tiles' work, so
    their latency is exposed once per m-tile); 2: the next step's loads are issued before this step's decode
    (a register double buffer; the last step re-reads itself, from L2). (A barrier after a step's loads, which
    keeps the T = 1 h2 loop's loads together, did not: ptxas still interleaved them, Triton 3.6 sm_90 SASS.)"""
    if STAGES == 2:
        ld = _load_step(x_ptr, codes, scales, rows, cols, g_lo, q, G, stride_xt, BLOCK_G, M_REP, NB, XPRE)
        for g0 in range(g_lo, g_hi, BLOCK_G):
            nxt = _load_step(x_ptr, codes, scales, rows, cols, tl.minimum(g0 + BLOCK_G, g_hi - BLOCK_G), q, G,
                             stride_xt, BLOCK_G, M_REP, NB, XPRE)
            tl.debug_barrier()
            accs = _step(accs, ld, BLOCK_G, M_REP, NB, NW, MODE, XPRE)
            ld = nxt
    else:
        for g0 in range(g_lo, g_hi, BLOCK_G):
            accs = _step(accs, _load_step(x_ptr, codes, scales, rows, cols, g0, q, G, stride_xt, BLOCK_G, M_REP, NB,
                                          XPRE), BLOCK_G, M_REP, NB, NW, MODE, XPRE)
    return accs


@triton.jit
def _add4(accs, i: tl.constexpr, d0, d1, d2, d3, back):
    be, bo = back                     # D's columns 2q and 2q + 1
    accs = _tset(accs, i, accs[i] + d0 * be)
    accs = _tset(accs, i + 1, accs[i + 1] + d1 * bo)
    accs = _tset(accs, i + 2, accs[i + 2] + d2 * be)
    return _tset(accs, i + 3, accs[i + 3] + d3 * bo)


@triton.jit
def nvfp4_mma_gemv_kernel(x_ptr, codes, scales, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split,
                          stride_xt, stride_ot, stride_rt, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_G: tl.constexpr, USE_SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
                          DOT_KIND: tl.constexpr, HAS_RES: tl.constexpr, EVEN_G: tl.constexpr,
                          FOLD: tl.constexpr, STAGES: tl.constexpr, H2_MODE: tl.constexpr, NW: tl.constexpr,
                          XPRE: tl.constexpr = False):
    # USE_DOT / DOT_KIND / FOLD / EVEN_G are accepted for the shared launcher and unused here
    tl.static_assert(BLOCK_N % (16 * NW) == 0 and (BLOCK_G == 8 or BLOCK_G == 16))
    tl.static_assert((T_TILE == 8 or T_TILE == 16) and 1 <= STAGES and STAGES <= 2)
    M_REP: tl.constexpr = BLOCK_N // (16 * NW)
    NB: tl.constexpr = T_TILE // 8
    e = tl.arange(0, NW * 32)
    g, q = (e % 32) // 4, e % 4
    base = tl.program_id(0) * BLOCK_N + (e // 32) * (16 * M_REP) + g
    rows, offs = (), ()
    for r in tl.static_range(2 * M_REP):      # m-tile r // 2, its row g (r even) or g + 8 (r odd)
        o = base + (r // 2) * 16 + (r % 2) * 8
        offs, rows = offs + (o,), rows + (tl.minimum(o, N - 1),)   # tail rows re-read the last row, never stored
    t0 = tl.program_id(2) * T_TILE
    cols = ()
    for nb in tl.static_range(NB):            # columns past T re-read column T - 1, never stored
        cols = cols + (tl.minimum(t0 + nb * 8 + g, T - 1),)
    g_per = tl.cdiv(tl.cdiv(G, split), BLOCK_G) * BLOCK_G
    g_lo = tl.program_id(1) * g_per
    g_hi = tl.minimum(G, g_lo + g_per)
    accs = ()
    for _ in tl.static_range(M_REP * NB * 4):
        accs = accs + (tl.zeros(e.shape, tl.float32),)
    accs = _k_loop(accs, x_ptr, codes, scales, rows, cols, g_lo, g_hi, q, G, stride_xt, BLOCK_G, M_REP, NB, NW,
                   STAGES, H2_MODE, XPRE)
    _epilogue(accs, offs, t0, q, fscale * _W_EXP, N, T, split, out_ptr, stride_ot, res_ptr, stride_rt, ws_ptr,
              cnt_ptr, M_REP, NB, HAS_RES, USE_SPLIT)


@triton.jit
def _coords(offs, t0, q, k: tl.constexpr, NB: tl.constexpr):
    """(row, column) of accumulator k = (m * NB + nb) * 4 + i: D fragment i is (row g | g + 8, column 2q | 2q + 1)."""
    r: tl.constexpr = 2 * (k // (4 * NB)) + (k % 4) // 2
    c: tl.constexpr = ((k // 4) % NB) * 8 + k % 2
    return offs[r], t0 + c + 2 * q


@triton.jit
def _epilogue(accs, offs, t0, q, scale, N, T, split, out_ptr, stride_ot, res_ptr, stride_rt, ws_ptr, cnt_ptr,
              M_REP: tl.constexpr, NB: tl.constexpr, HAS_RES: tl.constexpr, USE_SPLIT: tl.constexpr):
    """All of a thread's accumulators as one [NT, V] tile, so the split-K reduction reads every value of a split
    in one step (a loop per value would chain V x split L2 round trips)."""
    vals, rows, cols = (), (), ()
    for k in tl.static_range(M_REP * NB * 4):
        r, c = _coords(offs, t0, q, k, NB)
        vals, rows, cols = vals + (accs[k] * scale,), rows + (r,), cols + (c,)
    LOG: tl.constexpr = (M_REP * NB * 4).bit_length() - 1
    finish_at(stack_all(vals, LOG), stack_all(cols, LOG), stack_all(rows, LOG), N, T, split, out_ptr, stride_ot,
              res_ptr, stride_rt, ws_ptr, cnt_ptr, HAS_RES, USE_SPLIT)


# gemv_nvfp4 registers it (lazily)
mma_kernel = factory(nvfp4_mma_gemv_kernel, "nvfp4_gemv_kernel", per_thread=True)


def kernel_for(fmt: str = "nvfp4_mma", dequant: bool = False, cc: int = 90):
    """(kernel, signature of its weight arguments, extra constexprs) for compile checks."""
    if dequant:
        raise ValueError("nvfp4_mma has no dequantizer of its own (gemv_nvfp4's serves both)")
    return nvfp4_mma_gemv_kernel, {"codes": "*i64", "scales": "*u8"}, {**compile_consts(cc), "NW": 4}
