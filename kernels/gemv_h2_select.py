"""Choosing a packed-half2 (h2) GEMV config safely: the tuner's h2 winner must agree with the fp32 kernel."""
from __future__ import annotations

import sys

import torch

H2_CHECK_RTOL = 2e-2     # h2 vs fp32 kernels differ by f16 rounding (~1e-3); a wrong decode is O(1)
H2_STATE = {"off": False}   # "off": a check failed in this process (candidates() then skip h2)


def checked_h2(best, cands: list, log: list, run):
    """`best` (an h2 config) if its output agrees with the format's fp32 kernel on the call being tuned, else
    the fastest non-h2 candidate, and h2 is off for the rest of the process (one stderr line): the packed-
    half2 kernels were checked on an H200 (NVFP4), and this guards every other GPU and format the tuner meets."""
    ref = next((c for c in cands if not c.h2), None)
    if ref is None:
        return best
    got = run(best).float().clone()
    want = run(ref).float()
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    if bool(torch.isfinite(got).all()) and err <= H2_CHECK_RTOL:
        return best
    H2_STATE["off"] = True
    print(f"ninfer: the packed-half2 GEMV disagrees with the fp32 kernel on this GPU (relative L2 {err:.3g}); "
          f"using the fp32 kernels for the rest of this process", file=sys.stderr)
    timed = [(t, i) for i, (c, t) in enumerate(log) if not c.h2 and t is not None]
    return log[min(timed)[1]][0] if timed else ref
