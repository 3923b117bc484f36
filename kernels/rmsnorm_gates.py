"""The input norm of a GDN layer with that layer's b/a gates (decode / verify, plain b/a weight): for x [T, D]
(plus the residual), y = rmsnorm(x) * (1 + w) as `rmsnorm.add_rmsnorm` gives it, and from y the gates
`gdn_ba_gates.gdn_ba_gates` gives: beta = sigmoid(y @ w_b^T), g = -exp(A_log) * softplus(y @ w_a^T + dt_bias).

Why: the gates read only the norm's output. As a kernel of their own they ran on a side stream beside the
q/k/v/z GEMV and joined the step in front of the recurrence; a join is a plain graph edge, which cost a ~0.45 us
gap and the recurrence's early placement under PDL (bench/NOTES.md §29). Here the norm's grid grows by one
program per (b/a row, token): each recomputes its token's norm (two row reads that the norm programs make too,
so the kernel's length is about the norm's) and takes one dot product of the rounded row with its weight row,
which no kernel writes and so is loaded before the PDL wait with the gain. Nothing joins.

The Triton backend takes it for decode steps only (T <= `BACKEND_MAX_T`): on the H200 the 27B decode step went
5.948 / 5.948 -> 5.909 / 5.917 ms of GPU time, while with every T <= 16 the verify step (T = 4: 388 programs of 8
warps at ~120 registers, two waves, in front of a GEMV that could not be placed early beside them) lost 180 us
(bench/NOTES.md §30). The kernel itself takes T <= MAX_T.

Programs 0..T-1 are the norm rows (outputs as `add_rmsnorm`'s, with the prepared form when asked); program
T + j T + t is b/a row j (b rows 0..H-1, a rows H..2H-1) for token t. The dot products are rounded to the
activation dtype before the gate, as the unfused projection's output is.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gdn_ba_gates import MAX_T, W_KINDS, widen
from .gdn_gates import log_decay
from .ops_common import KernelInputError, pow2
from .pdl import pdl_kw, pdl_trigger, pdl_wait
from .rmsnorm import load_summed, norm_warps, normalized
from .x16 import check_prepared_out, prepared_out_args, store_prepared


BACKEND_MAX_T = 1


@triton.jit
def _params(w_ptr, wba_ptr, alog_ptr, dtb_ptr, j, gate, offs, m, D, H, W_KIND: tl.constexpr):
    """What no kernel writes: the gain (+1), and for a gate program its b/a row, dt_bias and A_log."""
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32) + 1.0
    wr = widen(tl.load(wba_ptr + j.to(tl.int64) * D + offs, mask=offs < tl.where(gate, D, 0), other=0), W_KIND)
    h = tl.minimum(tl.maximum(j - H, 0), H - 1)          # a valid head in every program: no mask needed
    return w, wr, tl.load(dtb_ptr + h), tl.load(alog_ptr + h)


@triton.jit
def add_rmsnorm_gates_kernel(x_ptr, r_ptr, w_ptr, y_ptr, rsum_ptr, xp_ptr, wba_ptr, alog_ptr, dtb_ptr, g_ptr,
                             beta_ptr, T, D, H, sx, sr, s_xp, eps, HAS_RES: tl.constexpr, XP: tl.constexpr,
                             W_KIND: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = 0,
                             PRELOAD: tl.constexpr = 0):
    pid = tl.program_id(0)
    gate = pid >= T
    q = tl.maximum(pid - T, 0)
    j = q // T                                   # the gate program's b/a row
    row = tl.where(gate, q % T, pid).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    # ninfer_kernels.pdl: with PRELOAD the gain and the b/a row are in flight during the wait
    pdl_trigger(PDL)
    if PRELOAD:
        w, wr, dtb, alog = _params(w_ptr, wba_ptr, alog_ptr, dtb_ptr, j, gate, offs, m, D, H, W_KIND)
    pdl_wait(PDL)
    if not PRELOAD:
        w, wr, dtb, alog = _params(w_ptr, wba_ptr, alog_ptr, dtb_ptr, j, gate, offs, m, D, H, W_KIND)
    x, s = load_summed(x_ptr + row * sx + offs, r_ptr + row * sr + offs, m, HAS_RES, y_ptr.dtype.element_ty)
    y = normalized(x, w, D, eps).to(y_ptr.dtype.element_ty)
    if gate:
        d = tl.sum(y.to(tl.float32) * wr, axis=0).to(y_ptr.dtype.element_ty).to(tl.float32)
        if j < H:
            tl.store(beta_ptr + row * H + j, tl.sigmoid(d))
        else:
            tl.store(g_ptr + row * H + (j - H), log_decay(d + dtb, alog))
    else:
        if HAS_RES:
            tl.store(rsum_ptr + row * D + offs, s, mask=m)
        tl.store(y_ptr + row * D + offs, y, mask=m)
        if XP:
            store_prepared(y.to(tl.float32), xp_ptr + row * s_xp, 0, D, D)


def supported(x: torch.Tensor, w_ba: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether the fused kernel takes this call (else the caller composes the norm and the gates)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_T and x.stride(-1) == 1 and w_ba.dtype in W_KINDS
            and w_ba.dim() == 2 and w_ba.shape[1] == x.shape[1] and w_ba.is_contiguous()
            and (residual is None or residual.stride(-1) == 1))


def add_rmsnorm_gates(x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float,
                      w_ba: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, xp=None):
    """x [T, D] (T <= MAX_T), residual [T, D] or None, w [D] (the (1 + w) gain), w_ba [2 Hv, D] plain ->
    (y, residual + x or None, g, beta): y and the sum new [T, D] tensors in x's dtype, g / beta fp32 [T, Hv];
    y's prepared form into `xp` when given (`ninfer_kernels.x16`)."""
    t, d = x.shape
    h = w_ba.shape[0] // 2
    if (w.shape != (d,) or w_ba.shape != (2 * h, d) or A_log.shape != (h,) or dt_bias.shape != (h,)
            or (residual is not None and residual.shape != x.shape)):
        raise KernelInputError(f"add_rmsnorm_gates: x {tuple(x.shape)} residual "
                               f"{None if residual is None else tuple(residual.shape)} w {tuple(w.shape)} w_ba "
                               f"{tuple(w_ba.shape)} A_log {tuple(A_log.shape)} dt_bias {tuple(dt_bias.shape)}")
    if not supported(x, w_ba, residual):
        raise KernelInputError(f"add_rmsnorm_gates: x {tuple(x.shape)} {x.dtype} / w_ba {w_ba.dtype} not handled "
                               f"(T must be 1..{MAX_T}, w_ba a contiguous bf16/f16/f32 matrix, unit last strides)")
    if xp is not None:
        check_prepared_out(xp, t, d, x.device, "add_rmsnorm_gates")
    y = torch.empty(t, d, dtype=x.dtype, device=x.device)
    s = torch.empty_like(y) if residual is not None else None
    g = torch.empty(t, h, dtype=torch.float32, device=x.device)
    beta = torch.empty_like(g)
    r = x if residual is None else residual
    xp_ptr, s_xp = prepared_out_args(xp, y)
    wv = w_ba if w_ba.dtype == torch.float32 else w_ba.view(torch.int16)
    block = pow2(d)
    add_rmsnorm_gates_kernel[(t + 2 * h * t,)](
        x, r, w, y, y if s is None else s, xp_ptr, wv, A_log, dt_bias, g, beta, t, d, h, x.stride(0), r.stride(0),
        s_xp, float(eps), HAS_RES=residual is not None, XP=xp is not None, W_KIND=W_KINDS[w_ba.dtype],
        BLOCK_D=block, num_warps=norm_warps(block), **pdl_kw(x.device, preload=True))
    return y, s, g, beta


def compile_specs(act: str):
    """(kernel, signature, constexprs, warps) at the decode step's sizes (D = 5120 in an 8192 block), b/a weights in
    the activation dtype as the loader gives them."""
    kind = {"bf16": 0, "fp16": 1, "fp32": 2}[act]
    sig = {"x_ptr": f"*{act}", "r_ptr": f"*{act}", "w_ptr": "*fp32", "y_ptr": f"*{act}", "rsum_ptr": f"*{act}",
           "xp_ptr": "*i32", "wba_ptr": "*fp32" if kind == 2 else "*i16", "alog_ptr": "*fp32", "dtb_ptr": "*fp32",
           "g_ptr": "*fp32", "beta_ptr": "*fp32", "T": "i32", "D": "i32", "H": "i32", "sx": "i64", "sr": "i64",
           "s_xp": "i64", "eps": "fp32"}
    return [(add_rmsnorm_gates_kernel, sig, {"HAS_RES": r, "XP": xp, "W_KIND": kind, "BLOCK_D": 8192}, 8)
            for r, xp in ((True, True), (False, True), (True, False))]
