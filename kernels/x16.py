"""Prepared activations for the f16 GEMV variants: x [T, K] once converted to scaled f16 pairs, so a GEMV's every
CTA loads ready operands instead of converting, scaling and packing the same activations again.

Why: in the packed-half2 T=1 NVFP4 loop ~16 % of the SASS instructions per tile (and ~24 % in the warp-MMA loop
for T = 2..16) load bf16 activations one by one, widen, scale and pack them (Triton 3.6, sm_90; bench/NOTES.md
§10); every CTA of a GEMV repeats that for the same K slice.

Layout and the producers' store: `x16_layout`.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .gemv_launch import GemvConfig, KernelInputError, _launch, has_variant
from .gemv_tune_cache import H2_FORMATS   # every format's packed-half2 GEMV (T <= 8) reads prepared input too
from .pdl import pdl_enter, pdl_kw
from .x16_check import PreparedDisagrees, agrees, disagreed
# the layout's names stay importable from here (callers and tests use them)
from .x16_layout import (_CHUNK, CHUNK, E_MAX, E_MIN, UP_FIELD, align_env_error, empty_prepared,  # noqa: F401
                         row_stride, store_prepared, words_per_row)


@triton.jit
def x16_kernel(x_ptr, out_ptr, K, stride_xt, stride_ot, CHUNKS: tl.constexpr, PDL: tl.constexpr = 0):
    """One program per (row, CHUNKS chunks)."""
    pdl_enter(PDL)   # ninfer_kernels.pdl: before any load or store
    t = tl.program_id(0)
    for i in tl.static_range(CHUNKS):
        c = tl.program_id(1) * CHUNKS + i
        if c * _CHUNK < K:
            v = tl.load(x_ptr + t * stride_xt + c * _CHUNK + tl.arange(0, _CHUNK)).to(tl.float32)
            store_prepared(v, out_ptr + t * stride_ot, c * _CHUNK, _CHUNK, K)


def check_prepared_out(xp, rows: int, K: int, device, what: str) -> None:
    """A producer's prepared-output buffer: int32 [rows, K/2 + K/128], unit column stride, K a multiple of 128."""
    ok = (isinstance(xp, torch.Tensor) and xp.dtype == torch.int32 and K % CHUNK == 0 and xp.dim() == 2
          and tuple(xp.shape) == (rows, words_per_row(K)) and xp.stride(1) == 1 and xp.device == device)
    if not ok:
        got = (tuple(xp.shape), xp.dtype, str(xp.device)) if isinstance(xp, torch.Tensor) else type(xp).__name__
        raise KernelInputError(f"{what}: the prepared output must be int32 [{rows}, K/2 + K/{CHUNK}] for K={K} "
                               f"(a multiple of {CHUNK}) on {device}, got {got}")


def prepared_out_args(xp, placeholder: torch.Tensor) -> tuple:
    """(pointer, row stride) a producer kernel takes for its optional prepared output: xp's, or a placeholder
    pointer and 0 when there is none (the XP constexpr is then False and nothing is stored)."""
    return (placeholder, 0) if xp is None else (xp, xp.stride(0))


def x16_ref(x: torch.Tensor) -> torch.Tensor:
    """The layout above in torch (fp32 math, the same roundings): int32 [T, K/2 + K/128]."""
    T, K = x.shape
    v = x.float().reshape(T, K // CHUNK, CHUNK)
    amax = v.abs().amax(-1)
    e = ((amax.view(torch.int32) >> 23) & 0xFF).clamp(E_MIN, E_MAX)
    up = ((UP_FIELD - e) << 23).view(torch.float32)
    h = (v * up[..., None]).to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    h = h.reshape(T, K // 8, 2, 4)
    words = (h[:, :, 0] | (h[:, :, 1] << 16)).reshape(T, K // 2)
    return torch.cat([words, (e + 254 - UP_FIELD) << 23], dim=1)


def x16_decode(p: torch.Tensor, K: int) -> torch.Tensor:
    """fp32 [T, K] that the prepared rows stand for (x' * back): for tests and `x16_check`."""
    T = p.shape[0]
    w = p[:, :K // 2].reshape(T, K // 8, 4)
    lo = (w & 0xFFFF).to(torch.int16).view(torch.float16).float()
    hi = ((w >> 16) & 0xFFFF).to(torch.int16).view(torch.float16).float()
    vals = torch.stack([lo, hi], dim=2).reshape(T, K)
    back = p[:, K // 2:].contiguous().view(torch.float32)
    return vals * back.repeat_interleave(CHUNK, dim=1)


def x16_prep(x: torch.Tensor, out: torch.Tensor | None = None, chunks_per_program: int = 4) -> torch.Tensor:
    """x [T, K] fp16/bf16/fp32 (K a multiple of 128, unit column stride) -> int32 [T, K/2 + K/128]."""
    if x.dim() != 2 or x.shape[1] % CHUNK or x.stride(1) != 1:
        raise ValueError(f"x16_prep: x must be [T, K] with K a multiple of {CHUNK} and unit column stride, "
                         f"got {tuple(x.shape)} strides {x.stride()}")
    T, K = x.shape
    if out is None:
        out = empty_prepared(T, K, x.device)
    grid = (T, triton.cdiv(K // CHUNK, chunks_per_program))
    x16_kernel[grid](x, out, K, x.stride(0), out.stride(0), CHUNKS=chunks_per_program, **pdl_kw(x.device))
    return out


def compile_specs(act: str):
    return [(x16_kernel, {"x_ptr": f"*{act}", "out_ptr": "*i32", "K": "i32", "stride_xt": "i32",
                          "stride_ot": "i32"}, {"CHUNKS": 4})]


def launch_prepared(kernel, weights: tuple, xp, N: int, K: int, GS: int, fscale: float, out, residual,
                    cfg: GemvConfig, what: str):
    """One config of the h2 (T <= 8) or mma (T <= 16) variant of `kernel` on prepared activations
    (`ninfer_kernels.x16`: int32 [T, K/2 + K/128]); out [T, N] given (its dtype is the output's). No tuning."""
    _launch(*_checked_args(kernel, weights, xp, N, K, GS, fscale, out, residual, cfg, what), extra={"XPRE": True})
    return out


def _checked_args(kernel, weights, xp, N, K, GS, fscale, out, residual, cfg, what) -> tuple:
    """`gemv_launch._launch`'s leading arguments for a prepared launch, after checking them."""
    if not isinstance(xp, torch.Tensor) or xp.dtype != torch.int32 or xp.dim() != 2 or K % CHUNK \
            or xp.shape[1] != words_per_row(K) or xp.stride(1) != 1:
        got = (tuple(xp.shape), xp.dtype) if isinstance(xp, torch.Tensor) else type(xp).__name__
        raise KernelInputError(f"{what}: activations must be int32 [T, {words_per_row(max(K, 0))}] prepared from "
                               f"K={K} (a multiple of {CHUNK}), got {got}")
    T, G = xp.shape[0], K // GS
    kind = "h2" if cfg.h2 else "mma" if cfg.mma else None
    if kind is None or not has_variant(kernel, kind) or T > (8 if cfg.h2 else 16) or (cfg.mma and G % cfg.block_g):
        raise KernelInputError(f"{what}: needs an h2 config (T <= 8) or an mma config (T <= 16, K a multiple of "
                               f"block_g * {GS}) of a variant this format has, got {cfg} at T={T}, K={K}")
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (T, N) or out.stride(1) != 1 \
            or out.device != xp.device:
        raise KernelInputError(f"{what}: out must be [{T}, {N}] with unit column stride on {xp.device}")
    return kernel, weights, xp, N, G, fscale, out, residual, cfg


# ---- the tuned linear on prepared activations (`ninfer_rt.backends.triton_ops`, NINFER_XPRE) ----


XPRE_MODES = ("auto", "0", "1")


def xpre_env() -> str:
    """NINFER_XPRE: whether the producers write prepared activations for the linear layers: 'auto' (the default:
    on CUDA devices of compute capability 8.0+, where bench/NOTES.md §11 measured it faster), '0' or '1'."""
    v = os.environ.get("NINFER_XPRE", "auto")
    if v not in XPRE_MODES:
        raise KernelInputError(f"NINFER_XPRE={v!r}: expected one of {', '.join(XPRE_MODES)}")
    return v


def auto_on(device) -> bool:
    """NINFER_XPRE=auto's choice for `device`."""
    device = torch.device(device)
    return device.type == "cuda" and _capability(device.index) >= (8, 0)


def xpre_on(mode: str, device) -> bool:
    """Whether NINFER_XPRE's `mode` ('auto', '1', '0') has the producers write prepared activations on `device`."""
    return mode == "1" or (mode == "auto" and auto_on(device))


def _mma_ok(device: torch.device) -> bool:
    from .gemv_launch import interpreting
    return interpreting() or (device.type == "cuda" and _capability(device.index) >= (8, 0))


@functools.lru_cache(maxsize=None)
def _capability(index) -> tuple:
    """Cached: `prepared_ok` runs on every linear call of a decode step."""
    return torch.cuda.get_device_capability(index)


def prepared_ok(qw, T: int, device) -> bool:
    """Whether a prepared launch serves weight `qw` at T rows: NVFP4, Q6_K and IQ3_S (h2 up to T = 8, MMA up to
    16 on sm_80+); K a multiple of 128."""
    if qw.shape[1] % CHUNK or not 1 <= T <= 16 or qw.fmt not in H2_FORMATS:
        return False
    return T <= 8 or _mma_ok(torch.device(device))


PREFER_MARGIN = 0.02     # the plain launch must be remembered this much faster to be taken over the prepared one
GS = 16                  # weights per group of the formats' GEMVs (NVFP4 blocks; Q6_K sub-blocks; IQ3_S groups)


def prefer_prepared(qw, T: int, dtype, residual: bool, device) -> bool:
    """Whether the prepared launch serves `qw` at T rows: yes unless both choices are remembered (user cache or
    shipped H200 table, `gemv_tune_cache.remembered_ms`) and the plain one is faster (on the H200 the warp-MMA
    loop at T = 4..8 gains nothing from prepared input on some shapes). Decided once per weight, T, dtype,
    residual and device."""
    k = (T, dtype, residual, device)
    memo = qw.cache.setdefault("xpre.prefer", {})
    hit = memo.get(k)
    if hit is not None:                      # the decode step's path: one lookup per call
        return hit
    from .gemv_launch import interpreting, tune_key
    device = torch.device(device)
    if disagreed(qw.fmt):                    # its prepared launch failed `x16_check` in this process
        memo[k] = False
        return False
    if device.type != "cuda" or interpreting():
        return True
    from . import gemv_tune_cache as tc
    name = _kernel_name(qw)
    plain, prep = (tc.remembered_ms(tc.make_key(tune_key(n, qw.shape[0], qw.shape[1] // GS, T, dtype, residual,
                                                         device), GS, device)) for n in (name, name + XPRE_SUFFIX))
    memo[k] = plain is None or prep is None or prep <= plain * (1 + PREFER_MARGIN)
    return memo[k]


def _kernel_name(qw) -> str:
    """The tuner name of `qw`'s GEMV (IQ3_S: of the planes it was repacked into, else of those it will be)."""
    if qw.fmt != "iq3_s":
        return f"{qw.fmt}_gemv_kernel"
    from .gemv_iq3_s4 import kernel_name
    return kernel_name(qw.cache.get("triton.iq3_s"))


def _kernel_and_weights(qw, device):
    """(kernel, weight arguments, fscale) of `qw` for a prepared launch."""
    K = qw.shape[1]
    from . import dispatch
    if qw.fmt == "nvfp4":
        from .gemv_nvfp4 import _weights, nvfp4_gemv_kernel
        return nvfp4_gemv_kernel, _weights(dispatch._packed(qw), K, device, "linear (prepared)")[1], qw.data["gscale"]
    if qw.fmt == "iq3_s":
        from .gemv_iq3_s4 import kernel_and_weights        # either IQ3_S layout (NINFER_IQ3S_LAYOUT)
        return (*kernel_and_weights(dispatch._packed(qw), K, device, "linear (prepared)"), 1.0)
    from .gemv_q6_k import _weights, q6_k_gemv_kernel
    return q6_k_gemv_kernel, _weights(dispatch._packed(qw), K, device, "linear (prepared)")[1], 1.0


XPRE_SUFFIX = "+xpre"   # tuner kernel names (and so tune-cache formats, e.g. "nvfp4+xpre") of prepared launches
_PLAN_TAG = "xpre"       # first field of a prepared launch's key in the weight's plan dict


def prepared_linear(xp: torch.Tensor, qw, out, residual, dtype) -> torch.Tensor:
    """y [T, N] `dtype` = x @ W^T (+ residual) from x's prepared form xp. The h2 / MMA config is the GEMV tuner's
    (`gemv_launch.choose_config`) under the format "<fmt>+xpre": remembered across processes like the others.
    Once final it becomes a `GemvPlan` in the weight's plan dict: later calls skip the checks and the tuner
    (eager decode steps pay ~450 of these per step)."""
    from .dispatch import _plans
    from .gemv_launch import epi_of
    plans, pkey = _plans(qw), (_PLAN_TAG, xp.shape[0], dtype, epi_of(residual))
    plan = plans.get(pkey)
    if plan is not None:
        y = plan(xp, out, residual)
        if y is not None:
            return y
    return _prepared_checked(xp, qw, out, residual, dtype, plans, pkey)


def prepared_candidates(kernel, fmt: str, T: int, N: int, K: int, dtype, dev) -> list[GemvConfig]:
    """The configs the tuner tries for a prepared launch of a `fmt` weight [N, K] at T rows (h2 for NVFP4 and Q6_K
    up to T = 8, MMA on sm_80+)."""
    from .gemv_launch import candidates, h2_tiles, interpreting, mma_tiles
    h2 = fmt in H2_FORMATS and T <= 8
    cands = [c for c in candidates(T, N, K // GS, GS, dtype, dev, h2=h2, mma=True, h2_tiles=h2_tiles(kernel),
                                   mma_tiles=mma_tiles(kernel)) if (c.h2 and h2) or (c.mma and _mma_ok(dev))]
    if not cands or interpreting():      # the interpreter: one small tile of the variant
        cands = [GemvConfig(32, 16, 2, 1, h2=True) if h2 else GemvConfig(32, 8, 2, 1, mma=True)]
    return cands


def _prepared_checked(xp, qw, out, residual, dtype, plans: dict, pkey) -> torch.Tensor:
    from .gemv_launch import (EPI_RES, check_glu, choose_config, epi_of, glu_candidates, glu_config, res_slot,
                              tune_key)
    from .gemv_plan import GemvPlan
    T, (N, K), dev = xp.shape[0], qw.shape, xp.device
    kernel, w, fscale = _kernel_and_weights(qw, dev)
    cands = prepared_candidates(kernel, qw.fmt, T, N, K, dtype, dev)
    out = torch.empty((T, N), dtype=dtype, device=dev) if out is None else out
    epi = epi_of(residual)
    if epi > EPI_RES:
        bad = check_glu(residual, T, N, dtype, dev)
        if bad:
            raise KernelInputError(f"linear (prepared): SwiGLU epilogue: {bad}")
        cands = glu_candidates(cands, epi, N, "linear (prepared)")
    key = tune_key(kernel.__name__ + XPRE_SUFFIX, N, K // GS, T, dtype, epi == EPI_RES, dev)
    scratch = []

    def run(c):     # timed into scratch: out may alias the residual
        if not scratch:
            scratch.append(torch.empty_like(out))
        return launch_prepared(kernel, w, xp, N, K, GS, fscale, scratch[0], residual, c, "linear (prepared)")
    cfg, final = glu_config(choose_config(key, cands, run, dev, GS), cands, epi, N)
    if not agrees(kernel, w, xp, N, K, GS, fscale, cfg, qw.fmt):
        raise PreparedDisagrees(qw.fmt)
    args = _checked_args(kernel, w, xp, N, K, GS, fscale, out, residual, cfg, "linear (prepared)")
    compiled, grid, ws, cnt, scalars, consts, launched = _launch(*args, extra={"XPRE": True})
    if final:
        plans[pkey] = GemvPlan(launched, grid, w, ws, cnt, scalars, consts, compiled, xp, out,
                               res_slot(residual, out), epi)
    return out
