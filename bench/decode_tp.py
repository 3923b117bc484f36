"""Tensor-parallel measurements of bench/decode.py, rank side (every rank calls them in the same order; they
are collectives): the collectives of one decode step, the per-call time of each all-reduce implementation at
the step's message sizes, and per-rank memory.

All-reduce implementations: the one the runtime picks for the message inside a CUDA graph (peer memory,
ninfer_rt/allreduce.py's crossover table: one_shot for a 10 KiB decode row on 2 GPUs) and the process group's
own all-reduce (NCCL, gloo on CPU), each timed as bench/allreduce.py does: GRAPH_CALLS dependent calls captured
in one CUDA graph, replayed REPS times, median per call (CPU / eager runs: host-timed back-to-back calls).
"""
from __future__ import annotations

import statistics
import time

import torch

GRAPH_CALLS = 128
EAGER_CALLS = 32
REPS = 10
GIB = float(1 << 30)


class CollectiveCounter:
    """Counts the group's all-reduce messages by (shape, dtype) and its all-gathers while active (wraps the
    bound methods on the instance; the model looks them up per call)."""

    NAMES = ("all_reduce", "all_gather_last")

    def __init__(self, group):
        self.group, self.messages, self.gathers = group, {}, 0
        self._saved = {}

    def __enter__(self):
        g, inner_ar, inner_ag = self.group, self.group.all_reduce, self.group.all_gather_last
        self._saved = {n: vars(g)[n] for n in self.NAMES if n in vars(g)}

        def all_reduce(x):
            key = (tuple(x.shape), x.dtype)
            self.messages[key] = self.messages.get(key, 0) + 1
            return inner_ar(x)

        def all_gather_last(x):
            self.gathers += 1
            return inner_ag(x)
        g.all_reduce, g.all_gather_last = all_reduce, all_gather_last
        return self

    def __exit__(self, *exc):
        for name in self.NAMES:
            vars(self.group).pop(name, None)
        vars(self.group).update(self._saved)


def count_collectives(group, step) -> CollectiveCounter:
    """The collectives `step()` makes (a decode step run eagerly: the graph bodies without capture)."""
    with CollectiveCounter(group) as c:
        step()
    if group.device.type == "cuda":
        torch.cuda.synchronize(group.device)
    return c


def pg_name() -> str:
    import torch.distributed as dist
    return dist.get_backend()


def routed_impl(group, shape, dtype, graph: bool) -> str:
    """What DistGroup.all_reduce runs for this message: a peer-memory kernel or the process group (as pick()
    decides inside a CUDA graph capture when `graph`, else for an eager call), without needing a capture."""
    from ninfer_rt import allreduce as ar
    p2p = group.p2p
    wd = ar.wire_dtype(dtype, group.size)
    if p2p is None or wd is None or (not graph and not p2p.eager):
        return pg_name()
    n = 1
    for d in shape:
        n *= d
    impl = ar.choose(n * torch.empty((), dtype=wd).element_size(), p2p.rows, p2p.capacity)
    return pg_name() if impl == "nccl" else impl


def _impl_fn(group, impl: str):
    if impl == pg_name():
        return group.nccl_all_reduce
    return lambda v: group.p2p.run(v, impl)


def _barrier(group) -> None:
    if group.device.type == "cuda":
        torch.cuda.synchronize(group.device)
    group.all_gather_object(None)


def time_eager(fn, x, group, calls: int = EAGER_CALLS, reps: int = REPS) -> float:
    """Microseconds per call of back-to-back calls, host-timed, median over reps (both ranks start together)."""
    fn(x)
    out = []
    for _ in range(reps):
        _barrier(group)
        t = time.perf_counter()
        for _ in range(calls):
            fn(x)
        if group.device.type == "cuda":
            torch.cuda.synchronize(group.device)
        out.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(out)


def time_call(group, impl: str, shape, dtype, graph: bool) -> float:
    x = torch.zeros(shape, dtype=dtype, device=group.device)
    fn = _impl_fn(group, impl)
    if graph:
        import allreduce as ar_bench  # bench/allreduce.py: the same timing as the all-reduce benchmark
        return ar_bench.time_graph(fn, x, GRAPH_CALLS, REPS, group)
    return time_eager(fn, x, group)


def allreduce_costs(group, step, graph: bool) -> dict:
    """Decode-step all-reduce count and per-implementation cost (microseconds per call and per step). Keys of
    the per-implementation dicts: the runtime's choice (inside graphs when `graph`; e.g. "one_shot") and the
    process group's ("nccl" / "gloo"); messages routed to different kernels join their names with '+'."""
    counter = count_collectives(group, step)
    pg = pg_name()
    auto = {key: routed_impl(group, *key, graph) for key in counter.messages}
    auto_name = "+".join(sorted(set(auto.values()))) or pg
    routes = {auto_name: auto, pg: {key: pg for key in auto}}     # one entry when they are the same path
    messages, us_by_key = [], {}
    for key, n in sorted(counter.messages.items(), key=lambda kv: -kv[1]):
        shape, dtype = key
        us = {impl: time_call(group, impl, shape, dtype, graph) for impl in dict.fromkeys((auto[key], pg))}
        us_by_key[key] = us
        messages.append({"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "count": n,
                         "bytes": torch.empty(shape, dtype=dtype, device="meta").nbytes, "us_per_call": us})
    per_step = {name: sum(n * us_by_key[key][route[key]] for key, n in counter.messages.items())
                for name, route in routes.items()}
    top = messages[0]["us_per_call"] if messages else {}
    return {"allreduce": auto_name, "allreduce_calls_per_step": sum(counter.messages.values()),
            "allgathers_per_step": counter.gathers, "allreduce_messages": messages,
            "allreduce_us_per_call": dict(top), "allreduce_us_per_step": per_step,
            "allreduce_timing": (f"cuda graph of {GRAPH_CALLS} chained calls, median of {REPS} replays" if graph
                                 else f"host-timed {EAGER_CALLS} calls, median of {REPS}")}


def memory_gib(group, device) -> dict:
    """Per-rank memory in GiB, lists in rank order: torch's peak and current allocations, its reserved pool
    and the device's used memory (mem_get_info: NCCL, peer-memory buffers and the CUDA context included);
    on CPU the process's peak resident set."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        mine = {"max_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
                "allocated_gib": torch.cuda.memory_allocated(device) / GIB,
                "reserved_gib": torch.cuda.memory_reserved(device) / GIB, "device_used_gib": (total - free) / GIB}
    else:
        import resource
        mine = {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}   # KiB on Linux
    every = group.all_gather_object(mine) if group.size > 1 else [mine]
    return {k: [round(m[k], 3) for m in every] for k in mine}


def step_share(rec: dict, ar: dict) -> dict:
    """The all-reduce fields of a decode record whose step ran with implementation rec["allreduce"]."""
    us = ar["allreduce_us_per_step"].get(rec["allreduce"])
    return {"allreduce_pct_step": None if us is None else 100 * us / 1e3 / rec["ms_step"]}
