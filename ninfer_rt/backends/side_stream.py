"""Parallel branches inside a captured step (`TritonOps.gdn_ba_gates_branch`, `TritonOps.gdn_conv_recurrent`).

While a CUDA graph is being captured, `branch(fn)` runs fn's launches on a side stream forked from the
capturing stream, so the graph holds them as a branch beside the caller's next kernels instead of one more link
in the chain; `join()` makes the capturing stream wait for the branch. A step has up to two per GDN layer: the
b/a projection + gates, which read only the layer input, beside the q/k/v/z GEMV (one kernel boundary less on the
step's critical path, bench/NOTES.md §17; a decode step computes them in the input norm instead, see
NINFER_GATES_JOIN below), and with NINFER_GDN_FUSED=1 the q/k conv-window update behind the fused conv +
recurrence, beside the gated norm and the out GEMV.

fn must not launch a split-K GEMV: their workspace and arrival counters are one per device
(`ninfer_kernels.gemv_launch`), so a GEMV on the side stream would race the one on the capturing stream.

Outside capture (eager steps, prefill, the CPU interpreter) fn runs in place: ordering is the same, and an eager
fork would cost host time for nothing. NINFER_BRANCH=0 turns branches off everywhere (default 1).

Where the gates come from and join (NINFER_GATES_JOIN, `join_at`):
* `norm` (default): in a decode step (one token) the layer's input norm computes them in its own kernel
  (`TritonOps.norm_ba_gates`, `ninfer_kernels.rmsnorm_gates`), so there is no branch and no join; elsewhere (verify
  steps, prefill, quantized b/a weights) as `recurrence`. On the H200 the decode step took 5.909 / 5.917 ms of GPU
  time against 5.948 / 5.948 with `recurrence`, verify K=3 unchanged (7.083 / 7.083 against 7.078 / 7.087 ms;
  bench/NOTES.md §30).
* `recurrence`: a branch joined behind the conv, in front of the recurrence that first reads them.
* `conv`: a branch joined in front of the conv.
A joined node has two incoming edges in the graph, one of them plain, so the kernel behind the join may not be placed
early by programmatic dependent launch: the H200 profile shows a ~0.45 us gap in front of whichever kernel it is, and
that kernel's loads before the wait (NINFER_PDL_STATE) no longer overlap anything. Behind the conv, the verify step
(whose T > 1 conv was not preloaded then) took 7.150 / 7.158 ms of GPU time against 7.221 / 7.229 with the join in
front of it, and decode was unchanged (5.963 / 5.964 against 5.966 / 5.973 ms; bench/NOTES.md §29).

Memory: fn's outputs are allocated on the side stream; the caller frees them after use on its own stream. A
block freed that way is reused only by later side-stream allocations, and every later fork first waits for the
capturing stream, so no branch writes memory that an earlier consumer still reads. The caller keeps fn's inputs
alive until it joins, so the capturing stream cannot reuse them while the branch reads them.
"""
from __future__ import annotations

import os

import torch

from ninfer_formats.errors import LoadError

from ..ops import Branch

BRANCH_ENV = "NINFER_BRANCH"
MODES = ("1", "0")
_SIDE: dict = {}            # device index -> the side stream


JOIN_ENV = "NINFER_GATES_JOIN"
JOINS = ("norm", "recurrence", "conv")


def join_at() -> str:
    """NINFER_GATES_JOIN: `norm` (default: the input norm computes the gates where it can, no branch), `recurrence`
    or `conv`, where the GDN layer joins its gates branch."""
    v = os.environ.get(JOIN_ENV, JOINS[0])
    if v not in JOINS:
        raise LoadError(f"{JOIN_ENV}={v!r}: expected one of {', '.join(JOINS)}")
    return v


def mode() -> str:
    v = os.environ.get(BRANCH_ENV, "1")
    if v not in MODES:
        raise LoadError(f"{BRANCH_ENV}={v!r}: expected one of {', '.join(MODES)}")
    return v


class _Forked(Branch):
    def __init__(self, value, main, side):
        super().__init__(value)
        self._main, self._side, self._joined = main, side, False

    def join(self):
        if not self._joined:
            self._main.wait_stream(self._side)
            self._joined = True
        return self.value


def branch(fn) -> Branch:
    if mode() == "0" or not torch.cuda.is_available() or not torch.cuda.is_current_stream_capturing():
        return Branch(fn())
    main = torch.cuda.current_stream()
    side = _SIDE.get(main.device.index)
    if side is None:
        side = _SIDE[main.device.index] = torch.cuda.Stream(device=main.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        value = fn()
    return _Forked(value, main, side)
