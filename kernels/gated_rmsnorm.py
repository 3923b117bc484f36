"""GDN output norm (reference §4): per value head, y = w * rmsnorm(o) * silu(z), all in fp32.

One program per (token, head) row. o and z are [T, Hv, dv] views with arbitrary row strides (z is a
column slice of the fused in_proj output), so no copy is made. With `xp` the output's prepared form as
[T, Hv * dv] rows (`ninfer_kernels.x16`) is written too: a (token, head) program owns whole 128-chunks when dv
is a multiple of 128.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ops_common import KernelInputError, pow2, rows3, warps_for
from .x16 import CHUNK, check_prepared_out, prepared_out_args, store_prepared
from .pdl import pdl_enter_preloaded, pdl_kw, pdl_trigger


@triton.jit
def gated_rmsnorm_kernel(o_ptr, z_ptr, w_ptr, y_ptr, xp_ptr, H, so_t, so_h, sz_t, sz_h, s_xp, D, eps,
                         XP: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = 0,
                         PRELOAD: tl.constexpr = 0, LATE: tl.constexpr = 0):
    d = tl.arange(0, BLOCK_D)
    m = d < D
    w = pdl_enter_preloaded(w_ptr + d, m, PDL, PRELOAD, LATE)   # ninfer_kernels.pdl: the gain loads in the wait
    row = tl.program_id(0)
    t = (row // H).to(tl.int64)
    h = (row % H).to(tl.int64)
    o = tl.load(o_ptr + t * so_t + h * so_h + d, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + t * sz_t + h * sz_h + d, mask=m, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(o * o, axis=0) / D + eps)
    y = o * inv * w * (z * tl.sigmoid(z))
    y = y.to(y_ptr.dtype.element_ty)
    if LATE:                  # NINFER_PDL_LATE: the out GEMV behind is placed only now
        pdl_trigger(PDL)
    tl.store(y_ptr + row.to(tl.int64) * D + d, y, mask=m)
    if XP:
        store_prepared(y.to(tl.float32), xp_ptr + t * s_xp, h * D, D, H * D)


def gated_rmsnorm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, xp=None) -> torch.Tensor:
    """o, z [T, Hv, dv] (or any [..., dv] of equal shape), w [dv] -> [same shape] in o's dtype; with `xp` (int32
    [T, Hv * dv / 2 + Hv * dv / 128], dv a multiple of 128) also the output's prepared form."""
    if o.shape != z.shape or w.shape != (o.shape[-1],):
        raise KernelInputError(f"gated_rmsnorm: o {tuple(o.shape)} z {tuple(z.shape)} w {tuple(w.shape)}")
    o3, z3 = rows3(o), rows3(z)
    if xp is not None:
        if o.shape[-1] % CHUNK:
            raise KernelInputError(f"gated_rmsnorm: a prepared output needs dv a multiple of {CHUNK}, "
                                   f"got {o.shape[-1]}")
        check_prepared_out(xp, o3.shape[0], o3.shape[1] * o3.shape[2], o.device, "gated_rmsnorm")
    y = torch.empty(o.shape, dtype=o.dtype, device=o.device)
    n_rows = o3.shape[0] * o3.shape[1]
    if n_rows:
        d = o.shape[-1]
        block = pow2(d)
        xp_ptr, s_xp = prepared_out_args(xp, y)
        gated_rmsnorm_kernel[(n_rows,)](o3, z3, w, y, xp_ptr, o3.shape[1], o3.stride(0), o3.stride(1),
                                        z3.stride(0), z3.stride(1), s_xp, d, float(eps), XP=xp is not None,
                                        BLOCK_D=block, num_warps=warps_for(block),
                                        **pdl_kw(o3.device, preload=True, late="gated_norm"))
    return y


def compile_specs(act: str):
    sig = {"o_ptr": f"*{act}", "z_ptr": f"*{act}", "w_ptr": "*fp32", "y_ptr": f"*{act}", "xp_ptr": "*i32",
           "H": "i32", "so_t": "i64", "so_h": "i64", "sz_t": "i64", "sz_h": "i64", "s_xp": "i64", "D": "i32",
           "eps": "fp32"}
    return [(gated_rmsnorm_kernel, sig, {"XP": xp, "BLOCK_D": 128, "LATE": late})
            for xp, late in ((False, 0), (True, 0), (True, 1))]          # LATE: NINFER_PDL_LATE's comparison value
