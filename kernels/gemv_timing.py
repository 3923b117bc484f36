"""Timing a GPU launch the way the GEMV tuner and the prefill-path choice need it."""
from __future__ import annotations

import sys

import torch

_FLUSH: dict = {}
_GRAPH_FAILED: set = set()


def _flush_fn(dev: int):
    """A read of twice the L2 size (not triton's 256 MB: the tuner runs inside a serving process). A read, not
    a fill: a fill leaves the L2 full of dirty lines whose write-back then competes with the timed kernel's
    reads, which the decode step (a stream of clean weight reads) never sees."""
    if dev not in _FLUSH:
        l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 64 << 20) or (64 << 20)
        buf = torch.ones(2 * l2 // 4, dtype=torch.float32, device="cuda")
        _FLUSH[dev] = (buf, torch.empty((), dtype=torch.float32, device="cuda"))
    buf, sink = _FLUSH[dev]
    return lambda: torch.sum(buf, dim=0, out=sink)


def _eager_ms(fn, flush, reps: int) -> float:
    sleep = getattr(torch.cuda, "_sleep", None)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        if sleep is not None:
            sleep(600_000)  # ~0.3-0.4 ms of GPU clocks: longer than enqueuing flush + fn on a slow host
        flush()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in events)[reps // 2]


def replay_ms(g, reps: int) -> float:
    """Median ms of one replay of CUDA graph `g` over `reps` replays."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[reps // 2]


def _graph_ms(fn, flush, reps: int, calls: int = 8) -> float:
    """ms per call inside a CUDA graph, as the decode step runs it: a graph of `calls` x (flush, fn) minus a
    graph of the flushes alone (an event cannot time one node of a graph). Kernel-boundary costs differ from
    eager launches enough to reorder candidates (bench/NOTES.md §5)."""
    graphs = []
    for with_fn in (True, False):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                flush()
                if with_fn:
                    fn()
        graphs.append(g)
    both, alone = (replay_ms(g, reps) for g in graphs)
    return max(both - alone, 1e-4) / calls


def time_ms(fn, reps: int = 12, graph: bool = True) -> float:
    """Median ms of fn() on the GPU with the L2 flushed before each run; graph=True times it inside a CUDA
    graph (the decode step's setting; fn must be capturable and not allocate), else with events around eager
    launches behind a GPU-side sleep that keeps the host's launch cost out. Falls back to eager, with one log
    line, on a device where capture fails."""
    dev = torch.cuda.current_device()
    flush = _flush_fn(dev)
    fn()
    fn()
    if graph and dev not in _GRAPH_FAILED:
        try:
            return _graph_ms(fn, flush, reps)
        except RuntimeError as e:   # capture unsupported here: eager timing still ranks candidates
            _GRAPH_FAILED.add(dev)
            print(f"ninfer: GEMV tuner times eagerly on cuda:{dev} (graph capture failed: {str(e)[:120]})",
                  file=sys.stderr)
            torch.cuda.synchronize()
    return _eager_ms(fn, flush, reps)
