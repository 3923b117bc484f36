"""All-reduce latency on 2 GPUs: NCCL vs the peer-memory kernels of ninfer_rt/allreduce.py, eager and in CUDA graphs.

    python3 bench/allreduce.py [--sizes 2K,4K,...,4M] [--graph-calls 128] [--eager-calls 200] [--reps 15]
                               [--results DIR] [--json]

Two ranks are spawned by ninfer_rt.tp.launch (the runtime's own launcher, so the group, its startup checks and
its environment are the runtime's). Per bf16 message size (10 KiB = one 5120-wide row, a decode all-reduce):
  nccl       dist.all_reduce of the bf16 message (DistGroup's NCCL path for 2 ranks)
  nccl_fp32  widen to fp32, dist.all_reduce, narrow (DistGroup's path before the peer-memory work)
  one_shot   symm_mem one-shot all-reduce over the peer-memory buffer (local copy fused in)
  two_shot   symm_mem two-shot (reduce-scatter + all-gather through peer memory)
  auto       DistGroup.all_reduce, i.e. what the model gets (crossover table, startup verification)
  floor      one local elementwise kernel over the message: the least any one-kernel step costs here
eager: per-call time of back-to-back calls, host launch included; graph: --graph-calls dependent calls captured
in one CUDA graph and replayed, per-call time. Medians over --reps. Every fast path's result is compared with
NCCL's bit for bit ("exact"). Writes {"impl", "bytes", "mode", "us", "gpu", ...} records to
<results>/allreduce.json, prints a table and the crossover table allreduce.py should carry for this machine.
Goal: one_shot <= 6 us per 10 KiB all-reduce in a CUDA graph.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from ninfer_formats.atomic import write_json_atomic  # noqa: E402
from ninfer_kernels.gemv_timing import replay_ms  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GOAL_US = 6.0
DECODE_BYTES = 10 * 1024
DEFAULT_SIZES = "2K,4K,8K,10K,16K,32K,64K,128K,256K,512K,1M,2M,4M"
IMPLS = ("nccl", "nccl_fp32", "one_shot", "two_shot", "auto", "floor")
MODES = ("eager", "graph")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_sizes(text: str) -> tuple[int, ...]:
    mult = {"K": 1024, "M": 1024 ** 2}
    out = []
    for part in text.split(","):
        p = part.strip().upper()
        try:
            n = int(p[:-1]) * mult[p[-1]] if p and p[-1] in mult else int(p)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--sizes: {part!r} is not a size like 10K, 2M or 4096") from None
        if n <= 0 or n % 16:
            raise argparse.ArgumentTypeError(f"--sizes: {part!r} must be a positive multiple of 16 bytes")
        out.append(n)
    return tuple(sorted(set(out)))


# ---- per rank ----
def _bench_p2p(group, top: int):
    """A peer-memory instance sized for the largest message, both kernels, verified like the runtime's."""
    from ninfer_rt import allreduce as ar
    p2p, err = None, ar._guard(ar.local_problem, group)
    err = ar._agreed(group, err)
    if err is None:
        impls = [i for i, op in (("one_shot", "one_shot_all_reduce"), ("two_shot", "two_shot_all_reduce_out"))
                 if hasattr(torch.ops.symm_mem, op)]
        try:
            p2p = ar.P2PAllReduce.create(group, tuple((top, i) for i in impls))
        except Exception as e:             # noqa: BLE001 - reported; NCCL is still measured
            err = ar._one_line(e)
        err = ar._agreed(group, err)
    if err is None:
        err = ar._agreed(group, ar._guard(ar.verify, p2p, group))
    return (p2p, None) if err is None else (None, err)


def _impl_fns(group, p2p) -> dict:
    import torch.distributed as dist

    def nccl(v):
        dist.all_reduce(v)
        return v

    def nccl_fp32(v):
        y = v.float()
        dist.all_reduce(y)
        return y.to(v.dtype)

    fns = {"nccl": nccl, "nccl_fp32": nccl_fp32, "auto": group.all_reduce, "floor": torch.neg}
    for impl in (p2p.impls if p2p is not None else ()):
        fns[impl] = lambda v, impl=impl: p2p.run(v, impl)
    return fns


def _sync(group) -> None:
    torch.cuda.synchronize(group.device)
    group.all_gather_object(None)          # host barrier on the control plane: both ranks start together


def time_eager(fn, x, calls: int, reps: int, group) -> float:
    for _ in range(5):
        fn(x)
    _sync(group)
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn(x)
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1000.0 / calls)
    return statistics.median(out)


def time_graph(fn, x, calls: int, reps: int, group) -> float:
    def chain(v):
        for _ in range(calls):
            v = fn(v)
        return v

    static = x.clone()
    side = torch.cuda.Stream(group.device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(static)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        chain(static)
    g.replay()
    _sync(group)
    us = replay_ms(g, reps) * 1000.0 / calls
    del g
    return us


def _measure(group, fn, impl: str, x, want, opts: dict, base: dict) -> list[dict]:
    """Both modes of one implementation at one size. A failure (e.g. a capture the build refuses) is recorded
    and agreed over the control plane, so both ranks go on with the same sequence."""
    from ninfer_rt.allreduce import _agreed, _one_line
    out = []
    try:
        exact = bool(torch.equal(fn(x.clone()), want)) if impl != "floor" else None
    except Exception as e:              # noqa: BLE001 - recorded in the results
        exact, err = None, _agreed(group, _one_line(e))
    else:
        err = _agreed(group, None)
    for mode in MODES:
        calls = opts["eager_calls"] if mode == "eager" else opts["graph_calls"]
        us = None
        if err is None:
            try:
                us = (time_eager if mode == "eager" else time_graph)(fn, x.clone(), calls, opts["reps"], group)
            except Exception as e:      # noqa: BLE001 - recorded in the results
                err = _one_line(e)
            err = _agreed(group, err)
        rec = {**base, "impl": impl, "mode": mode, "us": None if us is None else round(us, 3), "exact": exact,
               "calls": calls}
        if err:
            rec["error"] = err
            log(f"allreduce bench: {impl} {mode} {base['bytes']} B failed: {err}")
        out.append(rec)
    return out


def rank_main(group, opts: dict):
    """Every rank runs the same sequence of collectives; rank 0 returns the records."""
    torch.cuda.set_device(group.device)
    p2p, why = _bench_p2p(group, max(opts["sizes"]))
    fns = _impl_fns(group, p2p)
    gpu = torch.cuda.get_device_name(group.device)
    base = {"gpu": gpu, "world": group.size, "dtype": "bfloat16"}
    records = []
    for nbytes in opts["sizes"]:
        g = torch.Generator().manual_seed(nbytes * 7 + group.rank)
        x = (torch.randn(nbytes // 2, generator=g) * (group.rank + 1)).to(torch.bfloat16).to(group.device)
        want = fns["nccl"](x.clone())
        for impl in IMPLS:
            if impl in fns:
                records += _measure(group, fns[impl], impl, x, want, opts, {**base, "bytes": nbytes})
        if group.rank == 0:
            log(f"allreduce bench: {nbytes} B done")
    setup = "peer memory off: " + why if p2p is None else "peer memory on: " + "/".join(p2p.impls)
    del fns, p2p               # the bench buffer goes before the process group it was exchanged over
    routed = "off" if group.p2p is None else ("eager+graph" if group.p2p.eager else "graph only")
    return {"records": records, "bench_p2p": setup, "runtime_p2p": routed} if group.rank == 0 else None


# ---- report ----
def lookup(records, impl, nbytes, mode):
    for r in records:
        if (r["impl"], r["bytes"], r["mode"]) == (impl, nbytes, mode):
            return r["us"]
    return None


def suggest_crossover(records, sizes) -> list[list]:
    """[(largest size, impl), ...] from the graph timings: the fastest of nccl / one_shot / two_shot per size,
    runs of the same winner merged; sizes past the last peer-memory winner go to NCCL."""
    best = []
    for n in sizes:
        cands = [(lookup(records, i, n, "graph"), i) for i in ("one_shot", "two_shot", "nccl")]
        cands = [c for c in cands if c[0] is not None]
        best.append(min(cands)[1] if cands else "nccl")
    while best and best[-1] == "nccl":
        best.pop()
    rows = []
    for n, impl in zip(sizes, best):
        impl = "one_shot" if impl == "nccl" else impl      # a lone NCCL win inside the range: keep one table row
        if rows and rows[-1][1] == impl:
            rows[-1][0] = n
        else:
            rows.append([n, impl])
    return rows


def table(records, sizes) -> str:
    cols = [(i, m) for i in IMPLS for m in MODES]
    head = f"{'bytes':>9} " + " ".join(f"{i[:9] + '/' + m[0]:>12}" for i, m in cols) + f" {'nccl/1shot g':>13}"
    lines = [head]
    for n in sizes:
        vals = [lookup(records, i, n, m) for i, m in cols]
        g_n, g_1 = lookup(records, "nccl", n, "graph"), lookup(records, "one_shot", n, "graph")
        ratio = f"{g_n / g_1:13.2f}" if g_n and g_1 else f"{'-':>13}"
        lines.append(f"{n:>9} " + " ".join(f"{v:12.2f}" if v is not None else f"{'-':>12}" for v in vals) + " "
                     + ratio)
    return "\n".join(lines)


def summarize(result: dict, sizes) -> dict:
    recs = result["records"]
    one = lookup(recs, "one_shot", DECODE_BYTES, "graph")
    return {"bench": "allreduce", "goal_us_10KiB_graph": GOAL_US, "one_shot_10KiB_graph_us": one,
            "nccl_10KiB_graph_us": lookup(recs, "nccl", DECODE_BYTES, "graph"),
            "floor_10KiB_graph_us": lookup(recs, "floor", DECODE_BYTES, "graph"),
            "meets_goal": one is not None and one <= GOAL_US,
            "all_exact": all(r["exact"] is not False for r in recs),
            "suggested_crossover": suggest_crossover(recs, sizes), "bench_p2p": result["bench_p2p"],
            "runtime_p2p": result["runtime_p2p"], "torch": torch.__version__, "records": recs}


write_json = write_json_atomic


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES))
    ap.add_argument("--graph-calls", type=int, default=128)
    ap.add_argument("--eager-calls", type=int, default=200)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder for allreduce.json")
    ap.add_argument("--json", action="store_true", help="print the JSON summary instead of the table")
    args = ap.parse_args(argv)
    if min(args.graph_calls, args.eager_calls, args.reps) <= 0:
        print("error: --graph-calls, --eager-calls and --reps must be positive", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print(f"error: needs 2 GPUs, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    from ninfer_formats.errors import NinferError

    from ninfer_rt import tp
    opts = {"sizes": args.sizes, "graph_calls": args.graph_calls, "eager_calls": args.eager_calls,
            "reps": args.reps}
    try:
        with tp.launch(2, rank_main, (opts,), device="cuda") as lch:
            result = rank_main(lch.group, opts)
    except NinferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = summarize(result, args.sizes)
    write_json(args.results / "allreduce.json", summary)
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "records"}, indent=1))
        return 0
    print(table(summary["records"], args.sizes))
    one, nccl, floor = (summary[k] for k in ("one_shot_10KiB_graph_us", "nccl_10KiB_graph_us",
                                             "floor_10KiB_graph_us"))
    if one is not None and nccl and floor:
        print(f"10 KiB in a graph: one_shot {one:.2f} us, NCCL {nccl:.2f} us ({nccl / one:.1f}x), one-kernel floor "
              f"{floor:.2f} us ({one / floor:.1f}x floor); goal <= {GOAL_US} us: "
              f"{'met' if summary['meets_goal'] else 'MISSED'}")
    elif one is not None:
        print(f"10 KiB in a graph: one_shot {one:.2f} us (NCCL or floor not measured: see the records' errors)")
    else:
        print(f"peer-memory path unavailable: {summary['bench_p2p']}")
    print(f"runtime path: {summary['runtime_p2p']}; all fast results bit-equal to NCCL: {summary['all_exact']}")
    rows = ", ".join(f"({b}, {i!r})" for b, i in summary["suggested_crossover"])
    print(f"suggested allreduce.CROSSOVER[2] = ({rows}{',' if len(summary['suggested_crossover']) == 1 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
