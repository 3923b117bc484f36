"""Runtime GEMV pins for the near ties of a re-tune, to A/B them inside the decode step (bench/NOTES.md §25).

The tuner ranks configs by standalone time; in the step, a split-K finisher's tail is not hidden, and the one
near tie measured in the step (the prepared gate/up T = 1 tile) went to the unsplit runner-up. For every
kernels.json record whose graph runoff has a finalist with fewer K splits within --tol of the fastest, this
writes a pin to the finalist with the fewest splits (ties: the faster), except for keys the shipped pins
(gemv_pins.json beside the results) already settle. Sweep it against no pins on one machine:

    python3 bench/near_ties.py bench/results/kernels.json --out /tmp/near.json
    SWEEP_VAR=NINFER_GEMV_PINS SWEEP_VALUES="0 /tmp/near.json 0 /tmp/near.json" SWEEP_PARTS=verify,profile \
        SWEEP_ARGS="--max-draft 3" bash bench/gpu_run.sh sweep

The profiles' `linear_by_shape` then gives each weight's time with and without its pin (decode: T = 1; verify
K = 1..3: T buckets 2 and 4). Winners go to bench/results/gemv_pins.json (the shipped pins) by hand, with the run.
Prints the pins as a table on stderr and {"out", "pins"} on stdout.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ninfer_formats.atomic import write_json_atomic
from ninfer_kernels.gemv_pins import PINS_NAME, PinError, load_pins, parse_config, record_key


def near_ties(records: list, tol: float, gpu: str, formats: set, ts: set, skip: set = frozenset()) -> list:
    """A pin per key (of `gpu`, `formats`, `ts`; not in `skip`) whose record's runoff holds a finalist with fewer
    splits within `tol` of the fastest. Keys measured twice (attn_o and gdn_out share a shape) get one pin."""
    pins, seen = [], set(skip)
    for r in records:
        runoff = r.get("runoff_us")
        if (not runoff or r.get("gpu") != gpu or r.get("format") not in formats or r.get("T") not in ts
                or not str(r.get("config", "")).startswith("GemvConfig(") or record_key(r) in seen):
            continue
        pick = parse_config(r["config"])
        best = min(us for _, us in runoff)
        close = [(parse_config(c).split, us, c) for c, us in runoff if us <= best * (1 + tol)]
        split, us, cfg = min(close)
        if split >= pick.split:
            continue
        seen.add(record_key(r))
        pins.append({"gpu": gpu, "format": r["format"], "name": r.get("name"), "tp": r.get("tp"),
                     "shape": r["shape"], "T": r["T"], "config": cfg, "us": us,
                     "why": f"near tie for an in-step A/B: split {split} at {us:.2f} us alone against the pick's "
                            f"split {pick.split} at {r['us']:.2f} us"})
    return pins


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="bench/results/kernels.json")
    ap.add_argument("--out", required=True, help="pins file to write (NINFER_GEMV_PINS)")
    ap.add_argument("--tol", type=float, default=0.01, help="relative standalone slack (default 0.01)")
    ap.add_argument("--gpu", default="NVIDIA H200")
    ap.add_argument("--formats", nargs="+", default=["nvfp4", "nvfp4+xpre", "q6_k", "q6_k+xpre"])
    ap.add_argument("--T", nargs="+", type=int, default=[1, 2, 4], help="T buckets (decode 1, verify K<=3 2 and 4)")
    a = ap.parse_args(argv)
    if not 0 <= a.tol < 1:
        print(f"error: --tol {a.tol}: expected 0 <= tol < 1", file=sys.stderr)
        return 2
    shipped = Path(a.results).with_name(PINS_NAME)
    try:
        skip = {record_key(p) for p in load_pins(shipped)} if shipped.exists() else set()
    except PinError as e:
        print(f"error: {shipped}: {e}", file=sys.stderr)
        return 2
    try:
        records = json.loads(Path(a.results).read_text())
        if not isinstance(records, list):
            raise TypeError("expected a list of records")
        pins = near_ties(records, a.tol, a.gpu, set(a.formats), set(a.T), skip)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        print(f"error: {a.results}: {e}", file=sys.stderr)
        return 2
    for p in pins:
        print(f"{p['format']:<11} {p.get('name') or '':<12} tp{p.get('tp')} T={p['T']}: {p['why']}", file=sys.stderr)
    try:
        write_json_atomic(a.out, pins)
    except OSError as e:
        print(f"error: {a.out}: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"out": a.out, "pins": len(pins)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
