"""Choosing a packed-half2 (h2) or warp-MMA (mma) GEMV config safely: the tuner's winner must agree with the
fp32 kernel."""
from __future__ import annotations

import sys

import torch

H2_CHECK_RTOL = 2e-2     # h2 / mma vs fp32 kernels differ by f16 rounding (~1e-3); a wrong decode is O(1)
# "off" / "mma_off": a check of that variant failed in this process (candidates() then skip it)
H2_STATE = {"off": False, "mma_off": False}


def _plain(c) -> bool:
    return not (c.h2 or c.mma)


def checked_h2(best, cands: list, log: list, run):
    """`best` (an h2 or mma config) if its output agrees with the format's fp32 kernel on the call being tuned,
    else the fastest plain candidate, and that variant is off for the rest of the process (one stderr line):
    the variants were checked on an H200 (NVFP4), and this guards every other GPU and format the tuner meets."""
    ref = next((c for c in cands if _plain(c)), None)
    if ref is None:
        return best
    got = run(best).float().clone()
    want = run(ref).float()
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    if bool(torch.isfinite(got).all()) and err <= H2_CHECK_RTOL:
        return best
    kind = "warp-MMA" if best.mma else "packed-half2"
    H2_STATE["mma_off" if best.mma else "off"] = True
    print(f"ninfer: the {kind} GEMV disagrees with the fp32 kernel on this GPU (relative L2 {err:.3g}); "
          f"using the other kernels for the rest of this process", file=sys.stderr)
    timed = [(t, i) for i, (c, t) in enumerate(log) if _plain(c) and t is not None]
    return log[min(timed)[1]][0] if timed else ref
