"""f8_e4m3_row fused dequant-GEMV / skinny GEMM: y[T, N] = x[T, K] @ (codes[N, K] * row_scale[N, None])^T.

Reads the stored layout (codes u8 E4M3FN [N, K] viewed as int64 [N, K/8], row_scale f32 [N]); no fp8 dtype
anywhere, so it runs on sm_70. Decode: byte b of a 32-bit word shifted to the top and arithmetically back down
by 4 puts the sign on bit 31 and the exponent/mantissa bits on bits 26..20; masked, that is the float32
e4m3(c) * 2**-120 exactly (subnormal E4M3 codes become fp32 subnormals, which Triton keeps). Activations
carry 2**64 (XS) and the result 2**56 (SW). NaN codes (0x7F/0xFF) read as +-480: the codec never emits them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv_common import dequant_body, gemv_body, ld
from .gemv_launch import KernelInputError, as_words, check_weight, check_x, dequant, gemv
from .pdl import pdl_wait

GS = 8             # codes per int64 word
_GS = tl.constexpr(GS)
_XS = tl.constexpr(2.0 ** 64)
_SW = tl.constexpr(2.0 ** 56)
_SIGN_EM = tl.constexpr(-0x78100000)  # 0x87F00000 as int32: bit 31 and bits 26..20


@triton.jit
def _load(codes, row_scale, w2, w3, w4, w5, rows, g, wm, G):
    q = ld(codes + rows[:, None] * G + g[None, :], wm)
    return q.to(tl.int32), (q >> 32).to(tl.int32), tl.load(row_scale + rows)[:, None]


@triton.jit
def _raw(st, i: tl.constexpr):
    lo, hi, s = st
    if i < 4:
        w = lo
    else:
        w = hi
    return (((w << (24 - 8 * (i % 4))) >> 4) & _SIGN_EM).to(tl.float32, bitcast=True)


@triton.jit
def _scale(st):
    lo, hi, s = st
    return s


@triton.jit
def f8_gemv_kernel(x_ptr, codes, row_scale, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split,
                   stride_xt, stride_ot, stride_rt, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_G: tl.constexpr, USE_SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
                   DOT_KIND: tl.constexpr, EPI: tl.constexpr, EVEN_G: tl.constexpr,
                      FOLD: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_wait(PDL)    # ninfer_kernels.pdl: before any load or store; finish_at triggers after the K loop
    gemv_body(x_ptr, codes, row_scale, None, None, None, None, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale,
              T, N, G, split, stride_xt, stride_ot, stride_rt, _load, _raw, _scale, _GS, _XS, _SW,
              T_TILE, BLOCK_N, BLOCK_G, USE_SPLIT, USE_DOT, DOT_KIND, EPI, EVEN_G, FOLD, STAGES, PDL=PDL)


@triton.jit
def f8_dequant_kernel(codes, row_scale, out_ptr, fscale, N, G, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    dequant_body(codes, row_scale, None, None, None, None, out_ptr, fscale, N, G, _load, _raw, _scale, _GS,
                 _XS, _SW, BLOCK_N, BLOCK_G)


def _weights(codes, row_scale, K: int, device, what: str):
    if K % GS:
        raise KernelInputError(f"{what}: K={K} is not a multiple of {GS}")
    n = codes.shape[0] if isinstance(codes, torch.Tensor) and codes.dim() == 2 else -1
    codes = check_weight(codes, "codes", (n, K), (torch.uint8,), what, device)
    row_scale = check_weight(row_scale, "row_scale", (n,), (torch.float32,), what, device)
    return n, (as_words(codes, torch.int64), row_scale)


def gemv_f8(x, codes, row_scale, out=None, residual=None, *, config=None, plans=None):
    """x [T, K] fp16/bf16/fp32, codes u8 E4M3 [N, K], row_scale f32 [N] -> [T, N] in x.dtype."""
    x = check_x(x, None, "gemv_f8")
    K = x.shape[1]
    n, w = _weights(codes, row_scale, K, x.device, "gemv_f8")
    # no folded multiplier in the dot path: row_scale * 2**120 overflows for row scales >= 2**7, and the host
    # does not read the scales
    return gemv(f8_gemv_kernel, w, x, n, K // GS, GS, 1.0, out, residual, config, "gemv_f8", fold=False,
                plans=plans)


def dequant_f8(codes, row_scale, dtype=torch.float16):
    K = codes.shape[-1]
    n, w = _weights(codes, row_scale, K, codes.device, "dequant_f8")
    return dequant(f8_dequant_kernel, w, n, K // GS, GS, 1.0, dtype, codes.device)


def kernel_for(fmt: str = "f8", dequant: bool = False):
    """(kernel, signature of its weight arguments, extra constexprs) for compile checks."""
    return (f8_dequant_kernel if dequant else f8_gemv_kernel), {"codes": "*i64", "row_scale": "*fp32"}, {}
