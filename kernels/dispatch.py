"""`linear(x, qw)`: pick the kernel for a `ninfer_rt.weights.QWeight` by format and number of tokens T.

* T <= 16 (decode, MTP verify): the fused dequant-GEMV of the format; the weight bytes are read once for all
  T rows and no 16-bit copy of the weight is ever made.
* T > 16 (prefill): two paths, chosen per (format, shape, T bucket, dtype, device) by timing both on the
  first call (`prefill_choices()` reports the winners):
    "fused"   the same kernel as a GEMM: decoded tiles feed tl.dot (tensor cores on sm_80+, FMAs on sm_70);
    "dequant" dequantize to a dense fp16/bf16 weight, then torch.matmul (cuBLAS; what sm_70 wants).
  Without CUDA (the interpreter) "fused" is used; with NINFER_GEMV_TUNE=0 (no timing) "dequant" unless the
  dense copy would exceed DENSE_COPY_MAX; NINFER_PREFILL_PATH=fused|dequant forces one process-wide and
  `prefill_path=` one call.
* plain bf16/f16/f32 weights: the plain GEMV for T <= 16, torch.matmul for prefill and for K that the
  plain kernel cannot read as 8-byte words.
Repacked forms (NVFP4 chunk-major planes, Q6_K planar arrays, IQ3_S 4-bit code planes (`gemv_iq3_s4`; the grid
planes of `gemv_iq3_s` with NINFER_IQ3S_LAYOUT=grid)) are built once per weight and kept in
`qw.cache` under "triton.<fmt>"; on CUDA the stored tensors are then released (`QWeight.release`); `prepare(qw)`
builds them eagerly (call it at load time, before CUDA-graph capture).
Decode calls (T <= 16) keep a resolved launch per (T, dtype, residual) in `qw.cache["triton.plans"]`
(`gemv_plan.GemvPlan`): after the first call a call costs a few checks and the launch. `qw.data` and the
repacked forms must not be replaced in place afterwards (clear `qw.cache` if they are).
x may have leading dimensions ([..., K] -> [..., N]); residual has the output's shape.
"""
from __future__ import annotations

import functools
import os

import torch
import triton

from .gemv_f8 import dequant_f8, gemv_f8
from .gemv_iq3_s4 import dequant_iq3_s_any, gemv_iq3_s_any, repack_growth, repack_iq3_s_any, unpack_iq3_s_any
from .gemv_glu import EPI_RES, SwiGLUOut, epi_of, swiglu_out
from .gemv_launch import KernelInputError, interpreting, next_pow2, tune_mode
from .gemv_timing import time_ms
from .gemv_nvfp4 import dequant_nvfp4, gemv_nvfp4, repack_nvfp4, unpack_nvfp4
from .gemv_plain import _WIDTH, gemv_plain
from .gemv_q6_k import dequant_q6_k, gemv_q6_k, repack_q6_k, unpack_q6_k
from .x16 import CHUNK, prefer_prepared, prepared_linear, prepared_ok
from .x16_check import PreparedDisagrees

DECODE_MAX_T = 16
# per repacked format: the stored tensors -> the kernels' planes, and back ({key: tensor} of `rows` or all rows)
_REPACK = {"nvfp4": lambda qw: repack_nvfp4(qw.data["codes"], qw.data["scales"]),
           "q6_k": lambda qw: repack_q6_k(qw.blocks(), qw.shape[1]),
           "iq3_s": lambda qw: repack_iq3_s_any(qw.blocks(), qw.shape[1])}
_UNPACK = {"nvfp4": lambda planes, K, rows=None: unpack_nvfp4(planes, K, rows),
           "q6_k": lambda planes, K, rows=None: {"blocks": unpack_q6_k(planes, rows)},
           "iq3_s": lambda planes, K, rows=None: {"blocks": unpack_iq3_s_any(planes, rows)}}
REPACKED = tuple(_REPACK)
_PREFILL: dict = {}
PREFILL_PATHS = ("fused", "dequant")
DENSE_COPY_MAX = 1 << 30       # bytes of the dense weight copy the untimed prefill choice allows


def prepare(qw) -> None:
    """Build the kernel-side form of `qw` now (repacked planes), so the first call does not."""
    if qw.fmt in REPACKED:
        _packed(qw)


def prepare_growth(qw) -> int:
    """Device bytes `prepare(qw)` will add to what `qw` holds now: on CUDA its planes replace the stored tensors,
    and only the IQ3_S 4-bit code planes are larger (134 bytes per 256 weights against the blocks' 110). A
    caller sizing memory before the repacks (the KV pool) keeps this free."""
    if qw.fmt != "iq3_s" or qw.device.type != "cuda" or f"triton.{qw.fmt}" in qw.cache:
        return 0
    return repack_growth(*qw.shape)


def _packed(qw) -> dict:
    """The weight's repacked planes (built once). On CUDA the stored tensors are then released: the planes are
    the same bytes (the IQ3_S code planes 22 % more, `prepare_growth`), and keeping both doubled the model's
    device memory (`QWeight.release`; the torch paths that read the stored layout get it rebuilt from the planes)."""
    key = f"triton.{qw.fmt}"
    if key not in qw.cache:
        planes = qw.cache[key] = _REPACK[qw.fmt](qw)
        if qw.device.type == "cuda":
            release(qw, planes)
    return qw.cache[key]


def release(qw, planes: dict) -> None:
    """Hand `qw` the planes as what holds it and the inverse repack as how to get its stored layout back."""
    kept = [t for k, t in planes.items() if k != "grid"]     # the IQ3_S lookup table is shared, not the weight's
    qw.release(kept, functools.partial(_UNPACK[qw.fmt], planes, qw.shape[1]))


def _plans(qw) -> dict:
    plans = qw.cache.get("triton.plans")
    if plans is None:
        plans = qw.cache["triton.plans"] = {}
    return plans


def _gemv(x, qw, out, residual):
    # decode fast path: the resolved launch of this weight at this T (kernels/gemv_plan.py); prefill T vary too
    # much to keep one per T
    plans = _plans(qw) if x.shape[0] <= DECODE_MAX_T else None
    if plans:
        plan = plans.get((x.shape[0], x.dtype, epi_of(residual)))
        if plan is not None:
            y = plan(x, out, residual)
            if y is not None:
                return y
    d = qw.data
    if qw.fmt == "nvfp4":
        return gemv_nvfp4(x, _packed(qw), d["gscale"], out, residual, plans=plans)
    if qw.fmt == "q6_k":
        return gemv_q6_k(x, _packed(qw), out, residual, plans=plans)
    if qw.fmt == "iq3_s":
        return gemv_iq3_s_any(x, _packed(qw), out, residual, plans=plans)
    if qw.fmt == "f8_e4m3_row":
        return gemv_f8(x, d["codes"], d["row_scale"], out, residual, plans=plans)
    return gemv_plain(x, d["w"], out, residual, plans=plans)


def dense_weight(qw, dtype) -> torch.Tensor:
    """[N, K] `dtype` copy of the weight (the prefill "dequant" path)."""
    d = qw.data
    if qw.fmt == "nvfp4":
        return dequant_nvfp4(_packed(qw), qw.shape[1], d["gscale"], dtype)
    if qw.fmt == "q6_k":
        return dequant_q6_k(_packed(qw), qw.shape[1], dtype)
    if qw.fmt == "iq3_s":
        return dequant_iq3_s_any(_packed(qw), qw.shape[1], dtype)
    if qw.fmt == "f8_e4m3_row":
        return dequant_f8(d["codes"], d["row_scale"], dtype)
    return d["w"].to(dtype)


def _torch_linear(x, w, out, residual):
    y = torch.matmul(x, w.to(x.dtype).T)
    if residual is not None:
        y = y + residual
    if out is not None:
        out.copy_(y)
        return out
    return y


def _dequant_path(x, qw, out, residual):
    return _torch_linear(x, dense_weight(qw, x.dtype), out, residual)


def _prefill(x, qw, out, residual, path):
    if path is None:
        key = (qw.fmt, qw.shape, min(next_pow2(x.shape[0]), 4096), str(x.dtype), str(x.device))
        path = _PREFILL.get(key)
        if path is None:
            path = _choose_prefill(x, qw, residual)
            _PREFILL[key] = path
    if path == "fused":
        return _gemv(x, qw, out, residual)
    if path == "dequant":
        return _dequant_path(x, qw, out, residual)
    raise KernelInputError(f"linear: prefill_path must be 'fused' or 'dequant', got {path!r}")


def prefill_path_env() -> str:
    """NINFER_PREFILL_PATH: 'auto' (the default) or one of PREFILL_PATHS; anything else is a one-line error."""
    forced = os.environ.get("NINFER_PREFILL_PATH", "auto")
    if forced != "auto" and forced not in PREFILL_PATHS:
        raise KernelInputError(f"NINFER_PREFILL_PATH={forced!r}: expected one of auto, {', '.join(PREFILL_PATHS)}")
    return forced


def untimed_prefill_path(n: int, k: int, element_size: int) -> str:
    """The prefill path without timing (NINFER_GEMV_TUNE=0): cuBLAS on a dequantized copy beat the fused tile
    kernel on every shape and format timed on the H200 at T=512 (bench/results/kernels.json, 1.2-4.3x);
    weights whose dense copy would exceed DENSE_COPY_MAX keep the copy-free kernel."""
    return "dequant" if n * k * element_size <= DENSE_COPY_MAX else "fused"


def _choose_prefill(x, qw, residual) -> str:
    forced = prefill_path_env()
    if forced != "auto":
        return forced
    if x.device.type != "cuda" or interpreting() or torch.cuda.is_current_stream_capturing():
        return "fused"
    if tune_mode() == "0":
        return untimed_prefill_path(qw.shape[0], qw.shape[1], x.element_size())
    times = {}
    for path, fn in (("fused", _gemv), ("dequant", _dequant_path)):
        try:
            times[path] = time_ms(lambda: fn(x, qw, None, residual), graph=False)   # prefill runs eagerly
        except (RuntimeError, triton.CompilationError, triton.runtime.errors.OutOfResources):
            continue  # e.g. out of memory for the dense copy: the other path wins
    return min(times, key=times.get) if times else "fused"


def prefill_choices() -> dict:
    return dict(_PREFILL)


def linear(x: torch.Tensor, qw, out=None, residual=None, *, prefill_path=None, xp=None) -> torch.Tensor:
    """y[..., N] = x[..., K] @ W^T (+ residual), W = `qw` in any supported format. xp: x's prepared form
    (`x16.x16_prep` of x as [T, K]; only where `x16.prepared_ok`), read by the h2 / MMA variants instead of x.
    residual may be a `gemv_glu.SwiGLUOut` where `linear_swiglu` says the GEMV takes it."""
    N, K = qw.shape
    if not isinstance(x, torch.Tensor) or x.shape[-1] != K:
        raise KernelInputError(f"linear {qw.name or qw.fmt}: x must end in K={K}, got "
                               f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.device.type != "cuda" and not interpreting():
        raise KernelInputError(f"linear {qw.name or qw.fmt}: Triton kernels need CUDA tensors "
                               f"(or TRITON_INTERPRET=1), got {x.device}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    o2 = None if out is None else out.view(-1, N)
    r2 = residual if residual is None or isinstance(residual, SwiGLUOut) else residual.reshape(-1, N)
    T = x2.shape[0]
    if T == 0:
        y = x2.new_empty((0, N)) if out is None else out
        return y.view(*lead, N) if out is None else out
    if qw.fmt in ("f32", "f16", "bf16"):
        w = qw.data["w"]
        if T > DECODE_MAX_T or K % _WIDTH[w.dtype]:
            y = _torch_linear(x2, w, o2, r2)
        else:
            y = _gemv(x2, qw, o2, r2)
    elif xp is not None:
        if not prepared_ok(qw, T, x.device) or xp.shape[0] != T:
            raise KernelInputError(f"linear {qw.name or qw.fmt}: prepared activations for {xp.shape[0]} rows do "
                                   f"not serve a {qw.fmt} weight at T={T}")
        y = _prepared_or_plain(x2, xp, qw, o2, r2, T)
    elif T > DECODE_MAX_T:
        y = _prefill(x2, qw, o2, r2, prefill_path)
    else:
        y = _gemv(x2, qw, o2, r2)
    return y.view(*lead, N) if out is None else out


def _prepared_or_plain(x2, xp, qw, o2, r2, T: int) -> torch.Tensor:
    """The prepared launch where `prefer_prepared` takes it, else (and where its variant failed `x16_check`: this
    call, and through prefer_prepared every later one) the GEMV on plain x."""
    if prefer_prepared(qw, T, x2.dtype, epi_of(r2) == EPI_RES, x2.device):
        try:
            return prepared_linear(xp, qw, o2, r2, x2.dtype)
        except PreparedDisagrees:
            qw.cache.pop("xpre.prefer", None)    # decided again, now against
    return _gemv(x2, qw, o2, r2)


def swiglu_fusable(T: int, qw) -> bool:
    """Whether `linear_swiglu` takes T rows of the fused gate/up weight `qw` ([2I, K], gate rows first): a decode
    GEMV (T <= 16) whose rows split into 128-column chunks of y."""
    N, K = qw.shape
    if not 1 <= T <= DECODE_MAX_T or N % 2 or (N // 2) % CHUNK:
        return False
    return qw.fmt not in ("f32", "f16", "bf16") or K % _WIDTH[qw.data["w"].dtype] == 0


def linear_swiglu(x: torch.Tensor, qw, *, xp=None, prepared: bool = False) -> SwiGLUOut:
    """silu(gate) * up of the fused gate/up weight `qw` for x [T, K] (`swiglu_fusable`), written by the GEMV's
    epilogue (`gemv_glu`) instead of a silu_mul kernel: a SwiGLUOut (y [T, I], and y's prepared rows when
    `prepared`). xp: x's prepared form, as for `linear`."""
    T = x.shape[0]
    if x.dim() != 2 or not swiglu_fusable(T, qw):
        raise KernelInputError(f"linear_swiglu {qw.name or qw.fmt}: x {tuple(x.shape)} and weight {tuple(qw.shape)} "
                               f"do not take the SwiGLU epilogue (swiglu_fusable)")
    glu = swiglu_out(T, qw.shape[0] // 2, x.dtype, x.device, prepared)
    linear(x, qw, residual=glu, xp=xp)
    return glu
