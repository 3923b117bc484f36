"""Programmatic dependent launch (PDL, sm_90+) for the decode GEMVs: a GEMV may start before the kernel in front
of it has finished, and waits for it only where it first needs that kernel's results.

Why: a decode step is ~750 kernels in a CUDA graph; a GEMV of 10-40 MB runs at 42-71 % of copy bandwidth on the
H200 while the same kernel at 715 MB (lm_head) reaches 91 %, and neither deeper pipelines (§5, §9) nor TMA-fed
tiles (§15) moved the medium shapes: what they lose is per-kernel, the launch, the first loads' latency and the
last wave's tail (bench/NOTES.md §15). Launched with PDL, a GEMV's CTAs are scheduled as the kernel in front
retires, and issue their first weight lines into L2 (which depend on nothing) before `griddepcontrol.wait`.

Protocol (PDL constexpr of a kernel, 0 = off): every CTA first calls `griddepcontrol.launch_dependents` (the
next PDL-launched kernel may be scheduled once every CTA of this one has started), then (PDL = 2) prefetches
its first weight tile into L2, then `griddepcontrol.wait`, which returns when the kernel in front has completed
and its memory is visible. Nothing before the wait reads activations or writes anything, so the output, the
split-K workspace and its counters are touched only after the kernel in front is done, as without PDL.
A kernel launched without the attribute (every non-GEMV kernel) starts after the one in front completes, as
always; the trigger only lets a PDL-launched successor in early.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

PDL_ENV = "NINFER_PDL"
PDL_MODES = ("auto", "0", "1", "2")     # auto: off until measured end to end (bench/NOTES.md §15)


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    if PDL > 0:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    if PDL > 0:
        tl.extra.cuda.gdc_wait()


@triton.jit
def l2_prefetch(ptrs, PDL: tl.constexpr):
    """Ask L2 for the 128-byte lines at `ptrs` (PDL = 2 only); no registers wait for them."""
    if PDL > 1:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


def pdl_mode(device) -> int:
    """The PDL constexpr for GEMV launches on `device` (NINFER_PDL: auto, 0, 1 = wait only, 2 = with prefetch);
    0 off CUDA, below sm_90 and in the interpreter (griddepcontrol is sm_90 PTX)."""
    import torch
    v = os.environ.get(PDL_ENV, "auto")
    if v not in PDL_MODES:
        from .ops_common import KernelInputError
        raise KernelInputError(f"{PDL_ENV}={v!r}: expected one of {', '.join(PDL_MODES)}")
    if v == "0" or os.environ.get("TRITON_INTERPRET", "0") == "1" or torch.device(device).type != "cuda":
        return 0
    if _capability(torch.device(device).index) < (9, 0):
        return 0
    return 0 if v == "auto" else int(v)


_CC: dict = {}


def _capability(index) -> tuple:
    if index not in _CC:
        import torch
        _CC[index] = torch.cuda.get_device_capability(index)
    return _CC[index]
