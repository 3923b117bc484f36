"""A GEMV CTA's first weight tiles prefetched into L2 before its PDL wait (sm_90+; `NINFER_GEMV_PREFETCH`).

Why: under PDL (`ninfer_kernels.pdl`) a GEMV's CTAs are placed while the small kernel in front (a norm, a gate, the
attention combine) still runs, and wait there for it; ~260 such latency-bound kernels take ~0.9 ms of the 6 ms decode
step (bench/NOTES.md §27), during which the DRAM is idle, and the weights the waiting CTAs will read do not depend
on anything those kernels compute. One thread's `cp.async.bulk.prefetch.L2` hands a contiguous range to the copy
engine and holds no register once issued, so each CTA can start its first tiles' bytes towards L2 before it waits.
(What lost before was different: a per-line `prefetch.global.L2` from every thread, in GEMVs that then triggered
their dependents at their start, §14; and a first tile loaded into registers before the wait, which cost the
T = 1 loop a CTA per SM, §16.)

`bulk_prefetch(ptr, nbytes)`: thread 0 of the CTA issues it; ptr 16-byte aligned, nbytes a multiple of 16 (0: none).
The value of the switch is the number of K chunks per CTA (the formats' chunk-major planes) to prefetch; 0 (the
default) compiles nothing in. Devices before sm_90 (no bulk prefetch) and the interpreter always get 0.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .ops_common import KernelInputError, interpreting

PREFETCH_ENV = "NINFER_GEMV_PREFETCH"
MAX_CHUNKS = 8


@triton.jit
def bulk_prefetch(ptr, nbytes):
    """Thread 0 prefetches nbytes (a multiple of 16; 0 = nothing) at ptr (16-byte aligned) into L2."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; setp.ne.and.s32 p, $2, 0, p; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


def chunks_env() -> int:
    """NINFER_GEMV_PREFETCH: K chunks per CTA, 0 (the default) to MAX_CHUNKS; anything else is a one-line error."""
    v = os.environ.get(PREFETCH_ENV, "0")
    if not v.isdigit() or int(v) > MAX_CHUNKS:
        raise KernelInputError(f"{PREFETCH_ENV}={v!r}: expected a number of K chunks from 0 (off, the default) "
                               f"to {MAX_CHUNKS}")
    return int(v)


def chunks_for(device) -> int:
    """The prefetch constexpr for GEMV launches on `device`: the switch's value on sm_90+ CUDA devices, else 0."""
    n = chunks_env()
    if n == 0 or interpreting() or getattr(device, "type", None) != "cuda":
        return 0
    return n if _capability(device.index) >= (9, 0) else 0


@functools.lru_cache(maxsize=None)
def _capability(index) -> tuple:
    return torch.cuda.get_device_capability(index)
