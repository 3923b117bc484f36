"""NVFP4 (ModelOpt layout) fused dequant-GEMV / skinny GEMM: y[T, N] = x[T, K] @ W[N, K]^T (+ residual).

The artifact stores codes u8 [N, K/2] (weight i of a 16-weight block in nibble i; the even element is the low
nibble) and E4M3 block scales u8 [N, K/16]; gscale is the per-tensor float. The kernels read a chunk-major copy
made once per weight (`repack_nvfp4`, the triton backend's form of an NVFP4 weight; `unpack_nvfp4` inverts it
bit-exact): chunk c of row n -- blocks 8c .. 8c + 7, 128 weights -- is 8 int64 code words at word (c * N + n) * 8
of codes [C, N, 8] and its 8 scale bytes at byte (c * N + n) * 8 of scales [C, N, 8], C = ceil(K / 128), the last
chunk zero-padded. Why: the decode loops read 64 code bytes per row and K step; row-major, those are runs 2.5 KB
apart (K = 5120), chunk-major one K step of a 128-row tile is one 8 KB run. Re-tuned on the H200 the T = 2..8
GEMVs ran 6-16 % faster on it, T = 1 equal to 5 % faster (an lm_head-sized N = 248320: 17 % slower; bench/NOTES.md
§12-13), outputs bit-identical.

Decode, without a table or a conversion instruction: shifting nibble i to the top of an int32 and back down
arithmetically by 6 lands its sign on bit 31 and its magnitude bits e1 e0 m on bits 24..22; masked, that is
the float32 e2m1(c) * 2**-126 exactly (e = 0 gives the subnormal 0.5*m * 2**-126, which the FMAs keep: Triton
does not flush fp32 subnormals). The activations are scaled by 2**64 (XS) and the result by 2**62 (SW), so
the products stay normal and the scaling is exact; the E4M3 block scale is decoded from its bits the same way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv_common import (NVFP4_EVICT, _j4, _load_tile, _tile_g, dequant_body, e4m3_magnitude, gemv_body, ld,
                          ldw)
from .gemv_launch import (as_words, check_weight, check_x, dequant, gemv, KernelInputError, register_h2,
                          register_variant)
from .pdl import pdl_wait

GS = 16                          # weights per block (one int64 word of codes, one E4M3 scale)
_GS = tl.constexpr(GS)
_XS = tl.constexpr(2.0 ** 64)     # activation pre-scale
_SW = tl.constexpr(2.0 ** 62)     # RAW * XS * SW = e2m1 exactly
_SIGN_MAG = tl.constexpr(-0x7E400000)  # 0x81C00000 as int32: bit 31 and bits 24..22


CHUNK_GROUPS = 8                 # blocks per chunk of the kernels' layout (128 weights: 64 code bytes, 8 scales)


@triton.jit
def cm_offsets(rows, g, n, RUN: tl.constexpr):
    """Word offsets [BN, BG] of blocks g of rows `rows` in the chunk-major planes of an n-row weight (block g of
    row r at (g // 8 * n + r) * 8 + g % 8). RUN: the tile's groups come in aligned runs of RUN (a power of two
    <= 8, from the tile's own alignment), which stay contiguous inside a chunk: the loads keep RUN-wide vectors."""
    off = (g // 8 * (n * 8))[None, :] + (rows * 8)[:, None] + (g % 8)[None, :]
    return tl.max_contiguous(tl.multiple_of(off, [1, RUN]), [1, RUN])


@triton.jit
def _load(codes, scales, n, w3, w4, w5, rows, g, wm, G):
    """The tile load: g holds aligned pairs of groups (every caller's tiles start on an even group)."""
    tl.static_assert(g.shape[0] % 2 == 0)
    off = cm_offsets(rows, g, n, 2)
    words = ldw(codes + off, wm, NVFP4_EVICT)
    s = ldw(scales + off, wm, NVFP4_EVICT).to(tl.int32)
    return words.to(tl.int32), (words >> 32).to(tl.int32), s


@triton.jit
def _load_dot(codes, scales, n, rows, g0, g_hi, G, BLOCK_G: tl.constexpr, EVEN_G: tl.constexpr):
    """`_load` for the tl.dot route. On whole tiles of a multiple of 4 groups (every real shape) the scale bytes
    are read as int32 words of 4 groups, so that a row's scales in a tile are 4..8-byte loads which the
    pipeliner issues stages ahead like the codes: a 2-byte load cannot be cp.async'ed, it stayed in the loop
    and every iteration waited a memory latency for its scales (bench/NOTES.md §6). Ragged tiles take the
    byte load."""
    if EVEN_G and BLOCK_G % 4 == 0:
        g = g0 + tl.arange(0, BLOCK_G)
        words = tl.load(codes + cm_offsets(rows, g, n, 4))
        g4 = g0 // 4 + tl.arange(0, BLOCK_G // 4)          # word w of a row's scales: groups 4w .. 4w + 3
        off4 = (g4 // 2 * (n * 2))[None, :] + (rows * 2)[:, None] + (g4 % 2)[None, :]
        W: tl.constexpr = 2 if BLOCK_G >= 8 else 1
        s4 = tl.load(scales.to(tl.pointer_type(tl.int32)) + tl.max_contiguous(tl.multiple_of(off4, [1, W]), [1, W]))
        s = tl.reshape(_j4(s4 & 0xFF, (s4 >> 8) & 0xFF, (s4 >> 16) & 0xFF, (s4 >> 24) & 0xFF),
                       [rows.shape[0], BLOCK_G])       # group 4i + j = byte j of word i (little-endian)
        return words.to(tl.int32), (words >> 32).to(tl.int32), s
    else:
        return _load_tile(codes, scales, n, None, None, None, rows, _tile_g(g0, BLOCK_G, 2), g_hi, G, _load,
                          EVEN_G)


@triton.jit
def _raw(st, i: tl.constexpr):
    lo, hi, s = st
    if i < 8:
        w = lo
    else:
        w = hi
    return (((w << (28 - 4 * (i % 8))) >> 6) & _SIGN_MAG).to(tl.float32, bitcast=True)


@triton.jit
def _scale(st):
    lo, hi, s = st
    return e4m3_magnitude(s)


@triton.jit
def nvfp4_gemv_kernel(x_ptr, codes, scales, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split,
                      stride_xt, stride_ot, stride_rt, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_G: tl.constexpr, USE_SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
                      DOT_KIND: tl.constexpr, EPI: tl.constexpr, EVEN_G: tl.constexpr,
                      FOLD: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_wait(PDL)    # ninfer_kernels.pdl: before any load or store; finish_at triggers after the K loop
    gemv_body(x_ptr, codes, scales, N, None, None, None, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale,
              T, N, G, split, stride_xt, stride_ot, stride_rt, _load, _raw, _scale, _GS, _XS, _SW,
              T_TILE, BLOCK_N, BLOCK_G, USE_SPLIT, USE_DOT, DOT_KIND, EPI, EVEN_G, FOLD, STAGES,
              LOAD_DOT=_load_dot, PDL=PDL)


@triton.jit
def nvfp4_dequant_kernel(codes, scales, out_ptr, fscale, N, G, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    dequant_body(codes, scales, N, None, None, None, out_ptr, fscale, N, G, _load, _raw, _scale, _GS, _XS, _SW,
                 BLOCK_N, BLOCK_G)


def _h2_kernel(device):
    from .gemv_nvfp4_h2 import h2_kernel     # imported on first use: it reuses this module's tile load
    return h2_kernel(device)


def _mma_kernel(device):
    from .gemv_nvfp4_mma import mma_kernel
    return mma_kernel(device)


register_h2(nvfp4_gemv_kernel.__name__, _h2_kernel)   # T <= 8 candidates include the packed-half2 variant
register_variant("mma", nvfp4_gemv_kernel.__name__, _mma_kernel)   # sm_80+, T <= 16: the warp-MMA variant


def repack_nvfp4(codes: torch.Tensor, scales: torch.Tensor) -> dict:
    """The artifact's layout (codes u8 [N, K/2], scales u8 [N, K/16]) -> the kernels' chunk-major planes
    {"codes": int64 [C, N, 8], "scales": u8 [C, N, 8]}, C = ceil(K / 128) (module docstring), on the same device."""
    ok = all(isinstance(t, torch.Tensor) and t.dim() == 2 and t.dtype == torch.uint8 for t in (codes, scales))
    if not ok or codes.shape[1] % 8 or tuple(scales.shape) != (codes.shape[0], codes.shape[1] // 8):
        got = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__ for t in (codes, scales)]
        raise KernelInputError(f"repack_nvfp4: codes must be u8 [N, K/2] and scales u8 [N, K/16] (K a multiple of "
                               f"{GS}), got {got[0]} and {got[1]}")
    n, G = scales.shape
    C = -(-G // CHUNK_GROUPS)
    pad = C * CHUNK_GROUPS - G
    words = torch.nn.functional.pad(as_words(codes.contiguous(), torch.int64), (0, pad))
    sc = torch.nn.functional.pad(scales, (0, pad))
    return {"codes": words.view(n, C, CHUNK_GROUPS).transpose(0, 1).contiguous(),
            "scales": sc.view(n, C, CHUNK_GROUPS).transpose(0, 1).contiguous()}


def unpack_nvfp4(planes: dict, K: int, rows: torch.Tensor | None = None) -> dict:
    """The inverse of `repack_nvfp4`: {"codes": u8 [N, K/2], "scales": u8 [N, K/16]} (or only `rows`, int64)."""
    G = K // GS
    out = {}
    for key, item in (("codes", 8), ("scales", 1)):
        p = planes[key] if rows is None else planes[key].index_select(1, rows)
        rm = p.transpose(0, 1).reshape(p.shape[1], -1)[:, :G].contiguous()
        out[key] = rm.view(torch.uint8) if item > 1 else rm
    return out


def _weights(planes: dict, K: int, device, what: str):
    """(N, kernel weight arguments) of chunk-major planes for activations of width K."""
    if K % GS:
        raise KernelInputError(f"{what}: K={K} is not a multiple of {GS}")
    if not isinstance(planes, dict):
        raise KernelInputError(f"{what}: weights must be repack_nvfp4's planes, got {type(planes).__name__}")
    codes = planes.get("codes")
    n = codes.shape[1] if isinstance(codes, torch.Tensor) and codes.dim() == 3 else -1
    C = -(-K // (GS * CHUNK_GROUPS))
    w = (check_weight(codes, "codes", (C, n, CHUNK_GROUPS), (torch.int64,), what, device),
         check_weight(planes.get("scales"), "scales", (C, n, CHUNK_GROUPS), (torch.uint8,), what, device))
    # 16-byte code vectors, int32 scale words on the tl.dot route (repack_nvfp4's tensors are fresh allocations)
    return n, tuple(t if t.data_ptr() % 16 == 0 else t.clone() for t in w)


def gemv_nvfp4(x, planes, gscale, out=None, residual=None, *, config=None, plans=None):
    """x [T, K] fp16/bf16/fp32, planes = repack_nvfp4(codes, scales), gscale float -> [T, N] x.dtype."""
    x = check_x(x, None, "gemv_nvfp4")
    K = x.shape[1]
    n, w = _weights(planes, K, x.device, "gemv_nvfp4")
    # the dot path folds e4m3 * 2**126 * gscale into one multiplier when that stays a finite float32
    fold = 448.0 * 2.0 ** 126 * abs(float(gscale)) < 3.0e38
    return gemv(nvfp4_gemv_kernel, w, x, n, K // GS, GS, float(gscale), out, residual, config, "gemv_nvfp4",
                fold, plans)


def gemv_nvfp4_prepared(xp, planes, gscale, out, residual=None, *, config):
    """The packed-half2 / warp-MMA variants on prepared activations (`ninfer_kernels.x16`): xp int32
    [T, K/2 + K/128] (K a multiple of 128, so K = 128 * the planes' chunks) -> out [T, N] (given: its dtype is the
    output's). `config` must be an h2 (T <= 8) or mma (T <= 16) config; no tuning."""
    from .x16 import launch_prepared
    codes = planes.get("codes") if isinstance(planes, dict) else None
    K = GS * CHUNK_GROUPS * codes.shape[0] if isinstance(codes, torch.Tensor) and codes.dim() == 3 else 0
    n, w = _weights(planes, K, xp.device if isinstance(xp, torch.Tensor) else None, "gemv_nvfp4_prepared")
    return launch_prepared(nvfp4_gemv_kernel, w, xp, n, K, GS, float(gscale), out, residual, config,
                           "gemv_nvfp4_prepared")


def dequant_nvfp4(planes, K: int, gscale, dtype=torch.float16):
    """Dense [N, K] `dtype` weights on the planes' device."""
    device = planes["codes"].device if isinstance(planes, dict) and "codes" in planes else None
    n, w = _weights(planes, K, device, "dequant_nvfp4")
    return dequant(nvfp4_dequant_kernel, w, n, K // GS, GS, float(gscale), dtype, device)


def kernel_for(fmt: str = "nvfp4", dequant: bool = False):
    """(kernel, signature of its weight arguments, extra constexprs) for compile checks."""
    return (nvfp4_dequant_kernel if dequant else nvfp4_gemv_kernel), {"codes": "*i64", "scales": "*u8"}, {}
