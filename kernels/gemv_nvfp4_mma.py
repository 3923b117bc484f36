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
for fp16/bf16 only. Weights as in `gemv_nvfp4` (its chunk-major planes: a lane's 16 bytes of a row's chunk
are one load, and a 128-row tile's chunk is one 8 KB run). Output as the other GEMVs (split-K workspace, residual).

XPRE: x_ptr holds prepared activations (`ninfer_kernels.x16`: int32 words, stride_xt in words): each lane loads
its 16 pairs of a chunk and the chunk's back factor instead of converting, bounding and scaling 32 activations.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gemv_common import NVFP4_EVICT, ldw
from .gemv_h2_common import compile_consts, factory, hmul2
from .gemv_mma_body import mma_body, no_prep
from .gemv_nvfp4_h2 import _split_signs, _wpair
from .pdl import pdl_wait

_F16_2_15 = tl.constexpr(0x78007800)        # 2**15 in both f16 lanes
_W_EXP = tl.constexpr(128.0)                # the f16 weights carry 2**-7


@triton.jit
def _load_row(wts, row, gk, q, G):
    """(16 code bytes of groups gk + 2q, gk + 2q + 1 as [NT, 2] int64, their two scale bytes as one u16): chunk
    gk // 8 of the row, in `gemv_nvfp4`'s chunk-major planes, starts at word (gk // 8 * N + row) * 8."""
    codes, scales, n = wts
    off = tl.multiple_of((gk // 8 * n + row) * 8 + 2 * q, 2)
    return (ldw(codes + off[:, None] + tl.arange(0, 2)[None, :], None, NVFP4_EVICT),
            ldw(scales.to(tl.pointer_type(tl.int16)) + off // 2, None, NVFP4_EVICT))


@triton.jit
def _row_pairs(wr, base: tl.constexpr, MODE: tl.constexpr):
    return _w_pairs(wr[base], wr[base + 1], MODE)


@triton.jit
def _no_factor(wr, base: tl.constexpr):
    return None


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
def nvfp4_mma_gemv_kernel(x_ptr, codes, scales, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split,
                          stride_xt, stride_ot, stride_rt, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_G: tl.constexpr, USE_SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
                          DOT_KIND: tl.constexpr, EPI: tl.constexpr, EVEN_G: tl.constexpr,
                          FOLD: tl.constexpr, STAGES: tl.constexpr, H2_MODE: tl.constexpr, NW: tl.constexpr,
                          XPRE: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_wait(PDL)    # ninfer_kernels.pdl: before any load or store; finish_at triggers after the K loop
    # USE_DOT / DOT_KIND / FOLD / EVEN_G are accepted for the shared launcher and unused here
    mma_body(x_ptr, (codes, scales, N), None, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale * _W_EXP, T, N, G, split,
             stride_xt, stride_ot, stride_rt, T_TILE, BLOCK_N, BLOCK_G, USE_SPLIT, EPI, STAGES, H2_MODE, NW,
             XPRE, _load_row, no_prep, 2, _row_pairs, _no_factor, False, PDL=PDL)


# gemv_nvfp4 registers it (lazily)
mma_kernel = factory(nvfp4_mma_gemv_kernel, "nvfp4_gemv_kernel", per_thread=True)


def kernel_for(fmt: str = "nvfp4_mma", dequant: bool = False, cc: int = 90):
    """(kernel, signature of its weight arguments, extra constexprs) for compile checks."""
    if dequant:
        raise ValueError("nvfp4_mma has no dequantizer of its own (gemv_nvfp4's serves both)")
    return nvfp4_mma_gemv_kernel, {"codes": "*i64", "scales": "*u8"}, {**compile_consts(cc), "NW": 4}
