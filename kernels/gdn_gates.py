"""GDN gates (reference §7.5): g = -exp(A_log) * softplus(a + dt_bias) (log-decay), beta = sigmoid(b), fp32.

One program per token over all value heads; a and b may be strided column slices of the fused b|a projection.
softplus uses torch's threshold (x > 20 -> x).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ops_common import KernelInputError, pow2
from .pdl import pdl_enter, pdl_kw


@triton.jit
def log_decay(z, a_log):
    """g = -exp(A_log) * softplus(z) for z = a + dt_bias, fp32 (also used by `gdn_ba_gates`)."""
    sp = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))
    return -tl.exp(a_log) * sp


@triton.jit
def gdn_gates_kernel(a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, H, sa_t, sb_t, BLOCK_H: tl.constexpr,
                     PDL: tl.constexpr = 0):
    pdl_enter(PDL)   # ninfer_kernels.pdl: before any load or store
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    m = h < H
    x = tl.load(a_ptr + t * sa_t + h, mask=m, other=0.0).to(tl.float32) + \
        tl.load(dtb_ptr + h, mask=m, other=0.0).to(tl.float32)
    g = log_decay(x, tl.load(alog_ptr + h, mask=m, other=0.0).to(tl.float32))
    beta = tl.sigmoid(tl.load(b_ptr + t * sb_t + h, mask=m, other=0.0).to(tl.float32))
    tl.store(g_ptr + t * H + h, g, mask=m)
    tl.store(beta_ptr + t * H + h, beta, mask=m)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, Hv] -> (g, beta) fp32 [T, Hv] (contiguous)."""
    t, h = a.shape
    if b.shape != a.shape or A_log.shape != (h,) or dt_bias.shape != (h,):
        raise KernelInputError(f"gdn_gates: a {tuple(a.shape)} b {tuple(b.shape)} A_log {tuple(A_log.shape)} "
                         f"dt_bias {tuple(dt_bias.shape)}")
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    g = torch.empty(t, h, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    if t:
        gdn_gates_kernel[(t,)](a, b, A_log, dt_bias, g, beta, h, a.stride(0), b.stride(0),
                               BLOCK_H=pow2(h), num_warps=1, **pdl_kw(a.device))
    return g, beta


def compile_specs(act: str):
    sig = {"a_ptr": f"*{act}", "b_ptr": f"*{act}", "alog_ptr": "*fp32", "dtb_ptr": "*fp32", "g_ptr": "*fp32",
           "beta_ptr": "*fp32", "H": "i32", "sa_t": "i64", "sb_t": "i64"}
    return [(gdn_gates_kernel, sig, {"BLOCK_H": 64})]
