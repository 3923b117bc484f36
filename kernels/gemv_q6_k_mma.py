"""GGML Q6_K dequant-GEMV on tensor cores without shared memory (T = 1..16, sm_80+): the `mma` variant of `gemv_q6_k`.

Why: at T = 4..16 the Q6_K GEMVs ran the tl.dot path at 1.7-2.0x their T = 1 time (lm_head 570 vs 337 us on the
H200, bench/results/kernels.json), the MMA-less packed-half2 loop costing one HFMA2 per weight pair and column.
Skeleton and lane layout: `gemv_mma_body` (as `gemv_nvfp4_mma`). Per chunk of 128 weights lane (g, q) loads, for
rows g and g + 8 of every m-tile, groups gk + 2q and gk + 2q + 1 of the repacked planes (`repack_q6_k`): 16 bytes
of low nibbles, 8 of pre-spread high bits, the two int8 sub-block scales as one u16, and the row's fp16
super-block scale d (one per 256 weights, so one per chunk). The 6-bit codes are assembled as in `gemv_q6_k`
and turned into f16 (code - 32) pairs as in `gemv_q6_k_h2` (exact), then multiplied by the sub-block scale as
f16x2: (code - 32) * sc is an integer of magnitude <= 4096, exact in f16 up to 2048 and within 2**-12 relative
above. The MMA sums the chunk in fp32; d of each row multiplies the result (`ROW_FACTOR`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gemv_common import Q6_K_EVICT, ldw
from .gemv_h2_common import compile_consts, factory, hmul2
from .gemv_mma_body import mma_body, no_prep
from .gemv_q6_k_h2 import _pairs
from .pdl import pdl_wait


@triton.jit
def _load_row(wts, row, gk, q, G):
    """(low nibbles of groups gk + 2q, +1 [NT, 2] int64, their high bits [NT, 2] int32, their two scales as one
    int16, the row's super-block scale d (fp16) for this chunk)."""
    ql, qh, sc, d = wts
    off = tl.multiple_of(row * G + gk + 2 * q, 2)
    return (ldw(ql + off[:, None] + tl.arange(0, 2)[None, :], None, Q6_K_EVICT),
            ldw(qh + off[:, None] + tl.arange(0, 2)[None, :], None, Q6_K_EVICT),
            ldw(sc.to(tl.pointer_type(tl.int16)) + off // 2, None, Q6_K_EVICT),
            tl.load(d + row * (G // 16) + gk // 16))


@triton.jit
def _group_pairs(q, h, s, MODE: tl.constexpr):
    """8 f16x2 pairs (code - 32) * sc of one group, in the (j, j+4) order: e0, o1, e2, o3, e8, o9, e10, o11."""
    a = q.to(tl.int32)
    b = (q >> 32).to(tl.int32)
    qe_a = (a & 0x0F0F0F0F) | (h & 0x30303030)
    qo_a = ((a >> 4) & 0x0F0F0F0F) | ((h << 2) & 0x30303030)
    qe_b = (b & 0x0F0F0F0F) | ((h >> 2) & 0x30303030)
    qo_b = ((b >> 4) & 0x0F0F0F0F) | ((h << 4) & 0x30303030)
    e0, e2 = _pairs(qe_a, MODE, False)      # unscaled: the MMA accumulates in fp32
    o1, o3 = _pairs(qo_a, MODE, False)
    e8, e10 = _pairs(qe_b, MODE, False)
    o9, o11 = _pairs(qo_b, MODE, False)
    s16 = s.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    s2 = s16 | (s16 << 16)
    return (hmul2(e0, s2, MODE), hmul2(o1, s2, MODE), hmul2(e2, s2, MODE), hmul2(o3, s2, MODE),
            hmul2(e8, s2, MODE), hmul2(o9, s2, MODE), hmul2(e10, s2, MODE), hmul2(o11, s2, MODE))


@triton.jit
def _row_pairs(wr, base: tl.constexpr, MODE: tl.constexpr):
    qa, qb = tl.split(wr[base])
    ha, hb = tl.split(wr[base + 1])
    s = wr[base + 2].to(tl.int32)
    return _group_pairs(qa, ha, (s << 24) >> 24, MODE) + _group_pairs(qb, hb, s >> 8, MODE)


@triton.jit
def _row_factor(wr, base: tl.constexpr):
    return wr[base + 3].to(tl.float32)


@triton.jit
def q6_k_mma_gemv_kernel(x_ptr, ql, qh, sc, d, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split,
                         stride_xt, stride_ot, stride_rt, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_G: tl.constexpr, USE_SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
                         DOT_KIND: tl.constexpr, EPI: tl.constexpr, EVEN_G: tl.constexpr,
                         FOLD: tl.constexpr, STAGES: tl.constexpr, H2_MODE: tl.constexpr, NW: tl.constexpr,
                         XPRE: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_wait(PDL)    # ninfer_kernels.pdl: before any load or store; finish_at triggers after the K loop
    # USE_DOT / DOT_KIND / FOLD / EVEN_G are accepted for the shared launcher and unused here
    mma_body(x_ptr, (ql, qh, sc, d), None, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split, stride_xt,
             stride_ot, stride_rt, T_TILE, BLOCK_N, BLOCK_G, USE_SPLIT, EPI, STAGES, H2_MODE, NW, XPRE, _load_row,
             no_prep, 4, _row_pairs, _row_factor, True, PDL=PDL)


# gemv_q6_k registers it (lazily)
mma_kernel = factory(q6_k_mma_gemv_kernel, "q6_k_gemv_kernel", per_thread=True)


def kernel_for(fmt: str = "q6_k_mma", dequant: bool = False, cc: int = 90):
    """(kernel, signature of its weight arguments, extra constexprs) for compile checks."""
    if dequant:
        raise ValueError("q6_k_mma has no dequantizer of its own (gemv_q6_k's serves both)")
    return q6_k_mma_gemv_kernel, {"ql": "*i64", "qh": "*i32", "sc": "*i8", "d": "*fp16"}, {**compile_consts(cc), "NW": 4}
