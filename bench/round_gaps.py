"""Where the GPU waits in an MTP round, from CUDA events around every graph step (no profiler).

A CUDA event records the time the GPU reaches it. One event just before each graph step's metadata fill and one
just after its replay give the step's span on the GPU (`busy`), and the span from one step's end to the next one's
start (`gap`): the small kernels and copies between them plus the time the GPU waited for the host to queue the
next step. Unlike torch.profiler (CUPTI), two events cost the host a few microseconds per step, so the round runs
at its own speed (bench/NOTES.md §44: the profiled round took 12.7 ms against 10.65).

Steps are named by their graph kind: `round` (drafts + verify as one graph), `target` (a decode, verify or prefill
piece), `mtp` (a draft step or the re-alignment). Per round (the engine's MTP rounds of the run):
  busy_ms   {kind: ms}          GPU span of the steps of each kind
  gap_ms    {"a->b": ms}        from the end of an `a` step to the start of the next `b` step
  span_ms   the first step's start to the last one's end, per round (compare with ms_round: the rest is host
            time outside the steps, e.g. before the first and after the last)
"""
from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def recording(marks: list):
    """Patch GraphRunner._run: (kind, start event, end event) of every graph step appended to `marks`."""
    import torch

    from ninfer_rt.graphs import GraphRunner
    real = GraphRunner._run

    def run(self, key, rows, *more):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = real(self, key, rows, *more)
        b.record()
        marks.append((key[0], a, b))
        return out
    GraphRunner._run = run
    try:
        yield marks
    finally:
        GraphRunner._run = real


def summarize(marks: list, rounds: int) -> dict:
    """The events' spans per round (call after the GPU finished them)."""
    busy: dict[str, float] = {}
    gaps: dict[str, float] = {}
    for i, (kind, a, b) in enumerate(marks):
        busy[kind] = busy.get(kind, 0.0) + a.elapsed_time(b)
        if i + 1 < len(marks):
            nxt = marks[i + 1]
            key = f"{kind}->{nxt[0]}"
            gaps[key] = gaps.get(key, 0.0) + b.elapsed_time(nxt[1])
    n = max(1, rounds)
    span = marks[0][1].elapsed_time(marks[-1][2]) if marks else 0.0
    return {"rounds": rounds, "steps": len(marks),
            "busy_ms": {k: round(v / n, 4) for k, v in sorted(busy.items())},
            "gap_ms": {k: round(v / n, 4) for k, v in sorted(gaps.items(), key=lambda kv: -kv[1])},
            "span_ms": round(span / n, 4)}


def gap_run(eng, generate, prompt: list[int], new_tokens: int, batch: int) -> dict:
    """One generation with the events (`generate` is bench/engine_mtp.py's) -> `summarize` of its decode phase."""
    import torch
    marks: list = []
    with recording(marks):
        run = generate(eng, prompt, new_tokens, batch)
    torch.cuda.synchronize()
    return summarize(marks, run.spec["rounds"])
