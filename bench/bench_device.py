"""Torch-side helpers the benchmark scripts share (bench/decode*.py, bench/prefill_*.py): device sync and
best-of timing, the two ceilings every result is held to (device copy bandwidth, bf16 matmul), the device's
name for the records, and one walk over a built Model's weights."""
from __future__ import annotations

import platform
import time

import torch

from ninfer_rt.weights import QWeight

# attributes that hold no weights and lead out of the model (config, TP group, ops backend)
SKIP_ATTRS = ("cfg", "tp", "ops")


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def best_s(fn, reps: int, device) -> float:
    """Seconds of the fastest of `reps` calls, after one untimed call (compiles, first touch)."""
    fn()
    sync(device)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def copy_tbps(device, mbytes: int, reps: int = 10) -> float:
    """Device copy bandwidth in TB/s, counting bytes read + written (a large contiguous copy)."""
    n = mbytes << 20
    bufs = [torch.empty(n, dtype=torch.uint8, device=device).fill_(1), torch.empty(n, dtype=torch.uint8, device=device)]
    t = best_s(lambda: bufs[1].copy_(bufs[0]), reps, device)
    bufs.clear()
    return 2 * n / t / 1e12


def matmul_tflops(device, n: int, dtype, reps: int = 10) -> float:
    """n x n x n torch.matmul in `dtype`, TFLOP/s: the ceiling GEMM-bound work is held to."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    t = best_s(lambda: torch.matmul(a, b), reps, device)
    return 2 * n ** 3 / t / 1e12


def graph_us(fns, bench_ms) -> float:
    """us per call of `fns` (called in turn, max(20, len(fns)) calls) captured in one CUDA graph and replayed
    (bench_ms(fn) -> ms times the replay): what a decode step sees, no host launch cost between kernels."""
    k = max(20, len(fns))
    for f in fns:          # warm: tuning, plans, allocator pools all settle before capture
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(k):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    us = bench_ms(g.replay) * 1e3 / k
    del g
    return us


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def _leaves(root):
    """QWeights and tensors reachable from `root` through lists, tuples and ninfer_rt objects' attributes,
    each container visited once."""
    seen, stack = set(), [root]
    while stack:
        obj = stack.pop()
        if isinstance(obj, (QWeight, torch.Tensor)):
            yield obj
        elif id(obj) in seen:
            continue
        elif isinstance(obj, (list, tuple)):
            seen.add(id(obj))
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("ninfer_rt"):
            seen.add(id(obj))
            stack.extend(v for k, v in vars(obj).items() if k not in SKIP_ATTRS)


def qweights(root) -> list:
    """The distinct QWeights under `root` (a model part, or a list of parts)."""
    out = {}
    for leaf in _leaves(root):
        if isinstance(leaf, QWeight):
            out.setdefault(id(leaf), leaf)
    return list(out.values())


def tensors(root, seen: set | None = None) -> list:
    """The distinct tensors under `root` (QWeights' packed data included), by storage and size; `seen` is
    shared across calls so a tensor counted once is not counted again."""
    seen = set() if seen is None else seen
    out = []
    for leaf in _leaves(root):
        for t in (leaf.stored_tensors() if isinstance(leaf, QWeight) else (leaf,)):
            key = (t.data_ptr(), t.nbytes)
            if key not in seen:
                seen.add(key)
                out.append(t)
    return out
