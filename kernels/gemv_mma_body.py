"""The warp-MMA GEMV skeleton shared by the formats' mma variants (`gemv_nvfp4_mma`, `gemv_q6_k_mma`).

A warp owns 16 * M_REP rows; per K chunk of 128 weights (8 groups of 16) the four lanes of a quad split a row
into 32-weight quarters, lane (g, q) taking groups gk + 2q and gk + 2q + 1 of rows g and g + 8 of every m-tile.
Each lane decodes its own bytes into 16 f16x2 A pairs per row, pair 4w + j = weights (8w + j, 8w + j + 4) of its
32, and puts the activations of the same real k into B (`gemv_mma_common`: the k order inside an MMA is free).
A format supplies (`wts`: its weight pointers as a tuple; `aux`: a tensor its kernel made, e.g. a lookup table)
  LOAD_ROW(wts, row, gk, q, G) -> raw tensors [NT, ...]                this lane's bytes of one row of chunk gk
  PREP(wr, aux, NR) -> R tensors per row                              once per chunk over all NR rows' raw values
                                                                      (IQ3_S: one table gather; else identity)
  ROW_PAIRS(wr, base, MODE) -> 16 f16x2 pairs [NT] int32              from wr[base .. base + R - 1]
  ROW_FACTOR(wr, base) -> fp32 [NT]                                   a per-row, per-chunk factor applied to
                                                                      the MMA result (HAS_FACTOR; Q6_K's d)
and the weights' power of two goes into `fscale` by the caller. Activations: per chunk and T column the quad
that holds the column scales its 32 into f16 by a power of two (`x_scale`, |x'| < 2**15), or, with XPRE, loads
prepared pairs and the chunk's back factor (`ninfer_kernels.x16`). So T = 1..8 cost the same MMAs and T = 16
twice as many, against one decode of every weight; no weight tile goes through shared memory.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gemv_common import _tset, finish_at
from .gemv_h2_common import pack2
from .gemv_mma_common import col_back, mma, quad_max, split_all, stack_all, x_scale


@triton.jit
def no_prep(wr, aux, NR: tl.constexpr):
    """PREP of the formats whose ROW_PAIRS read the loaded values as they are."""
    return wr


@triton.jit
def _load_chunk(x_ptr, wts, rows, cols, gk, q, G, stride_xt, M_REP: tl.constexpr, NB: tl.constexpr,
                XPRE: tl.constexpr, LOAD_ROW: tl.constexpr):
    """The raw bytes of chunk gk for this thread: per column block four 16-byte activation loads
    (x[col, 16 gk + 32q + 0..31]; a [NT, 32] load would be spread over 4 lanes by Triton; XPRE: the 16 prepared
    words of those activations and, fifth, the chunk's back factor), per row the format's LOAD_ROW."""
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
        wr = wr + LOAD_ROW(wts, rows[r], gk, q, G)
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
def _chunk(accs, loaded, aux, M_REP: tl.constexpr, NB: tl.constexpr, NW: tl.constexpr, MODE: tl.constexpr,
           XPRE: tl.constexpr, PREP: tl.constexpr, R: tl.constexpr, ROW_PAIRS: tl.constexpr,
           ROW_FACTOR: tl.constexpr, HAS_FACTOR: tl.constexpr):
    """accs[(m * NB + nb) * 4 + i] += a loaded chunk's D fragment i of m-tile m and column block nb, times back
    (and the rows' factors)."""
    xr, wr = loaded
    wr = PREP(wr, aux, 2 * M_REP)
    xps, backs = (), ()
    for nb in tl.static_range(NB):
        xp, back = _x_pairs(xr, nb, NW, MODE, XPRE)
        xps, backs = xps + (xp,), backs + (col_back(back, NW, MODE),)
    for m in tl.static_range(M_REP):
        top = ROW_PAIRS(wr, (2 * m) * R, MODE)
        bot = ROW_PAIRS(wr, (2 * m + 1) * R, MODE)
        for nb in tl.static_range(NB):
            z = tl.zeros(top[0].shape, tl.float32)
            d0, d1, d2, d3 = z, z, z, z
            for s in tl.static_range(8):
                d0, d1, d2, d3 = mma(top[2 * s], bot[2 * s], top[2 * s + 1], bot[2 * s + 1], xps[nb][2 * s],
                                     xps[nb][2 * s + 1], d0, d1, d2, d3, NW, MODE)
            if HAS_FACTOR:
                ft, fb = ROW_FACTOR(wr, (2 * m) * R), ROW_FACTOR(wr, (2 * m + 1) * R)
                d0, d1, d2, d3 = d0 * ft, d1 * ft, d2 * fb, d3 * fb
            accs = _add4(accs, (m * NB + nb) * 4, d0, d1, d2, d3, backs[nb])
    return accs


@triton.jit
def _add4(accs, i: tl.constexpr, d0, d1, d2, d3, back):
    be, bo = back                     # D's columns 2q and 2q + 1
    accs = _tset(accs, i, accs[i] + d0 * be)
    accs = _tset(accs, i + 1, accs[i + 1] + d1 * bo)
    accs = _tset(accs, i + 2, accs[i + 2] + d2 * be)
    return _tset(accs, i + 3, accs[i + 3] + d3 * bo)


@triton.jit
def _load_step(x_ptr, wts, rows, cols, g0, q, G, stride_xt, BLOCK_G: tl.constexpr,
               M_REP: tl.constexpr, NB: tl.constexpr, XPRE: tl.constexpr, LOAD_ROW: tl.constexpr):
    """Every chunk of one K step (BLOCK_G / 8 of them)."""
    ld = ()
    for kc in tl.static_range(BLOCK_G // 8):
        ld = ld + (_load_chunk(x_ptr, wts, rows, cols, g0 + kc * 8, q, G, stride_xt, M_REP, NB, XPRE,
                               LOAD_ROW),)
    return ld


@triton.jit
def _step(accs, ld, aux, BLOCK_G: tl.constexpr, M_REP: tl.constexpr, NB: tl.constexpr, NW: tl.constexpr,
          MODE: tl.constexpr, XPRE: tl.constexpr, PREP: tl.constexpr, R: tl.constexpr, ROW_PAIRS: tl.constexpr,
          ROW_FACTOR: tl.constexpr, HAS_FACTOR: tl.constexpr):
    for kc in tl.static_range(BLOCK_G // 8):
        accs = _chunk(accs, ld[kc], aux, M_REP, NB, NW, MODE, XPRE, PREP, R, ROW_PAIRS, ROW_FACTOR, HAS_FACTOR)
    return accs


@triton.jit
def _k_loop(accs, x_ptr, wts, aux, rows, cols, g_lo, g_hi, q, G, stride_xt, BLOCK_G: tl.constexpr,
            M_REP: tl.constexpr, NB: tl.constexpr, NW: tl.constexpr, STAGES: tl.constexpr, MODE: tl.constexpr,
            XPRE: tl.constexpr, LOAD_ROW: tl.constexpr, PREP: tl.constexpr, R: tl.constexpr,
            ROW_PAIRS: tl.constexpr, ROW_FACTOR: tl.constexpr, HAS_FACTOR: tl.constexpr):
    """STAGES 1: load a step, then decode it (ptxas interleaves the loads with the previous m-tiles' work, so
    their latency is exposed once per m-tile); 2: the next step's loads are issued before this step's decode
    (a register double buffer; the last step re-reads itself, from L2). (A barrier after a step's loads, which
    keeps the T = 1 h2 loop's loads together, did not: ptxas still interleaved them, Triton 3.6 sm_90 SASS.)
    3: two steps' loads in flight ahead of the decode (a triple buffer: more bytes outstanding per warp, for the
    T = 4..8 loops that run at ~40 % of copy bandwidth; the last two steps re-read themselves)."""
    if STAGES >= 2:
        last = g_hi - BLOCK_G
        ld = _load_step(x_ptr, wts, rows, cols, g_lo, q, G, stride_xt, BLOCK_G, M_REP, NB, XPRE, LOAD_ROW)
        if STAGES == 3:
            ld1 = _load_step(x_ptr, wts, rows, cols, tl.minimum(g_lo + BLOCK_G, last), q, G, stride_xt,
                             BLOCK_G, M_REP, NB, XPRE, LOAD_ROW)
        for g0 in range(g_lo, g_hi, BLOCK_G):
            nxt = _load_step(x_ptr, wts, rows, cols, tl.minimum(g0 + (STAGES - 1) * BLOCK_G, last), q, G,
                             stride_xt, BLOCK_G, M_REP, NB, XPRE, LOAD_ROW)
            tl.debug_barrier()
            accs = _step(accs, ld, aux, BLOCK_G, M_REP, NB, NW, MODE, XPRE, PREP, R, ROW_PAIRS, ROW_FACTOR,
                          HAS_FACTOR)
            if STAGES == 3:
                ld, ld1 = ld1, nxt
            else:
                ld = nxt
    else:
        for g0 in range(g_lo, g_hi, BLOCK_G):
            ld = _load_step(x_ptr, wts, rows, cols, g0, q, G, stride_xt, BLOCK_G, M_REP, NB, XPRE,
                            LOAD_ROW)
            accs = _step(accs, ld, aux, BLOCK_G, M_REP, NB, NW, MODE, XPRE, PREP, R, ROW_PAIRS, ROW_FACTOR,
                          HAS_FACTOR)
    return accs


@triton.jit
def mma_body(x_ptr, wts, aux, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split, stride_xt,
             stride_ot, stride_rt, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
             USE_SPLIT: tl.constexpr, EPI: tl.constexpr, STAGES: tl.constexpr, MODE: tl.constexpr,
             NW: tl.constexpr, XPRE: tl.constexpr, LOAD_ROW: tl.constexpr, PREP: tl.constexpr, R: tl.constexpr,
             ROW_PAIRS: tl.constexpr, ROW_FACTOR: tl.constexpr, HAS_FACTOR: tl.constexpr, PDL: tl.constexpr = 0):
    """Grid and split-K as `gemv_common.gemv_body`; fscale includes the weights' power of two. PDL: the caller
    waited, the epilogue triggers (`gemv_common.finish_at`)."""
    tl.static_assert(BLOCK_N % (16 * NW) == 0 and (BLOCK_G == 8 or BLOCK_G == 16))
    tl.static_assert((T_TILE == 8 or T_TILE == 16) and 1 <= STAGES and STAGES <= 3)
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
    accs = _k_loop(accs, x_ptr, wts, aux, rows, cols, g_lo, g_hi, q, G, stride_xt, BLOCK_G, M_REP, NB, NW,
                   STAGES, MODE, XPRE, LOAD_ROW, PREP, R, ROW_PAIRS, ROW_FACTOR, HAS_FACTOR)
    _epilogue(accs, offs, t0, q, fscale, N, T, split, out_ptr, stride_ot, res_ptr, stride_rt, ws_ptr, cnt_ptr,
              M_REP, NB, EPI, USE_SPLIT, BLOCK_N, PDL)


@triton.jit
def _coords(offs, t0, q, k: tl.constexpr, NB: tl.constexpr):
    """(row, column) of accumulator k = (m * NB + nb) * 4 + i: D fragment i is (row g | g + 8, column 2q | 2q + 1)."""
    r: tl.constexpr = 2 * (k // (4 * NB)) + (k % 4) // 2
    c: tl.constexpr = ((k // 4) % NB) * 8 + k % 2
    return offs[r], t0 + c + 2 * q


@triton.jit
def _epilogue(accs, offs, t0, q, scale, N, T, split, out_ptr, stride_ot, res_ptr, stride_rt, ws_ptr, cnt_ptr,
              M_REP: tl.constexpr, NB: tl.constexpr, EPI: tl.constexpr, USE_SPLIT: tl.constexpr,
              BLOCK_N: tl.constexpr, PDL: tl.constexpr = 0):
    """All of a thread's accumulators as one [NT, V] tile, so the split-K reduction reads every value of a split
    in one step (a loop per value would chain V x split L2 round trips)."""
    vals, rows, cols = (), (), ()
    for k in tl.static_range(M_REP * NB * 4):
        r, c = _coords(offs, t0, q, k, NB)
        vals, rows, cols = vals + (accs[k] * scale,), rows + (r,), cols + (c,)
    LOG: tl.constexpr = (M_REP * NB * 4).bit_length() - 1
    finish_at(stack_all(vals, LOG), stack_all(cols, LOG), stack_all(rows, LOG), N, T, split, out_ptr, stride_ot,
              res_ptr, stride_rt, ws_ptr, cnt_ptr, EPI, USE_SPLIT, NB * 8, BLOCK_N, PDL)
