"""The prepared-activation GEMVs checked against the format's fp32 kernel, once per format, variant and GPU.

`gemv_h2_select.checked_h2` guards the packed-half2 and warp-MMA variants when they are tuned on plain
activations: the winner must agree with a plain candidate. A prepared launch (`ninfer_kernels.x16`) has no plain
candidate to compare with, so without this its variants would run unchecked on every GPU but the H200 they were
measured on. Here the first prepared plan of each (format, variant kind, device) is launched once more without
residual and compared with the format's fp32 kernel on the activations the prepared rows stand for
(`x16_decode`). A disagreement turns prepared input off for that format for the rest of the process (one
stderr line); `dispatch.linear` then serves the call, and every later one, from the plain activations.
"""
from __future__ import annotations

import sys

import torch

from .gemv_h2_select import H2_CHECK_RTOL
from .gemv_launch import _capturing, candidates, interpreting, launch

_CHECKED: dict = {}          # (fmt, "h2" | "mma", device) -> whether its prepared launch agreed


class PreparedDisagrees(RuntimeError):
    """Raised by the prepared launcher when its check failed: the caller computes the call from plain x."""


def disagreed(fmt: str) -> bool:
    """Whether a prepared variant of `fmt` failed its check in this process."""
    return any(not ok for (f, _, _), ok in _CHECKED.items() if f == fmt)


def checkable(device: torch.device) -> bool:
    """Where the check runs: CUDA launches outside graph capture (the interpreter runs the variants' emulated
    f16 math, which the CPU tests check against the codecs)."""
    return device.type == "cuda" and not interpreting() and not _capturing()


def agrees(kernel, weights: tuple, xp: torch.Tensor, N: int, K: int, GS: int, fscale: float, cfg, fmt: str) -> bool:
    """Whether the prepared launch of `cfg` (no residual) matches the format's fp32 kernel within H2_CHECK_RTOL.
    Once per format, variant and device where `checkable`; elsewhere what is known, else True."""
    from .x16 import launch_prepared, x16_decode
    key = (fmt, "mma" if cfg.mma else "h2", xp.device)
    if key in _CHECKED or not checkable(xp.device):
        return _CHECKED.get(key, True)
    T, G = xp.shape[0], K // GS
    got = launch_prepared(kernel, weights, xp, N, K, GS, fscale, torch.empty((T, N), device=xp.device), None, cfg,
                          "linear (prepared check)")
    ref = candidates(T, N, G, GS, torch.float32, xp.device)[0]       # fp32 activations: a plain config
    want = launch(kernel, weights, x16_decode(xp, K), N, G, fscale, torch.empty_like(got), None, ref)
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    _CHECKED[key] = ok = bool(torch.isfinite(got).all()) and err <= H2_CHECK_RTOL
    if not ok:
        print(f"ninfer: the {key[1]} {fmt} GEMV on prepared activations disagrees with the fp32 kernel on this "
              f"GPU (relative L2 {err:.3g}); {fmt} linears read plain activations for the rest of this process",
              file=sys.stderr)
    return ok
