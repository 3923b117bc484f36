"""What launching a captured step costs the GPU: each CUDA graph of the real Engine, replayed onto an idle GPU
against replayed back to back, on a 27B-shaped artifact.

An engine step starts on an idle GPU: the host read back the last round's tokens, planned, and only then
launches the next step's graph. `cudaGraphLaunch` of a graph with hundreds of kernel nodes takes host time, and
the GPU has nothing to run until the launch hands the graph over. Back-to-back replays hide that time behind the
previous replay; a lone replay does not. Per graph key (kind, batch, tokens, KV bucket):

- host_us: the host time of `replay()` (the launch call) onto an idle GPU, median of --reps;
- idle_us: from an event recorded just before that launch to one just after it, on the GPU's clock (launch
  hand-over + execution), median;
- steady_us: the GPU time per replay of --reps replays queued back to back (execution only);
- exposed_us = idle_us - steady_us: what an idle-start step pays for its launch;
- nodes: the graph's node count (cudaGraphGetNodes; None where the runtime library cannot be reached).

Replays run on the runner's scratch rows (padding metadata), after the engine's warm-up generation, so no
request's KV or state is touched.

    python3 bench/graph_launch.py [--ks 0,3] [--reps 20]      # JSON: bench/results/graph_launch.json

Records: {"kind": "graph_launch", "recipe", "gpu", "draft_tokens", "graph": "target|mtp", "batch", "tokens",
"kv_bucket", "nodes", "host_us", "idle_us", "steady_us", "exposed_us"}.
"""
from __future__ import annotations

import ctypes
import os
import random
import statistics
import sys
import time
from pathlib import Path

import synth_artifact as synth
from bench_cli import ArgParser, positive_int
from engine_mtp import _engine, generate, log
from ninfer_formats.atomic import write_json_atomic
from ninfer_formats.errors import NinferError

OUT = Path(__file__).resolve().parent / "results" / "graph_launch.json"


def parse_args(argv=None):
    ap = ArgParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="nvfp4")
    ap.add_argument("--ks", default="0,3", help="draft lengths 0..7, one engine each (default 0,3)")
    ap.add_argument("--reps", type=positive_int, default=20)
    ap.add_argument("--prompt-len", type=positive_int, default=1024)
    ap.add_argument("--new-tokens", type=positive_int, default=16, help="the warm-up generation's length")
    ap.add_argument("--batch", type=positive_int, default=1)
    synth.add_engine_args(ap, OUT)
    args = ap.parse_args(argv)
    try:
        ks = tuple(sorted({int(k) for k in args.ks.split(",") if k.strip()}))
        assert ks and all(0 <= k <= 7 for k in ks)
    except (ValueError, AssertionError):
        ap.error(f"--ks: expected comma-separated integers in 0..7, got {args.ks!r}")
    args.ks = ks
    return args


def node_count(graph) -> int | None:
    """Nodes of a torch.cuda.CUDAGraph (None where torch or libcudart does not expose them)."""
    try:
        raw = graph.raw_cuda_graph()
        lib = ctypes.CDLL("libcudart.so.12")
    except (AttributeError, OSError, RuntimeError):
        return None
    n = ctypes.c_size_t(0)
    rc = lib.cudaGraphGetNodes(ctypes.c_void_p(raw), None, ctypes.byref(n))
    return int(n.value) if rc == 0 else None


def time_graph(graph, reps: int, device) -> dict:
    """host_us / idle_us / steady_us / exposed_us of one captured graph (see the module doc)."""
    import torch
    host, idle = [], []
    for _ in range(reps):
        torch.cuda.synchronize(device)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        graph.replay()
        host.append((time.perf_counter() - t0) * 1e6)
        b.record()
        torch.cuda.synchronize(device)
        idle.append(a.elapsed_time(b) * 1e3)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()                                        # the queue is busy before the first timed replay
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    torch.cuda.synchronize(device)
    steady = a.elapsed_time(b) * 1e3 / reps
    med_host, med_idle = statistics.median(host), statistics.median(idle)
    return {"host_us": med_host, "idle_us": med_idle, "steady_us": steady, "exposed_us": med_idle - steady}


def measure_engine(loaded, args, k: int, base: dict) -> list[dict]:
    eng = _engine(loaded, args, k)
    try:
        prompt = random.Random(args.seed).choices(range(min(loaded.config.vocab_size, 4096)), k=args.prompt_len)
        generate(eng, prompt, args.new_tokens, args.batch)         # compiles, tunes, captures
        runner = eng.graphs
        if runner is None or not runner.graphs:
            raise NinferError(f"K={k}: the engine captured no CUDA graphs (graphs off or eager?)")
        out = []
        for key, g in sorted(runner.graphs.items(), key=lambda kv: (kv[0][0], kv[0][1:])):
            runner._fill_padding(key)          # the replays write only the scratch rows
            rec = {**base, "draft_tokens": k, "graph": key[0], "batch": key[1], "tokens": key[2],
                   "kv_bucket": key[3], "nodes": node_count(g.graph),
                   **time_graph(g.graph, args.reps, eng.device)}
            log(f"K={k} {key}: {rec['nodes']} nodes, host {rec['host_us']:.0f} us, idle start {rec['idle_us']:.0f} "
                f"us, steady {rec['steady_us']:.0f} us, exposed {rec['exposed_us']:.0f} us")
            out.append(rec)
        return out
    finally:
        eng.shutdown()


def measure(args, path: str) -> list[dict]:
    import torch

    import bench_device as D
    from ninfer_rt.loader import load
    device = torch.device("cuda")
    args.backend = args.backend or "triton"
    loaded = load(path, device=device, dtype=torch.bfloat16)
    base = {"kind": "graph_launch", "recipe": args.recipe, "gpu": D.device_name(device),
            "pdl": os.environ.get("NINFER_PDL", "1")}
    records = []
    try:
        for k in args.ks:
            records += measure_engine(loaded, args, k, base)
            write_json_atomic(args.out, records)
    finally:
        loaded.close()
    return records


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.device != "cuda" or args.eager:
            raise NinferError("graph_launch: CUDA graphs need --device cuda without --eager")
        records = measure(args, synth.engine_artifact(args, log))
    except (NinferError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'K':>2} {'graph':<7} {'b':>2} {'T':>2} {'bucket':>7} {'nodes':>6} {'host us':>8} {'idle us':>8} "
          f"{'steady us':>9} {'exposed':>8}")
    for r in records:
        print(f"{r['draft_tokens']:>2} {r['graph']:<7} {r['batch']:>2} {r['tokens']:>2} {r['kv_bucket']:>7} "
              f"{str(r['nodes']):>6} {r['host_us']:>8.0f} {r['idle_us']:>8.0f} {r['steady_us']:>9.0f} "
              f"{r['exposed_us']:>8.0f}")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
