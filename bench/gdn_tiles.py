"""The GDN recurrence's tiles (kernels/gdn_recurrent.py) at the 27B's GDN sizes, on the GPU (bench/NOTES.md §14).

Per T (decode T = 1 updates the slot in place; T > 1 is an MTP verify row writing T snapshot rows): the GPU time of
one launch of each tile the runtime chooses from (`gdn_recurrent.TILES`, forced one at a time), timed as the runtime
times them (inside a CUDA graph, L2 flushed: `gemv_timing.time_ms`), the tile the runtime's own first launch picks,
and the state bytes moved over the copy bandwidth measured in the same run. A decode step runs 48 such layers.

    python bench/gdn_tiles.py [--T 1 2 4 8] [--tp 1] [--out $OUT/gdn_tiles.json]
    python bench/gdn_tiles.py --smoke     # CPU + Triton interpreter, tiny heads: exercises this script only

Records: {"T", "tp", "tile", "us", "gbps", "pct_copy_bw", "picked", "runtime_us", "copy_tbps", "gpu"}.
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
from ninfer_formats.atomic import write_json_atomic  # noqa: E402
from ninfer_kernels import gdn_recurrent as gr  # noqa: E402
from ninfer_kernels import gemv_timing  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
HEADS = (2, 4, 16) if SMOKE else (16, 48, 128)     # key heads, value heads, head dim (Qwen3.8-27B, TP1)


def _case(T: int, tp: int):
    """Inputs of one sequence's T tokens and a pool of 1 + T rows (slot 0, snapshot rows 1..T)."""
    hk, hv, d = HEADS[0] // tp, HEADS[1] // tp, HEADS[2]
    g = torch.Generator(device=DEV).manual_seed(T)
    r = lambda *s: torch.randn(*s, generator=g, device=DEV)  # noqa: E731
    dt = torch.float32 if SMOKE else torch.bfloat16
    q, k, v = r(T, hk, d).to(dt), r(T, hk, d).to(dt), r(T, hv, d).to(dt)
    gates, beta = -torch.rand(T, hv, generator=g, device=DEV), torch.rand(T, hv, generator=g, device=DEV)
    pool = r(1 + T, hv, d, d) * 0.01
    cu = torch.tensor([0, T], dtype=torch.int32, device=DEV)
    slots = torch.zeros(1, dtype=torch.long, device=DEV)
    snap = torch.full((1,), 1 if T > 1 else -1, dtype=torch.long, device=DEV)
    return (q, k, v, gates, beta, pool, cu, slots, snap, pool if T > 1 else None), hv * d * d * 4 * (1 + T)


def _us(call) -> float:
    if SMOKE:
        t = time.perf_counter()
        call()
        return (time.perf_counter() - t) * 1e6
    return gemv_timing.time_ms(call) * 1e3


def measure(T: int, tp: int, copy: float, gpu: str) -> list[dict]:
    args, nbytes = _case(T, tp)
    recs = []
    for bv, w in gr.TILES:
        us = _us(lambda: gr.gdn_recurrent(*args, max_t=T, tile=(bv, w)))
        recs.append({"T": T, "tp": tp, "tile": f"{bv}x{w}", "us": round(us, 2),
                     "gbps": round(nbytes / us / 1e3, 1), "pct_copy_bw": round(100 * nbytes / us / 1e6 / copy, 1)
                     if copy else None, "copy_tbps": copy, "gpu": gpu})
    gr.gdn_recurrent(*args, max_t=T)               # the runtime's own pick, timed its way
    mine = gr.picks().get(str(min(gr.pow2(T), 16)), {"picked": "{}x{}".format(*gr.TILES[0]), "us": {}})
    for r in recs:
        r["picked"], r["runtime_us"] = mine["picked"], mine["us"]
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gdn_tiles.json"))
    a = ap.parse_args(argv)
    os.environ[gr.TILES_ENV] = "time"          # the runtime's own pick, for the "picked" column
    copy = None if SMOKE else round(D.copy_tbps(DEV, 1024), 3)
    gpu = "cpu" if SMOKE else D.device_name(DEV)
    recs = []
    print(f"{'T':>3} {'tile':>6} {'us':>8} {'GB/s':>7} {'%copy':>6}  picked")
    for T in a.T:
        for r in measure(T, a.tp, copy, gpu):
            recs.append(r)
            print(f"{r['T']:>3} {r['tile']:>6} {r['us']:>8.2f} {r['gbps']:>7.1f} {r['pct_copy_bw'] or 0:>6.1f}  "
                  f"{r['picked']}")
    write_json_atomic(a.out, recs)
    print(f"copy {copy} TB/s ({gpu}); wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
