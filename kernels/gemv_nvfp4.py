"""NVFP4 (ModelOpt layout) fused dequant-GEMV / skinny GEMM: y[T, N] = x[T, K] @ W[N, K]^T (+ residual).

Reads the stored layout directly, no repack: codes u8 [N, K/2] viewed as int64 [N, K/16] -- one word is one
16-weight block and weight i of the block sits in nibble i (the even element is the low nibble) -- and the
E4M3 block scales u8 [N, K/16]; gscale is the per-tensor float.

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

from .gemv_common import _j4, _load_tile, _tile_g, dequant_body, e4m3_magnitude, gemv_body, ld
from .gemv_launch import (as_words, check_weight, check_x, dequant, gemv, KernelInputError, register_h2,
                          register_variant)

GS = 16                          # weights per block (one int64 word of codes, one E4M3 scale)
_GS = tl.constexpr(GS)
_XS = tl.constexpr(2.0 ** 64)     # activation pre-scale
_SW = tl.constexpr(2.0 ** 62)     # RAW * XS * SW = e2m1 exactly
_SIGN_MAG = tl.constexpr(-0x7E400000)  # 0x81C00000 as int32: bit 31 and bits 24..22


@triton.jit
def _load(codes, scales, w2, w3, w4, w5, rows, g, wm, G):
    off = rows[:, None] * G + g[None, :]
    words = ld(codes + off, wm)
    s = ld(scales + off, wm).to(tl.int32)
    return words.to(tl.int32), (words >> 32).to(tl.int32), s


@triton.jit
def _load_dot(codes, scales, rows, g0, g_hi, G, BLOCK_G: tl.constexpr, EVEN_G: tl.constexpr):
    """`_load` for the tl.dot route. On whole tiles of a multiple of 4 groups (every real shape) the scale bytes
    are read as int32 words of 4 groups, so that a row's scales in a tile are 4..16-byte loads which the
    pipeliner issues stages ahead like the codes: a 2-byte load cannot be cp.async'ed, it stayed in the loop
    and every iteration waited a memory latency for its scales (bench/NOTES.md §6). The scales are 16-byte
    aligned (`_weights`) and a row is G bytes, a multiple of 4 (EVEN_G: G % BLOCK_G == 0). Ragged tiles take
    the byte load."""
    if EVEN_G and BLOCK_G % 4 == 0:
        g = tl.max_contiguous(tl.multiple_of(g0 + tl.arange(0, BLOCK_G), 4), 4)
        g4 = tl.max_contiguous(tl.multiple_of(g0 // 4 + tl.arange(0, BLOCK_G // 4), BLOCK_G // 4), BLOCK_G // 4)
        words = tl.load(codes + rows[:, None] * G + g[None, :])
        s4 = tl.load(scales.to(tl.pointer_type(tl.int32)) + rows[:, None] * (G // 4) + g4[None, :])
        s = tl.reshape(_j4(s4 & 0xFF, (s4 >> 8) & 0xFF, (s4 >> 16) & 0xFF, (s4 >> 24) & 0xFF),
                       [rows.shape[0], BLOCK_G])       # group 4i + j = byte j of word i (little-endian)
        return words.to(tl.int32), (words >> 32).to(tl.int32), s
    else:
        return _load_tile(codes, scales, None, None, None, None, rows, _tile_g(g0, BLOCK_G, 2), g_hi, G, _load,
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
                      DOT_KIND: tl.constexpr, HAS_RES: tl.constexpr, EVEN_G: tl.constexpr,
                      FOLD: tl.constexpr, STAGES: tl.constexpr):
    gemv_body(x_ptr, codes, scales, None, None, None, None, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale,
              T, N, G, split, stride_xt, stride_ot, stride_rt, _load, _raw, _scale, _GS, _XS, _SW,
              T_TILE, BLOCK_N, BLOCK_G, USE_SPLIT, USE_DOT, DOT_KIND, HAS_RES, EVEN_G, FOLD, STAGES,
              LOAD_DOT=_load_dot)


@triton.jit
def nvfp4_dequant_kernel(codes, scales, out_ptr, fscale, N, G, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    dequant_body(codes, scales, None, None, None, None, out_ptr, fscale, N, G, _load, _raw, _scale, _GS, _XS, _SW,
                 BLOCK_N, BLOCK_G)


def _h2_kernel(device):
    from .gemv_nvfp4_h2 import h2_kernel     # imported on first use: it reuses this module's tile load
    return h2_kernel(device)


def _mma_kernel(device):
    from .gemv_nvfp4_mma import mma_kernel
    return mma_kernel(device)


register_h2(nvfp4_gemv_kernel.__name__, _h2_kernel)   # T <= 8 candidates include the packed-half2 variant
register_variant("mma", nvfp4_gemv_kernel.__name__, _mma_kernel)   # sm_80+, T <= 16: the warp-MMA variant


def _weights(codes, scales, K: int, device, what: str):
    if K % GS:
        raise KernelInputError(f"{what}: K={K} is not a multiple of {GS}")
    n = codes.shape[0] if isinstance(codes, torch.Tensor) and codes.dim() == 2 else -1
    codes = check_weight(codes, "codes", (n, K // 2), (torch.uint8,), what, device)
    scales = check_weight(scales, "scales", (n, K // GS), (torch.uint8,), what, device)
    if scales.data_ptr() % 16:   # the tl.dot route reads them as int32 words (artifact tensors are 256-aligned)
        scales = scales.clone()
    return n, (as_words(codes, torch.int64), scales)


def gemv_nvfp4(x, codes, scales, gscale, out=None, residual=None, *, config=None, plans=None):
    """x [T, K] fp16/bf16/fp32, codes u8 [N, K/2], scales u8 [N, K/16], gscale float -> [T, N] x.dtype."""
    x = check_x(x, None, "gemv_nvfp4")
    K = x.shape[1]
    n, w = _weights(codes, scales, K, x.device, "gemv_nvfp4")
    # the dot path folds e4m3 * 2**126 * gscale into one multiplier when that stays a finite float32
    fold = 448.0 * 2.0 ** 126 * abs(float(gscale)) < 3.0e38
    return gemv(nvfp4_gemv_kernel, w, x, n, K // GS, GS, float(gscale), out, residual, config, "gemv_nvfp4",
                fold, plans)


def gemv_nvfp4_prepared(xp, codes, scales, gscale, out, residual=None, *, config):
    """The packed-half2 / warp-MMA variants on prepared activations (`ninfer_kernels.x16`): xp int32
    [T, K/2 + K/128] -> out [T, N] (given: its dtype is the output's). `config` must be an h2 (T <= 8) or mma
    (T <= 16) config; no tuning. Not on the runtime's path yet: bench/xpre.py times it against `gemv_nvfp4`."""
    from .x16 import launch_prepared
    K = 2 * codes.shape[-1] if isinstance(codes, torch.Tensor) and codes.dim() == 2 else 0
    n, w = _weights(codes, scales, K, xp.device if isinstance(xp, torch.Tensor) else None, "gemv_nvfp4_prepared")
    return launch_prepared(nvfp4_gemv_kernel, w, xp, n, K, GS, float(gscale), out, residual, config,
                           "gemv_nvfp4_prepared")


def dequant_nvfp4(codes, scales, gscale, dtype=torch.float16):
    """Dense [N, K] `dtype` weights on the codes' device."""
    K = 2 * codes.shape[-1]
    n, w = _weights(codes, scales, K, codes.device, "dequant_nvfp4")
    return dequant(nvfp4_dequant_kernel, w, n, K // GS, GS, float(gscale), dtype, codes.device)


def kernel_for(fmt: str = "nvfp4", dequant: bool = False):
    """(kernel, signature of its weight arguments, extra constexprs) for compile checks."""
    return (nvfp4_dequant_kernel if dequant else nvfp4_gemv_kernel), {"codes": "*i64", "scales": "*u8"}, {}
