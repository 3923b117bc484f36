"""GGML IQ3_S dequant-GEMV on tensor cores (T = 1..16, sm_80+): the `mma` variant of `gemv_iq3_s`.

Why: the packed-half2 variant (`gemv_iq3_s_h2`) costs 16 HFMA2 per 32 weights per T column, so T = 4 / 8 ran at
2.3x / 4.5x its T = 1 time on the H200 (bench/results/kernels.json, §8 of bench/NOTES.md); here T = 1..8 cost the
same MMAs. Skeleton and lane layout: `gemv_mma_body`. A lane's 32 weights of a chunk (groups gk + 2q, gk + 2q + 1)
are exactly IQ3_S sub-block h = gk / 2 + q, so per row it loads one int64 of grid index bytes, the two groups'
repacked sign words as one int32, the sub-block's qh byte, its scale byte and the row's super-block d (one per
256 weights, so one per chunk of 128).

Decode: the 9-bit grid indices of every row the lane holds go through one shared-memory gather per chunk
(`PREP`, from the unsigned 512-word table of `gemv_iq3_s_h2`, whose words hold coordinates c0..c3 as f16
subnormal fields c * 2**-18 at (c0, c2) and, shifted by 4, (c1, c3), signs XOR-ed in as there). MMA pair
4w + j needs weights (8w + j, 8w + j + 4) = coordinate j of grid words 2w and 2w + 1: the halves of their
(c0, c2) / (c1, c3) pairs recombined. Each pair is multiplied by (1 + 2 * s4) as f16x2: c * (1 + 2 * s4) <= 465,
times 2**-18, is exact in f16 (normal or subnormal). The MMA sums a chunk in fp32; d of each row multiplies the
result (`ROW_FACTOR`) and 2**18 goes into fscale.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gemv_h2_common import compile_consts, factory, hmul2
from .gemv_iq3_s_h2 import _H2_TABLE, _SCALE, _gather, _w_pairs
from .gemv_mma_body import mma_body
from .pdl import pdl_wait

_ROW = tl.constexpr(11)          # per-row values after _prep: 8 grid words, sign word, s4, d


@triton.jit
def _load_row(wts, row, gk, q, G):
    """(8 grid index bytes as int64, the sub-block's two permuted sign words as int32, its qh byte, its 4-bit scale,
    the row's d for this chunk) of sub-block gk / 2 + q of one row."""
    qs, signs, qh, sc, d = wts
    h = gk // 2 + q
    return (tl.load(qs.to(tl.pointer_type(tl.int64), bitcast=True) + row * (G // 2) + h),
            tl.load(signs.to(tl.pointer_type(tl.int32), bitcast=True) + row * (G // 2) + h),
            tl.load(qh + row * (G // 2) + h),
            (tl.load(sc + row * (G // 4) + h // 2).to(tl.int32) >> (4 * (q % 2))) & 0xF,
            tl.load(d + row * (G // 16) + gk // 16))


@triton.jit
def _prep(wr, tab, NR: tl.constexpr):
    """The loaded rows (5 values each) -> 11 values each: their 8 indices looked up in one gather."""
    idx = ()
    for r in tl.static_range(NR):
        q = wr[5 * r]
        hb = wr[5 * r + 2].to(tl.int32)
        words = (q.to(tl.int32), (q >> 32).to(tl.int32))
        for m in tl.static_range(8):
            idx = idx + (((words[m // 4] >> (8 * (m % 4))) & 0xFF) | (((hb >> m) & 1) << 8),)
    LOG: tl.constexpr = (8 * NR).bit_length() - 1
    v = _gather(tab, idx, LOG)
    out = ()
    for r in tl.static_range(NR):
        out = out + v[8 * r:8 * r + 8] + (wr[5 * r + 1], wr[5 * r + 3], wr[5 * r + 4])
    return out


@triton.jit
def _row_pairs(wr, base: tl.constexpr, MODE: tl.constexpr):
    """16 f16x2 A pairs (weight / d * 2**-18) of one row: pair 4w + j = coordinate j of grid words 2w, 2w + 1."""
    su = wr[base + 8].to(tl.uint32, bitcast=True)
    spread = (((su << 8) & 0xFFFF00) | (su << 16), ((su >> 8) & 0xFFFF00) | (su & 0xFFFF0000))
    s = (1 + 2 * wr[base + 9]).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    s2 = s | (s << 16)
    p = ()
    for w in tl.static_range(4):
        a02, a13 = _w_pairs(wr[base + 2 * w], spread, 2 * w)
        b02, b13 = _w_pairs(wr[base + 2 * w + 1], spread, 2 * w + 1)
        p = p + (hmul2(_lows(a02, b02), s2, MODE), hmul2(_lows(a13, b13), s2, MODE),
                 hmul2(_highs(a02, b02), s2, MODE), hmul2(_highs(a13, b13), s2, MODE))
    return p


@triton.jit
def _lows(a, b):
    """(low half of a, low half of b) as one f16x2 word."""
    return (a & 0xFFFF) | (b << 16)


@triton.jit
def _highs(a, b):
    """(high half of a, high half of b) as one f16x2 word."""
    return ((a >> 16) & 0xFFFF) | (b & -65536)


@triton.jit
def _row_factor(wr, base: tl.constexpr):
    return wr[base + 10].to(tl.float32)


@triton.jit
def iq3_s_mma_gemv_kernel(x_ptr, qs, signs, qh, sc, d, grid, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G,
                          split, stride_xt, stride_ot, stride_rt, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_G: tl.constexpr, USE_SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
                          DOT_KIND: tl.constexpr, EPI: tl.constexpr, EVEN_G: tl.constexpr,
                          FOLD: tl.constexpr, STAGES: tl.constexpr, H2_MODE: tl.constexpr, NW: tl.constexpr,
                          XPRE: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_wait(PDL)    # ninfer_kernels.pdl: before any load or store; finish_at triggers after the K loop
    # USE_DOT / DOT_KIND / FOLD / EVEN_G are accepted for the shared launcher and unused here
    tab = tl.load(grid + _H2_TABLE + tl.arange(0, 512))
    mma_body(x_ptr, (qs, signs, qh, sc, d), tab, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale * _SCALE, T, N, G, split,
             stride_xt, stride_ot, stride_rt, T_TILE, BLOCK_N, BLOCK_G, USE_SPLIT, EPI, STAGES, H2_MODE, NW,
             XPRE, _load_row, _prep, _ROW, _row_pairs, _row_factor, True, PDL=PDL)


# gemv_iq3_s registers it (lazily)
mma_kernel = factory(iq3_s_mma_gemv_kernel, "iq3_s_gemv_kernel", per_thread=True)


def kernel_for(fmt: str = "iq3_s_mma", dequant: bool = False, cc: int = 90):
    """(kernel, signature of its weight arguments, extra constexprs) for compile checks."""
    if dequant:
        raise ValueError("iq3_s_mma has no dequantizer of its own (gemv_iq3_s's serves both)")
    sig = {"qs": "*i32", "signs": "*i16", "qh": "*u8", "sc": "*u8", "d": "*fp16", "grid": "*i32"}
    return iq3_s_mma_gemv_kernel, sig, {**compile_consts(cc), "NW": 4}
