"""RMSNorm warps per row program (NINFER_NORM_WARPS) and the gain's load before the PDL wait (NINFER_PDL_PRELOAD)
on the decode step's rows (bench/NOTES.md §20, §21).

A chain of `add_rmsnorm` calls on one 5120-wide row (T = 1, residual add, prepared output: the decode step's form),
captured in one CUDA graph and launched as the runtime launches them (PDL where the device has it), per warps
setting. The floor is a chain of as many empty PDL kernels, captured the same way in the same run: what a launch in
the graph costs with no work in it. The gain here stays in L2 across the chain (in the decode step ~15 GB of
weights pass between two uses of a gain), so the preload's gain on this bench is a lower bound.

    python bench/norm_warps.py [--warps auto 4 8 16 32] [--preload 1 0] [--n 128] [--out bench/results/norm_warps.json]
    python bench/norm_warps.py --smoke     # CPU + Triton interpreter, one call each: exercises this script only

Records: {"warps", "preload", "us_per_norm", "floor_us", "over_floor_us", "D", "T", "pdl", "gpu"}.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE:  # must precede the first ninfer_kernels import
    os.environ["TRITON_INTERPRET"] = "1"

import bench_device as D  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from ninfer_formats.atomic import write_json_atomic  # noqa: E402
from ninfer_kernels import gemv_timing, rmsnorm  # noqa: E402
from ninfer_kernels.pdl import PRELOAD_ENV, pdl_enter, pdl_kw  # noqa: E402
from ninfer_kernels.x16 import empty_prepared  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
WIDTH = 5120          # Qwen3.8-27B hidden size


@triton.jit
def _nop_kernel(p, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    tl.store(p + tl.program_id(0), 1.0)


def _norm_call():
    g = torch.Generator(device=DEV).manual_seed(0)
    dt = torch.float32 if SMOKE else torch.bfloat16
    x, r = (torch.randn(1, WIDTH, generator=g, device=DEV).to(dt) for _ in range(2))
    w = torch.randn(WIDTH, generator=g, device=DEV) * 0.1
    xp = empty_prepared(1, WIDTH, DEV)
    return lambda: rmsnorm.add_rmsnorm(x, r, w, 1e-6, True, xp=xp)


def _nop_call():
    p = torch.zeros(1, device=DEV)
    return lambda: _nop_kernel[(1,)](p, num_warps=8, **pdl_kw(torch.device(DEV)))


def _us_per_call(call, n: int) -> float:
    if SMOKE:
        t = time.perf_counter()
        call()
        return (time.perf_counter() - t) * 1e6
    return D.graph_us([call] * n, gemv_timing.time_ms)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warps", nargs="+", default=["auto", "4", "8", "16", "32"])
    ap.add_argument("--preload", nargs="+", default=["1", "0"], choices=["1", "0"])
    ap.add_argument("--n", type=int, default=128, help="norms per captured chain (a decode step runs ~130)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "norm_warps.json"))
    a = ap.parse_args(argv)
    if not SMOKE and not torch.cuda.is_available():
        print("error: bench/norm_warps.py needs a CUDA device (--smoke runs it on the CPU interpreter)", file=sys.stderr)
        return 2
    gpu = "cpu" if SMOKE else D.device_name(DEV)
    pdl = bool(pdl_kw(torch.device(DEV)))
    floor = _us_per_call(_nop_call(), a.n)
    recs = []
    print(f"{'warps':>6} {'preload':>7} {'us/norm':>8} {'floor':>6} {'over':>6}")
    for pre in a.preload:
        os.environ[PRELOAD_ENV] = pre
        for wv in a.warps:
            os.environ[rmsnorm.NORM_WARPS_ENV] = wv
            us = _us_per_call(_norm_call(), a.n)
            recs.append({"warps": wv, "preload": int(pre), "us_per_norm": round(us, 3), "floor_us": round(floor, 3),
                         "over_floor_us": round(us - floor, 3), "D": WIDTH, "T": 1, "pdl": pdl, "gpu": gpu})
            print(f"{wv:>6} {pre:>7} {us:>8.3f} {floor:>6.3f} {us - floor:>6.3f}")
    write_json_atomic(a.out, recs)
    print(f"{a.n} calls per graph, PDL {'on' if pdl else 'off'} ({gpu}); wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
