"""GGML Q6_K fused dequant-GEMV / skinny GEMM: y[T, N] = x[T, K] @ W[N, K]^T (+ residual).

Load-time repack (`repack_q6_k`, same bytes per weight as the GGML blocks: 210 per 256): GGML rows of
210-byte blocks are only 2-byte aligned and interleave the 4- and 2-bit planes, so the blocks are split into
planar, 16-byte-loadable arrays indexed by 16-weight group g (K/16 groups per row):
  ql  int64 [N, K/16]  the low 4 bits of weights 16g..16g+15, weight i in nibble i
  qh  int32 [N, K/16]  their high 2 bits, pre-spread so that four masks give four bytes of complete 6-bit
                       codes each (weight 2b -> bits 8b+4..5, 2b+1 -> 8b+2..3, 8+2b -> 8b+6..7, 9+2b -> 8b..8b+1)
  sc  int8  [N, K/16]  the GGML sub-block scales (one per 16 weights)
  d   fp16  [N, K/256] the super-block scales
Decode: code bytes OR 0x4B000000 are the floats 2**23 + code exactly, so one FADD gives code - 32 without an
int->float conversion; w = d * sc * (code - 32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv_common import Q6_K_EVICT, dequant_body, even_groups, gemv_body, ld, ld_pair, ldw, pairwise
from .gemv_launch import KernelInputError, check_weight, check_x, dequant, gemv, register_h2, register_variant
from .pdl import pdl_wait

GS = 16
QK = 256
BLOCK_BYTES = 210
_GS = tl.constexpr(GS)
_ONE = tl.constexpr(1.0)
_MAGIC = tl.constexpr(0x4B000000)         # float bits of 2**23
_OFFSET = tl.constexpr(8388608.0 + 32.0)  # 2**23 + 32
_QH_POS = (4, 2, 12, 10, 20, 18, 28, 26, 6, 0, 14, 8, 22, 16, 30, 24)  # qh bit of weight i of a group


@triton.jit
def _load(ql, qh, sc, d, w4, w5, rows, g, wm, G):
    off = rows[:, None] * G + g[None, :]
    q = ldw(ql + off, wm, Q6_K_EVICT)
    a = q.to(tl.int32)
    b = (q >> 32).to(tl.int32)
    h = ldw(qh + off, wm, Q6_K_EVICT)
    ge = even_groups(g)
    dd = pairwise(ld_pair(d + rows[:, None] * (G // 16) + (ge // 16)[None, :], ge, wm, G).to(tl.float32))
    s = ldw(sc + off, wm, Q6_K_EVICT).to(tl.float32) * dd
    qe_a = (a & 0x0F0F0F0F) | (h & 0x30303030)
    qo_a = ((a >> 4) & 0x0F0F0F0F) | ((h << 2) & 0x30303030)
    qe_b = (b & 0x0F0F0F0F) | ((h >> 2) & 0x30303030)
    qo_b = ((b >> 4) & 0x0F0F0F0F) | ((h << 4) & 0x30303030)
    return qe_a, qo_a, qe_b, qo_b, s


@triton.jit
def _raw(st, i: tl.constexpr):
    qe_a, qo_a, qe_b, qo_b, s = st
    if i < 8:
        if i % 2 == 0:
            w = qe_a
        else:
            w = qo_a
    else:
        if i % 2 == 0:
            w = qe_b
        else:
            w = qo_b
    return (((w >> (8 * ((i % 8) // 2))) & 0xFF) | _MAGIC).to(tl.float32, bitcast=True) - _OFFSET


@triton.jit
def _scale(st):
    qe_a, qo_a, qe_b, qo_b, s = st
    return s


@triton.jit
def q6_k_gemv_kernel(x_ptr, ql, qh, sc, d, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split,
                     stride_xt, stride_ot, stride_rt, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_G: tl.constexpr, USE_SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
                     DOT_KIND: tl.constexpr, EPI: tl.constexpr, EVEN_G: tl.constexpr,
                     FOLD: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_wait(PDL)    # ninfer_kernels.pdl: before any load or store; finish_at triggers after the K loop
    gemv_body(x_ptr, ql, qh, sc, d, None, None, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale,
              T, N, G, split, stride_xt, stride_ot, stride_rt, _load, _raw, _scale, _GS, _ONE, _ONE,
              T_TILE, BLOCK_N, BLOCK_G, USE_SPLIT, USE_DOT, DOT_KIND, EPI, EVEN_G, FOLD, STAGES, PDL=PDL)


@triton.jit
def q6_k_dequant_kernel(ql, qh, sc, d, out_ptr, fscale, N, G, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    dequant_body(ql, qh, sc, d, None, None, out_ptr, fscale, N, G, _load, _raw, _scale, _GS, _ONE, _ONE,
                 BLOCK_N, BLOCK_G)


def _h2_kernel(device):
    from .gemv_q6_k_h2 import h2_kernel     # imported on first use: it reuses this module's tile load
    return h2_kernel(device)


def _mma_kernel(device):
    from .gemv_q6_k_mma import mma_kernel
    return mma_kernel(device)


register_h2(q6_k_gemv_kernel.__name__, _h2_kernel)   # T <= 8 candidates include the packed-half2 variant
register_variant("mma", q6_k_gemv_kernel.__name__, _mma_kernel)   # sm_80+, T <= 16: the warp-MMA variant


def _repack_rows(b: torch.Tensor) -> tuple:
    n, nb = b.shape[0], b.shape[1] // BLOCK_BYTES
    b = b.reshape(n, nb, BLOCK_BYTES)
    ql = b[..., :128].reshape(n, nb, 2, 64)
    qh = b[..., 128:192].reshape(n, nb, 2, 1, 32)
    low = torch.cat([ql & 15, ql >> 4], dim=-1).reshape(n, nb * QK)       # GGML: ql byte j -> weights j, j+64
    high = ((qh >> torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(4, 1)) & 3)
    high = high.reshape(n, nb * QK // GS, GS).to(torch.int64)               # qh byte l bits 2q -> weight 32q+l
    nib = (low[:, 0::2] | (low[:, 1::2] << 4)).contiguous()
    pos = torch.tensor(_QH_POS, device=b.device, dtype=torch.int64)
    h = (high << pos).sum(dim=-1)                                           # disjoint bits: sum == or
    h = torch.where(h >= 2 ** 31, h - 2 ** 32, h).to(torch.int32)
    sc = b[..., 192:208].reshape(n, nb * 16).contiguous().view(torch.int8)
    d = b[..., 208:210].contiguous().view(torch.float16).reshape(n, nb)
    return nib.view(torch.int64), h, sc, d


def repack_q6_k(blocks: torch.Tensor, K: int, *, chunk_rows: int = 4096) -> dict:
    """GGML Q6_K rows u8 [N, K/256*210] -> {"ql", "qh", "sc", "d"} planar arrays (module docstring)."""
    if K % QK or not isinstance(blocks, torch.Tensor) or blocks.dim() != 2 or blocks.dtype != torch.uint8 \
            or blocks.shape[1] != K // QK * BLOCK_BYTES:
        got = (tuple(blocks.shape), blocks.dtype) if isinstance(blocks, torch.Tensor) else type(blocks).__name__
        raise KernelInputError(f"repack_q6_k: blocks must be u8 [N, {K // QK * BLOCK_BYTES}] for K={K} "
                               f"(K a multiple of {QK}), got {got}")
    parts = [_repack_rows(blocks[r:r + chunk_rows]) for r in range(0, blocks.shape[0], chunk_rows)]
    ql, qh, sc, d = (torch.cat(p) for p in zip(*parts))
    return {"ql": ql, "qh": qh, "sc": sc, "d": d}


def unpack_q6_k(packed: dict, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of `repack_q6_k`: GGML blocks u8 [N, K/256*210] (or only `rows`, int64) on the planes' device."""
    ql, qh, sc, d = (packed[k] if rows is None else packed[k].index_select(0, rows) for k in ("ql", "qh", "sc", "d"))
    n, nb = d.shape
    nib = ql.contiguous().view(torch.uint8)                                  # [n, nb * 128]
    low = torch.stack([nib & 15, nib >> 4], dim=-1).reshape(n, nb, 2, 128)   # weight order within each half
    q_low = (low[..., :64] | (low[..., 64:] << 4)).reshape(n, nb, 128)
    pos = torch.tensor(_QH_POS, device=d.device, dtype=torch.int32)
    high = ((qh.to(torch.int32)[..., None] >> pos) & 3).to(torch.uint8).reshape(n, nb, 2, 4, 32)
    q_high = (high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6))
    return torch.cat([q_low, q_high.reshape(n, nb, 64), sc.contiguous().view(torch.uint8).reshape(n, nb, 16),
                      d.contiguous().view(torch.uint8).reshape(n, nb, 2)], dim=-1).reshape(n, nb * BLOCK_BYTES)


def _weights(packed: dict, K: int, device, what: str):
    if K % QK:
        raise KernelInputError(f"{what}: K={K} is not a multiple of {QK}")
    ql = packed.get("ql")
    n = ql.shape[0] if isinstance(ql, torch.Tensor) and ql.dim() == 2 else -1
    g = K // GS
    return n, (check_weight(ql, "ql", (n, g), (torch.int64,), what, device),
               check_weight(packed.get("qh"), "qh", (n, g), (torch.int32,), what, device),
               check_weight(packed.get("sc"), "sc", (n, g), (torch.int8,), what, device),
               check_weight(packed.get("d"), "d", (n, K // QK), (torch.float16,), what, device))


def gemv_q6_k(x, packed: dict, out=None, residual=None, *, config=None, plans=None):
    """x [T, K] fp16/bf16/fp32, packed = repack_q6_k(blocks, K) -> [T, N] in x.dtype."""
    x = check_x(x, None, "gemv_q6_k")
    K = x.shape[1]
    n, w = _weights(packed, K, x.device, "gemv_q6_k")
    return gemv(q6_k_gemv_kernel, w, x, n, K // GS, GS, 1.0, out, residual, config, "gemv_q6_k", plans=plans)


def dequant_q6_k(packed: dict, K: int, dtype=torch.float16):
    """Dense [N, K] `dtype` weights from repacked Q6_K arrays."""
    dev = packed["ql"].device
    n, w = _weights(packed, K, dev, "dequant_q6_k")
    return dequant(q6_k_dequant_kernel, w, n, K // GS, GS, 1.0, dtype, dev)


def kernel_for(fmt: str = "q6_k", dequant: bool = False):
    """(kernel, signature of its weight arguments, extra constexprs) for compile checks."""
    sig = {"ql": "*i64", "qh": "*i32", "sc": "*i8", "d": "*fp16"}
    return (q6_k_dequant_kernel if dequant else q6_k_gemv_kernel), sig, {}
