"""Codec throughput on one CPU core: million weights per second to encode (quantize) and decode each format.

Ceiling, measured in the same run: a numpy memcpy of the same float32 matrix (weights/s it can move).
Targets (task brief): NVFP4 quantize >= 6 M w/s, Q6_K quantize >= 3 M w/s. IQ3_S runs on fewer rows
because its reference quantizer is two orders of magnitude slower.

    python bench/codecs.py [--rows 4096 --cols 4096 --iq3-rows 32 --repeat 3 --json]

Prints a table (or JSON with --json) and writes bench/results/codecs.json.
"""
from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from ninfer_formats import codecs  # noqa: E402
from ninfer_formats.errors import NinferError  # noqa: E402
from ninfer_formats.atomic import write_json_atomic  # noqa: E402

TARGETS = {("nvfp4", "quantize"): 6.0, ("q6_k", "quantize"): 3.0}
OUT = Path(__file__).resolve().parent / "results" / "codecs.json"


def _pin_one_core() -> int:
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return cpu


def _best_time(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def _rel_rmse(a, b) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def memcpy_rate(w: np.ndarray, repeat: int) -> float:
    dst = np.empty_like(w)
    secs, _ = _best_time(lambda: np.copyto(dst, w), repeat)
    return w.size / secs / 1e6


def bench_format(fmt: str, w: np.ndarray, repeat: int, ceiling: float) -> list[dict]:
    if fmt == "iq3_s":
        codecs.encode(fmt, w[:1, :256])         # one-time table build is not throughput
    t_enc, enc = _best_time(lambda: codecs.encode(fmt, w), repeat)
    t_dec, dec = _best_time(lambda: codecs.decode(fmt, enc, w.shape), repeat)
    err = _rel_rmse(dec, w)
    recs = []
    for direction, secs in (("quantize", t_enc), ("dequantize", t_dec)):
        rate = w.size / secs / 1e6
        target = TARGETS.get((fmt, direction))
        recs.append({"format": fmt, "direction": direction, "mweights_per_s": round(rate, 3),
                     "rel_rmse": round(err, 6), "threads": 1, "shape": list(w.shape),
                     "seconds": round(secs, 4), "ceiling_ratio": round(rate / ceiling, 4),
                     "target_mweights_per_s": target, "meets_target": None if target is None else rate >= target})
    return recs


def run(rows: int, cols: int, iq3_rows: int, repeat: int) -> dict:
    cpu = _pin_one_core()
    w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    ceiling = memcpy_rate(w, max(repeat, 3))
    print(f"pinned to cpu {cpu}; memcpy ceiling {ceiling:.0f} M weights/s", file=sys.stderr)
    records = []
    for fmt in ("nvfp4", "q6_k", "f8_e4m3_row", "bf16", "iq3_s"):
        m = w[:iq3_rows] if fmt == "iq3_s" else w
        try:
            records += bench_format(fmt, m, 1 if fmt == "iq3_s" else repeat, ceiling)
        except NinferError as e:   # iq3_s may be unavailable; say so instead of dropping it silently
            print(f"skipping {fmt}: {e}", file=sys.stderr)
        print(f"done {fmt}", file=sys.stderr)
    return {"bench": "codecs", "cpu": cpu, "ceiling": {"what": "numpy memcpy of the float32 matrix",
            "mweights_per_s": round(ceiling, 1)}, "records": records}


def table(result: dict) -> str:
    lines = [f"{'format':<12} {'direction':<10} {'M w/s':>9} {'x memcpy':>9} {'rel_rmse':>9} "
             f"{'shape':>11} {'target':>7}"]
    for r in result["records"]:
        tgt = "" if r["target_mweights_per_s"] is None else (
            f"{'ok' if r['meets_target'] else 'MISS'} {r['target_mweights_per_s']:g}")
        lines.append(f"{r['format']:<12} {r['direction']:<10} {r['mweights_per_s']:>9.2f} "
                     f"{r['ceiling_ratio']:>9.4f} {r['rel_rmse']:>9.5f} {'x'.join(map(str, r['shape'])):>11} {tgt:>7}")
    lines.append(f"ceiling: {result['ceiling']['what']}: {result['ceiling']['mweights_per_s']:.0f} M w/s, 1 core")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="codec throughput on one core")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--iq3-rows", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    if a.cols % 256 or a.rows < 1 or not 1 <= a.iq3_rows <= a.rows or a.repeat < 1:
        print("error: --cols must be a multiple of 256, 1 <= --iq3-rows <= --rows, --repeat >= 1", file=sys.stderr)
        return 2
    result = run(a.rows, a.cols, a.iq3_rows, a.repeat)
    write_json_atomic(a.out, result)
    print(json.dumps(result, indent=1) if a.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
