"""RMSNorm over the last dim, `(1 + w)` (zero-centred) or plain `w` gain, optionally fused with the
residual add (`add_rmsnorm`). One program per row; statistics in fp32.

Rows come as an [A, B, D] view with two row strides so the per-head q/k slices of a fused projection are
normalised in place of a copy. The residual sum is rounded to the activation dtype before it is normalised,
exactly as the unfused `r = residual + x; rmsnorm(r)` would.

With `xp` (an int32 [rows, D/128 + D/2] buffer) the kernel also writes the normalised rows' prepared form
(`ninfer_kernels.x16`), which the next linear layer's f16 GEMV reads instead of converting the activations in
every CTA: bit-identical to `x16_prep` of the returned tensor.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .ops_common import KernelInputError, pow2, rows3, warps_for
from .x16 import check_prepared_out, prepared_out_args, store_prepared
from .pdl import pdl_enter_preloaded, pdl_kw


@triton.jit
def load_summed(x_ptrs, r_ptrs, m, HAS_RES: tl.constexpr, DT: tl.constexpr):
    """A row as fp32 -- with HAS_RES, the row plus the residual row, rounded to DT first as the unfused
    `r = residual + x` is -- and that row in DT (the residual stream's next value)."""
    x = tl.load(x_ptrs, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        s = (x + tl.load(r_ptrs, mask=m, other=0.0).to(tl.float32)).to(DT)
        x = s.to(tl.float32)
    else:
        s = x.to(DT)
    return x, s


@triton.jit
def normalized(x, w, D, eps):
    """x * rsqrt(mean(x^2) + eps) * w over the D valid elements of the fp32 row x (0 past them)."""
    return x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps) * w


@triton.jit
def rmsnorm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, rsum_ptr, xp_ptr, n_inner, sx_a, sx_b, sr_a, sr_b, s_xp, D, eps,
                   PLUS_ONE: tl.constexpr, HAS_RES: tl.constexpr, XP: tl.constexpr, BLOCK_D: tl.constexpr,
                   PDL: tl.constexpr = 0, PRELOAD: tl.constexpr = 0):
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    # the gain is loaded up front: issued after the reduction it is a second dependent memory trip; no kernel
    # writes it, so with PRELOAD its load is in flight during the PDL wait (ninfer_kernels.pdl)
    w = pdl_enter_preloaded(w_ptr + offs, m, PDL, PRELOAD)
    row = tl.program_id(0)
    a = (row // n_inner).to(tl.int64)
    b = (row % n_inner).to(tl.int64)
    x, s = load_summed(x_ptr + a * sx_a + b * sx_b + offs, r_ptr + a * sr_a + b * sr_b + offs, m, HAS_RES,
                       rsum_ptr.dtype.element_ty)
    if PLUS_ONE:
        w = w + 1.0
    out_row = row.to(tl.int64) * D
    if HAS_RES:
        tl.store(rsum_ptr + out_row + offs, s, mask=m)
    y = normalized(x, w, D, eps).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + out_row + offs, y, mask=m)
    if XP:
        store_prepared(y.to(tl.float32), xp_ptr + row.to(tl.int64) * s_xp, 0, D, D)


def _launch(x, residual, w, eps, plus_one, xp=None):
    d = x.shape[-1]
    if w.shape != (d,):
        raise KernelInputError(f"rmsnorm: weight shape {tuple(w.shape)} does not match the last dim {d}")
    x3 = rows3(x)
    if xp is not None:
        check_prepared_out(xp, x3.shape[0] * x3.shape[1], d, x.device, "rmsnorm")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rsum = torch.empty_like(y) if residual is not None else y
    r3 = rows3(residual) if residual is not None else x3
    if residual is not None and r3.shape != x3.shape:
        raise KernelInputError(f"add_rmsnorm: residual {tuple(residual.shape)} vs x {tuple(x.shape)}")
    n_rows = x3.shape[0] * x3.shape[1]
    if n_rows:
        block = pow2(d)
        xp_ptr, s_xp = prepared_out_args(xp, y)
        rmsnorm_kernel[(n_rows,)](x3, r3, w, y, rsum, xp_ptr, x3.shape[1], x3.stride(0), x3.stride(1),
                                  r3.stride(0), r3.stride(1), s_xp, d, float(eps), PLUS_ONE=bool(plus_one),
                                  HAS_RES=residual is not None, XP=xp is not None, BLOCK_D=block,
                                  num_warps=norm_warps(block), **pdl_kw(x3.device, preload=True))
    return y, rsum


NORM_WARPS_ENV = "NINFER_NORM_WARPS"   # a comparison switch for benchmarks: warps per row program


def norm_warps(block: int) -> int:
    """NINFER_NORM_WARPS: `auto` (default: `ops_common.warps_for`) or a power of two 1..32, at most one warp per 32
    elements of the row block. A comparison switch: a decode step runs ~130 of these one-CTA programs back to
    back; on the H200 a chain of them took 1.92 us per norm at 8 warps (auto), 2.04 at 16 and 2.29 at 32, and
    decode was unchanged at 32 (bench/NOTES.md §21). Anything else is a one-line error naming the variable."""
    v = os.environ.get(NORM_WARPS_ENV, "auto")
    if v == "auto":
        return warps_for(block)
    if not v.isdigit() or int(v) not in (1, 2, 4, 8, 16, 32):
        raise KernelInputError(f"{NORM_WARPS_ENV}={v!r}: expected auto or a power of two from 1 to 32")
    return max(1, min(int(v), block // 32))


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, plus_one: bool, xp=None) -> torch.Tensor:
    """x [..., D] -> x * rsqrt(mean(x^2) + eps) * (1 + w | w), new contiguous tensor in x's dtype; its prepared
    form into `xp` when given (see the module note)."""
    return _launch(x, None, w, eps, plus_one, xp)[0]


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float,
                plus_one: bool = True, xp=None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rmsnorm(residual + x), residual + x); both new tensors in x's dtype; the first one's prepared form
    into `xp` when given."""
    return _launch(x, residual, w, eps, plus_one, xp)


def compile_specs(act: str):
    """(kernel, signature, constexprs) triples for the no-GPU compile check; `act` is fp16/bf16/fp32."""
    sig = {"x_ptr": f"*{act}", "r_ptr": f"*{act}", "w_ptr": "*fp32", "y_ptr": f"*{act}", "rsum_ptr": f"*{act}",
           "xp_ptr": "*i32", "n_inner": "i32", "sx_a": "i64", "sx_b": "i64", "sr_a": "i64", "sr_b": "i64",
           "s_xp": "i64", "D": "i32", "eps": "fp32"}
    specs = [(rmsnorm_kernel, sig, {"PLUS_ONE": p, "HAS_RES": r, "XP": xp, "BLOCK_D": bd}, warps_for(bd))
             for p, r, xp, bd in ((True, True, True, 8192), (True, True, False, 8192), (True, False, True, 256),
                                  (True, False, False, 256), (False, False, False, 128))]
    # NINFER_NORM_WARPS's widest setting on the decode step's row (D = 5120 in an 8192 block)
    return specs + [(rmsnorm_kernel, sig, {"PLUS_ONE": True, "HAS_RES": True, "XP": True, "BLOCK_D": 8192}, 32)]
