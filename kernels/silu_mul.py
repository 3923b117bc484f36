"""Gated activations, elementwise in fp32: SwiGLU `silu(gate) * up` over a fused [gate | up] row, and the
attention output gate `o * sigmoid(gate)`. One program per (row, column block).

With `xp` both also write their output's prepared form (`ninfer_kernels.x16`, bit-identical to `x16_prep` of
the output) for the next linear layer: a column block is whole 128-activation chunks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ops_common import KernelInputError
from .x16 import CHUNK, check_prepared_out, prepared_out_args, store_prepared
from .pdl import pdl_enter, pdl_kw

BLOCK = 1024          # a multiple of x16.CHUNK: each program owns whole chunks of the prepared row
assert BLOCK % CHUNK == 0


@triton.jit
def silu_mul_kernel(x_ptr, y_ptr, xp_ptr, I, sx_t, s_xp, XP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)   # ninfer_kernels.pdl: before any load or store
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < I
    gate = tl.load(x_ptr + t * sx_t + c, mask=m, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * sx_t + I + c, mask=m, other=0.0).to(tl.float32)
    y = (gate * tl.sigmoid(gate) * up).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + t * I + c, y, mask=m)
    if XP:
        c0 = tl.program_id(1) * BLOCK
        store_prepared(y.to(tl.float32), xp_ptr + t * s_xp, c0, I - c0, I)


@triton.jit
def sigmoid_mul_kernel(o_ptr, g_ptr, y_ptr, xp_ptr, W, D, so_t, sg_t, sg_h, s_xp, XP: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)   # ninfer_kernels.pdl: before any load or store
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < W
    o = tl.load(o_ptr + t * so_t + c, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + t * sg_t + (c // D) * sg_h + c % D, mask=m, other=0.0).to(tl.float32)
    y = (o * tl.sigmoid(g)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + t * W + c, y, mask=m)
    if XP:
        c0 = tl.program_id(1) * BLOCK
        store_prepared(y.to(tl.float32), xp_ptr + t * s_xp, c0, W - c0, W)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def silu_mul(gate_up: torch.Tensor, xp=None) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns first) -> silu(gate) * up [T, I] in gate_up's dtype; its prepared form
    into `xp` (int32 [T, I/2 + I/128]) when given."""
    t, two_i = gate_up.shape
    if two_i % 2:
        raise KernelInputError(f"silu_mul: last dim {two_i} is odd")
    x = _rows(gate_up)
    if xp is not None:
        check_prepared_out(xp, t, two_i // 2, x.device, "silu_mul")
    y = torch.empty(t, two_i // 2, dtype=x.dtype, device=x.device)
    if y.numel():
        xp_ptr, s_xp = prepared_out_args(xp, y)
        silu_mul_kernel[(t, triton.cdiv(two_i // 2, BLOCK))](x, y, xp_ptr, two_i // 2, x.stride(0), s_xp,
                                                              XP=xp is not None, BLOCK=BLOCK, num_warps=4,
                                                              **pdl_kw(x.device))
    return y


def sigmoid_mul(o: torch.Tensor, gate: torch.Tensor, xp=None) -> torch.Tensor:
    """o, gate [T, W] or [T, H, D] -> o * sigmoid(gate), a new contiguous tensor of o's shape and dtype. The gate
    may be a strided head slice (the gate half of the per-head [q | gate] projection): read in place, no copy.
    The output's prepared form as [T, W = H * D] rows into `xp` when given."""
    if o.shape != gate.shape or o.dim() not in (2, 3):
        raise KernelInputError(f"sigmoid_gate: o {tuple(o.shape)} vs gate {tuple(gate.shape)}")
    g3 = _rows(gate if gate.dim() == 3 else gate[:, None, :])
    o2 = _rows(o.flatten(1))
    t, w = o2.shape
    if xp is not None:
        check_prepared_out(xp, t, w, o.device, "sigmoid_gate")
    y = torch.empty(o.shape, dtype=o.dtype, device=o.device)
    if y.numel():
        xp_ptr, s_xp = prepared_out_args(xp, y)
        sigmoid_mul_kernel[(t, triton.cdiv(w, BLOCK))](o2, g3, y, xp_ptr, w, g3.shape[-1], o2.stride(0),
                                                       g3.stride(0), g3.stride(1), s_xp, XP=xp is not None,
                                                       BLOCK=BLOCK, num_warps=4, **pdl_kw(o2.device))
    return y


def compile_specs(act: str):
    silu = {"x_ptr": f"*{act}", "y_ptr": f"*{act}", "xp_ptr": "*i32", "I": "i32", "sx_t": "i64", "s_xp": "i64"}
    sig = {"o_ptr": f"*{act}", "g_ptr": f"*{act}", "y_ptr": f"*{act}", "xp_ptr": "*i32", "W": "i32", "D": "i32",
           "so_t": "i64", "sg_t": "i64", "sg_h": "i64", "s_xp": "i64"}
    return [(k, s, {"XP": xp, "BLOCK": BLOCK}) for k, s in ((silu_mul_kernel, silu), (sigmoid_mul_kernel, sig))
            for xp in (False, True)]
