"""A driver for Nsight Compute: one 27B-shaped NVFP4 GEMV at T = 1 (or `--T`) on prepared activations, with the
shipped tuned config (kernels/gemv_tuned.json), launched `--calls` times (bench/NOTES.md §15: is the T = 1 loop
bound by instruction issue or by memory latency? §22: where does the warp-MMA T = 4 loop lose to it?). Nothing is
timed here; ncu reads the counters:

    ncu --clock-control none --kernel-name regex:"nvfp4_(h2|mma)" --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section Occupancy \\
        --csv --page details python3 bench/ncu_gemv.py --shape attn_qkv [--T 4]
    python bench/ncu_gemv.py --smoke      # CPU + Triton interpreter, a tiny shape: exercises this script only
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE:  # must precede the first ninfer_kernels import
    os.environ["TRITON_INTERPRET"] = "1"

import xpre  # noqa: E402  (bench/xpre.py: shapes and the shipped configs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="tiny" if SMOKE else "attn_qkv", choices=sorted(xpre.SHAPES))
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--T", type=int, default=1, help="activation rows (1..8: the shipped h2 or warp-MMA tile)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if not SMOKE and not torch.cuda.is_available():
        print("error: bench/ncu_gemv.py needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    from ninfer_kernels import randweights
    from ninfer_kernels.gemv_nvfp4 import gemv_nvfp4_prepared, repack_nvfp4
    from ninfer_kernels.x16 import x16_prep
    _, N, K = xpre.SHAPES[args.shape]
    if not 1 <= args.T <= 8:
        print(f"error: --T {args.T}: the prepared GEMVs take 1..8 rows here", file=sys.stderr)
        return 2
    cfg = xpre.shipped_config(N, K, args.T, "nvfp4" if SMOKE else "nvfp4+xpre")
    if cfg is None or not (cfg.h2 or cfg.mma):
        print(f"error: no shipped packed-half2 / warp-MMA config for {args.shape} (T = {args.T}) on this GPU",
              file=sys.stderr)
        return 1
    w = randweights.make("nvfp4", N, K, device=xpre.DEV, seed=0)
    planes = repack_nvfp4(w["codes"], w["scales"])
    x = torch.randn(args.T, K, device=xpre.DEV).to(torch.float32 if SMOKE else torch.bfloat16)
    xp, out = x16_prep(x), torch.empty(args.T, N, device=xpre.DEV, dtype=x.dtype)
    for _ in range(args.calls):
        gemv_nvfp4_prepared(xp, planes, w["gscale"], out, config=cfg)
    if xpre.DEV == "cuda":
        torch.cuda.synchronize()
    print(f"{args.shape} [{N}, {K}] T={args.T} {cfg}: {args.calls} calls, out finite {bool(torch.isfinite(out).all())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
