"""Programmatic dependent launch (kernels/pdl.py) for the T = 1 NVFP4 GEMV, on the GPU (bench/NOTES.md §15).

The question before turning it on in the decode step: a graph of GEMVs over rotating weight copies, each behind
the kernel that writes its activations (the x16 prep, as the decode step's producers write them), with
NINFER_PDL 0 (off), 1 (trigger + wait) and 2 (+ the first K tile's lines into L2 before the wait). Per shape
(the shipped tuned config on prepared activations) the us per (prep + GEMV), and a 27B-layer-like mix of
shapes; every mode's graph outputs must equal the unlaunched-early (mode 0, eager) outputs bit for bit
(`max_abs_diff`: a GEMV that read its activations before the prep finished would differ).

    python bench/gemv_pdl.py [--shapes attn_qkv ...] [--out $OUT/gemv_pdl.json]
    python bench/gemv_pdl.py --smoke      # CPU + Triton interpreter (PDL is off there): exercises this script only

Records: {"name", "shapes", "T", "mode", "us", "us_off", "ratio", "max_abs_diff", "pct_copy_bw", "copy_tbps",
"gpu"} (us per prep + GEMV pair; pct_copy_bw: the weight bytes over that time and the copy bandwidth).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE:  # must precede the first ninfer_kernels import
    os.environ["TRITON_INTERPRET"] = "1"

import xpre  # noqa: E402  (bench/xpre.py: timing, copy bandwidth, shipped configs)
from ninfer_formats.atomic import write_json_atomic  # noqa: E402

DEV = xpre.DEV
SHAPES = {"attn_qkv": (14336, 5120), "gdn_qkvz": (16384, 5120), "mlp_gate_up": (34816, 5120),
          "mlp_down": (5120, 17408), "attn_o": (5120, 6144), "tiny": (96, 256), "tiny2": (64, 384)}
LAYER = ("gdn_qkvz", "attn_o", "mlp_gate_up", "mlp_down")     # a GDN layer's GEMVs (gdn_out is attn_o's shape)
MODES = ("0", "1", "2")


def build(names, copies_min: int = 2) -> list[dict]:
    """Rotating weight copies: a list of calls {name, planes, gscale, x, xp, out, cfg}, >= 240 MB of weights."""
    from ninfer_kernels import randweights
    from ninfer_kernels.gemv_nvfp4 import repack_nvfp4
    from ninfer_kernels.x16 import x16_prep
    per = sum(SHAPES[n][0] * SHAPES[n][1] * 9 // 16 for n in names)
    reps = 1 if SMOKE else int(min(16, max(copies_min, math.ceil(xpre.ROTATE_BYTES / per))))
    calls = []
    for i in range(reps):
        for n in names:
            N, K = SHAPES[n]
            w = randweights.make("nvfp4", N, K, device=DEV, seed=i)
            cfg = xpre.shipped_config(N, K, 1, "nvfp4" if SMOKE else "nvfp4+xpre")
            x = torch.randn(1, K, device=DEV).to(torch.float32 if SMOKE else torch.bfloat16)
            calls.append({"name": n, "planes": repack_nvfp4(w["codes"], w["scales"]), "gscale": w["gscale"], "x": x,
                          "xp": x16_prep(x), "out": torch.empty(1, N, device=DEV, dtype=x.dtype), "cfg": cfg,
                          "bytes": N * K * 9 // 16})
    return calls


def step(c) -> None:
    from ninfer_kernels.gemv_nvfp4 import gemv_nvfp4_prepared
    from ninfer_kernels.x16 import x16_prep
    x16_prep(c["x"], c["xp"])
    gemv_nvfp4_prepared(c["xp"], c["planes"], c["gscale"], c["out"], config=c["cfg"])


def run_modes(label: str, names, copy: float, gpu: str) -> list[dict]:
    calls = build(names)
    for c in calls:                       # the reference: mode 0, eager
        c["x"].normal_()
    os.environ["NINFER_PDL"] = "0"
    for c in calls:
        step(c)
    want = [c["out"].clone() for c in calls]
    recs, base = [], None
    for mode in MODES:
        os.environ["NINFER_PDL"] = mode
        for c in calls:
            c["out"].fill_(float("nan"))
        us = xpre.graph_us([lambda c=c: step(c) for c in calls])   # graph_us replays; outputs: the last replay
        diff = max(float((c["out"].float() - w.float()).abs().max()) for c, w in zip(calls, want))
        base = us if mode == "0" else base
        nbytes = sum(c["bytes"] for c in calls) / len(calls)
        rec = {"name": label, "shapes": list(names), "T": 1, "mode": int(mode), "us": round(us, 2),
               "us_off": round(base, 2), "ratio": round(us / base, 4), "max_abs_diff": diff,
               "pct_copy_bw": round(100 * nbytes / (us * 1e-6) / (copy * 1e12), 1), "copy_tbps": round(copy, 3),
               "gpu": gpu}
        xpre.log(f"{label} PDL={mode}: {us:.2f} us per prep + GEMV ({rec['ratio']:.3f}x off), max diff {diff}")
        recs.append(rec)
    os.environ["NINFER_PDL"] = "0"
    return recs


def table(recs: list[dict]) -> str:
    lines = [f"{'sequence':<14}{'PDL':>4}{'us':>9}{'ratio':>8}{'%bw':>7}{'diff':>8}"]
    for r in recs:
        lines.append(f"{r['name']:<14}{r['mode']:>4}{r['us']:>9.2f}{r['ratio']:>8.3f}{r['pct_copy_bw']:>7.1f}"
                     f"{r['max_abs_diff']:>8.1g}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=None, choices=sorted(SHAPES))
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if not SMOKE and not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)):
        print("error: bench/gemv_pdl.py needs a CUDA device of compute capability 9.0+ (or --smoke)", file=sys.stderr)
        return 2
    shapes = args.shapes or (["tiny"] if SMOKE else [s for s in SHAPES if not s.startswith("tiny")])
    copy = xpre.copy_tbps()
    gpu = "cpu (interpreter)" if SMOKE else torch.cuda.get_device_name()
    seqs = [(s, (s,)) for s in shapes] + [("layer", ("tiny", "tiny2") if SMOKE else LAYER)]
    recs = []
    for label, names in seqs:
        recs += run_modes(label, names, copy, gpu)
        if args.out:                      # after every sequence: a timeout keeps what was measured
            write_json_atomic(args.out, recs)
    print(f"copy {copy:.2f} TB/s, {gpu}")
    print(table(recs))
    bad = [r for r in recs if r["max_abs_diff"] != 0.0]
    if bad:
        print(f"error: {len(bad)} sequence(s) differ from the eager PDL-off outputs", file=sys.stderr)
    return 1 if bad or not recs else 0


if __name__ == "__main__":
    sys.exit(main())
