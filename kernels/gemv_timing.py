"""Timing a GPU launch the way the GEMV tuner and the prefill-path choice need it."""
from __future__ import annotations

import torch

_FLUSH: dict = {}


def time_ms(fn, reps: int = 12) -> float:
    """Median ms of fn() on the GPU with L2 flushed before each run (a buffer of twice the L2 size, not
    triton's 256 MB: the tuner runs inside a serving process). A GPU-side sleep queued before each run keeps
    the host's launch cost out of the measurement (the decode step runs these kernels in a CUDA graph)."""
    dev = torch.cuda.current_device()
    if dev not in _FLUSH:
        l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 64 << 20) or (64 << 20)
        _FLUSH[dev] = torch.empty(2 * l2, dtype=torch.uint8, device="cuda")
    flush = _FLUSH[dev]
    sleep = getattr(torch.cuda, "_sleep", None)
    fn()
    fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        if sleep is not None:
            sleep(600_000)  # ~0.3-0.4 ms of GPU clocks: longer than enqueuing flush + fn on a slow host
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in events)[reps // 2]
