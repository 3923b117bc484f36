"""Plain-weight GEMV / skinny GEMM (w bf16 / f16 / f32 [N, K]): y[T, N] = x[T, K] @ w^T (+ residual).

Same skeleton as the quantized kernels, so T columns share one read of w: the weights are read as int64
words (4 halves or 2 floats) and widened to fp32 with bit operations (bf16: a shift; f32: nothing; f16: a
convert), so bf16 weights work on sm_70 without bf16 arithmetic. K must be a multiple of the words' width
(4 for 16-bit, 2 for f32); `dispatch.linear` falls back to torch for other K.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv_common import gemv_body, ld
from .gemv_launch import KernelInputError, as_words, check_weight, check_x, gemv
from .pdl import pdl_wait

_ONE = tl.constexpr(1.0)
_WIDTH = {torch.bfloat16: 4, torch.float16: 4, torch.float32: 2}   # elements per int64 word
_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


@triton.jit
def _load(w, w1, w2, w3, w4, w5, rows, g, wm, G):
    q = ld(w + rows[:, None] * G + g[None, :], wm)
    return q.to(tl.int32), (q >> 32).to(tl.int32)


@triton.jit
def _raw_bf16(st, i: tl.constexpr):
    lo, hi = st
    if i < 2:
        v = lo
    else:
        v = hi
    if i % 2 == 0:
        v = v << 16
    else:
        v = v & -65536
    return v.to(tl.float32, bitcast=True)


@triton.jit
def _raw_f16(st, i: tl.constexpr):
    lo, hi = st
    if i < 2:
        v = lo
    else:
        v = hi
    return (v >> (16 * (i % 2))).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _raw_f32(st, i: tl.constexpr):
    lo, hi = st
    if i == 0:
        v = lo
    else:
        v = hi
    return v.to(tl.float32, bitcast=True)


@triton.jit
def _scale(st):
    return 1.0


@triton.jit
def plain_gemv_kernel(x_ptr, w, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split,
                      stride_xt, stride_ot, stride_rt, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_G: tl.constexpr, USE_SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
                      DOT_KIND: tl.constexpr, EPI: tl.constexpr, EVEN_G: tl.constexpr,
                      FOLD: tl.constexpr, STAGES: tl.constexpr, W_KIND: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_wait(PDL)    # ninfer_kernels.pdl: before any load or store; finish_at triggers after the K loop
    if W_KIND == 0:
        gemv_body(x_ptr, w, None, None, None, None, None, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale,
                  T, N, G, split, stride_xt, stride_ot, stride_rt, _load, _raw_bf16, _scale, 4, _ONE, _ONE,
                  T_TILE, BLOCK_N, BLOCK_G, USE_SPLIT, USE_DOT, DOT_KIND, EPI, EVEN_G, FOLD, STAGES, PDL=PDL)
    elif W_KIND == 1:
        gemv_body(x_ptr, w, None, None, None, None, None, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale,
                  T, N, G, split, stride_xt, stride_ot, stride_rt, _load, _raw_f16, _scale, 4, _ONE, _ONE,
                  T_TILE, BLOCK_N, BLOCK_G, USE_SPLIT, USE_DOT, DOT_KIND, EPI, EVEN_G, FOLD, STAGES, PDL=PDL)
    else:
        gemv_body(x_ptr, w, None, None, None, None, None, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale,
                  T, N, G, split, stride_xt, stride_ot, stride_rt, _load, _raw_f32, _scale, 2, _ONE, _ONE,
                  T_TILE, BLOCK_N, BLOCK_G, USE_SPLIT, USE_DOT, DOT_KIND, EPI, EVEN_G, FOLD, STAGES, PDL=PDL)


def _weights(w, K: int, device, what: str):
    if not isinstance(w, torch.Tensor) or w.dtype not in _WIDTH or w.dim() != 2:
        got = (tuple(w.shape), w.dtype) if isinstance(w, torch.Tensor) else type(w).__name__
        raise KernelInputError(f"{what}: w must be 2-D bf16/f16/f32, got {got}")
    if K % _WIDTH[w.dtype]:
        raise KernelInputError(f"{what}: K={K} is not a multiple of {_WIDTH[w.dtype]} for {w.dtype} weights")
    w = check_weight(w, "w", (w.shape[0], K), (w.dtype,), what, device)
    return w.shape[0], (as_words(w.view(torch.uint8).reshape(w.shape[0], -1), torch.int64),)


class _PlainKernel:
    """Binds W_KIND so the generic launcher can treat the plain kernel like the others."""

    def __init__(self, kind: int):
        self.kind, self.__name__ = kind, f"plain_gemv_kernel[{kind}]"
        self.jit, self.extra_consts = plain_gemv_kernel, {"W_KIND": kind}   # for gemv_plan's direct launch

    def __getitem__(self, grid):
        return lambda *a, **kw: plain_gemv_kernel[grid](*a, W_KIND=self.kind, **kw)

    def warmup(self, *a, grid, **kw):
        return plain_gemv_kernel.warmup(*a, grid=grid, W_KIND=self.kind, **kw)


def gemv_plain(x, w, out=None, residual=None, *, config=None, plans=None):
    """x [T, K] fp16/bf16/fp32, w [N, K] bf16/f16/f32 -> [T, N] in x.dtype."""
    x = check_x(x, None, "gemv_plain")
    K = x.shape[1]
    n, words = _weights(w, K, x.device, "gemv_plain")
    return gemv(_PlainKernel(_KIND[w.dtype]), words, x, n, K // _WIDTH[w.dtype], _WIDTH[w.dtype], 1.0, out,
                residual, config, "gemv_plain", plans=plans)


def kernel_for(fmt: str = "plain:bf16", dequant: bool = False):
    """(kernel, signature of its weight arguments, extra constexprs) for compile checks (no dequantizer:
    plain weights are already dense)."""
    kind = {"plain:bf16": 0, "plain:f16": 1, "plain:f32": 2}[fmt]
    return plain_gemv_kernel, {"w": "*i64"}, {"W_KIND": kind}
