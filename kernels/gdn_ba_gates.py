"""GDN b/a projection fused with the gates (decode / verify, plain weights): for the row-fused [b; a] weight
w [2 Hv, K], beta = sigmoid(x @ w_b^T) and g = -exp(A_log) * softplus(x @ w_a^T + dt_bias), both fp32 [T, Hv].

Why: the projection is 2 Hv rows (96 at TP1: 1 MB of bf16) -- too few for the GEMV's row blocks to fill the
device, so it went split-K with a reduction pass (5.7 us on the H200), then the gates took a launch of their
own. Here one program owns one row and all T tokens (the row's 10 KB read once, in one or two load waves) and
applies that row's gate. The dot products are rounded to the activation dtype before the gate, as the unfused
projection's output is, so both paths give the same numbers up to summation order.

Plain weights come in the activation dtype (the loader converts them: bf16 on the H200, fp16 on sm_70). 16-bit
weights are read as integers and widened with bit operations (bf16: a shift, so no bf16 arithmetic is needed
anywhere); f32 weights load as they are.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gdn_gates import log_decay
from .ops_common import KernelInputError, pow2
from .pdl import pdl_enter, pdl_kw

MAX_T = 16                        # verify's widest step; longer chunks (prefill) take the unfused path
W_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_ELEMS = 8192                     # T_TILE * BLOCK_K: 32 fp32 accumulators per thread at 8 warps


@triton.jit
def widen(raw, KIND: tl.constexpr):
    if KIND == 0:
        return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif KIND == 1:
        return raw.to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return raw


@triton.jit
def gdn_ba_gates_kernel(x_ptr, w_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, T, K, H, sx_t,
                        W_KIND: tl.constexpr, T_TILE: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)   # ninfer_kernels.pdl: before any load or store
    r = tl.program_id(0)                     # row of [b; a]: b rows 0..H-1, a rows H..2H-1
    ts = tl.arange(0, T_TILE)
    ks = tl.arange(0, BLOCK_K)
    tm = ts < T
    wrow = w_ptr + r.to(tl.int64) * K
    acc = tl.zeros([T_TILE, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        km = k0 + ks < K
        w = widen(tl.load(wrow + k0 + ks, mask=km, other=0), W_KIND)
        x = tl.load(x_ptr + ts[:, None] * sx_t + (k0 + ks)[None, :], mask=tm[:, None] & km[None, :], other=0.0)
        acc += x.to(tl.float32) * w[None, :]
    y = tl.sum(acc, axis=1).to(x_ptr.dtype.element_ty).to(tl.float32)
    if r < H:
        tl.store(beta_ptr + ts * H + r, tl.sigmoid(y), mask=tm)
    else:
        h = r - H
        tl.store(g_ptr + ts * H + h, log_decay(y + tl.load(dtb_ptr + h), tl.load(alog_ptr + h)), mask=tm)


def supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the fused kernel takes this call (else the caller composes linear + gates)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_T and w.dtype in W_KINDS and w.dim() == 2
            and w.stride(-1) == 1 and w.stride(0) == w.shape[1] and x.stride(-1) == 1)


def gdn_ba_gates(x: torch.Tensor, w: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (T <= MAX_T), w [2 Hv, K] plain (rows b then a) -> (g, beta) fp32 [T, Hv]."""
    t, k = x.shape
    h = w.shape[0] // 2
    if w.shape != (2 * h, k) or A_log.shape != (h,) or dt_bias.shape != (h,):
        raise KernelInputError(f"gdn_ba_gates: x {tuple(x.shape)} w {tuple(w.shape)} A_log {tuple(A_log.shape)} "
                               f"dt_bias {tuple(dt_bias.shape)}")
    if not supported(x, w):
        raise KernelInputError(f"gdn_ba_gates: x {tuple(x.shape)} {x.dtype} / w {w.dtype} not handled "
                               f"(T must be 1..{MAX_T}, w a contiguous bf16/f16/f32 matrix)")
    g = torch.empty(t, h, dtype=torch.float32, device=x.device)
    beta = torch.empty_like(g)
    t_tile = pow2(t)
    wv = w if w.dtype == torch.float32 else w.view(torch.int16)
    gdn_ba_gates_kernel[(2 * h,)](x, wv, A_log, dt_bias, g, beta, t, k, h, x.stride(0), W_KIND=W_KINDS[w.dtype],
                                  T_TILE=t_tile, BLOCK_K=min(pow2(k), _ELEMS // t_tile), num_warps=8,
                                  **pdl_kw(x.device))
    return g, beta


def compile_specs(act: str):
    """(kernel, signature, constexprs, warps) at TP1 sizes (K 5120), weights in the activation dtype as the
    loader gives them: T = 1 and 16."""
    kind = {"bf16": 0, "fp16": 1, "fp32": 2}[act]
    sig = {"x_ptr": f"*{act}", "w_ptr": "*fp32" if kind == 2 else "*i16", "alog_ptr": "*fp32", "dtb_ptr": "*fp32",
           "g_ptr": "*fp32", "beta_ptr": "*fp32", "T": "i32", "K": "i32", "H": "i32", "sx_t": "i64"}
    return [(gdn_ba_gates_kernel, sig, {"W_KIND": kind, "T_TILE": tt, "BLOCK_K": _ELEMS // tt}, 8)
            for tt in (1, 16)]
