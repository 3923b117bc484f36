"""The split-K reduction of the GEMVs: each CTA of a row block stores its fp32 partial in its split's slice of the
workspace and arrives at the row block's counter; the last to arrive sums the partials in split order (the same
bits for any arrival order) and resets the counter (graph-safe). `gemv_common.finish_at` runs it; its two
comparison switches are read once, here, and checked where the runtime starts.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .env_switch import switch_error, switch_value

# partials the split-K reduction loads per round before it adds them (in split order, so any value gives the same
# bits): each round is one L2 round trip of the last CTA of a row block, at the kernel's tail (4 took the H200's
# verify K = 3 step from 7.85 to 7.42 ms, bench/NOTES.md §24; 8 takes the warp-MMA tiles from 72 to 122+
# registers). NINFER_SPLIT_UNROLL (a comparison switch; 1 = one load per round) is part of every GEMV's compile key
# (a global constexpr): read once, here, and checked where the runtime starts (`split_unroll_env_error`).
SPLIT_UNROLL_ENV = "NINFER_SPLIT_UNROLL"
_SPLIT_UNROLLS = ("4", "2", "1")


def split_unroll_env_error() -> str | None:
    """None, or a one-line message when NINFER_SPLIT_UNROLL holds anything but 4, 2 or 1."""
    return switch_error(SPLIT_UNROLL_ENV, _SPLIT_UNROLLS)


SPLIT_UNROLL = tl.constexpr(int(switch_value(SPLIT_UNROLL_ENV, _SPLIT_UNROLLS)))

# the ordering of a split-K CTA's arrival at its row block's counter. release (the default): a release fence, then
# the atomic. The last CTA still sees every partial: it reads them only after its atomic returned the count (a
# control dependency) and with `.cg` loads, served by L2, where the other CTAs' released stores are (the pattern of
# the CUDA programming guide's __threadfence() example and the threadFenceReduction sample). acq_rel (the comparison
# value) adds an acquire after the atomic in every arriving CTA; on sm_90 that is a CCTL.IVALL, which drops the
# whole L1 of the SM under the CTAs beside it too: it cost the H200's step 26 us at decode and 47 us at verify K = 3
# (bench/NOTES.md §27). Part of every GEMV's compile key, like NINFER_SPLIT_UNROLL, and checked where the runtime
# starts (`split_arrive_env_error`).
SPLIT_ARRIVE_ENV = "NINFER_SPLIT_ARRIVE"
_SPLIT_ARRIVES = ("release", "acq_rel")


def split_arrive_env_error() -> str | None:
    """None, or a one-line message when NINFER_SPLIT_ARRIVE holds anything but release or acq_rel."""
    return switch_error(SPLIT_ARRIVE_ENV, _SPLIT_ARRIVES)


def split_arrive_sem() -> str:
    """The arrival's memory order this process compiles with (release when the switch is invalid: the runtime
    refuses that value at start, `split_arrive_env_error`)."""
    return switch_value(SPLIT_ARRIVE_ENV, _SPLIT_ARRIVES)


SPLIT_ARRIVE_SEM = tl.constexpr(split_arrive_sem())


@triton.jit
def split_partial(v, cols, rows, m, N, T, ws_ptr):
    """This CTA's fp32 partial of out[cols, rows] into its split's slice of the workspace."""
    tl.store(ws_ptr + (tl.program_id(1) * T + cols) * N + rows, v, mask=m)


@triton.jit
def split_arrive(cnt_ptr, split):
    """True in the last CTA of a row block (and T tile) to arrive: every partial is then visible to it."""
    tl.debug_barrier()  # every thread's partial is issued before the counter is released
    cidx = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
    # NINFER_SPLIT_ARRIVE (above): with release (the default), split_total's .cg loads make the partials visible
    return tl.atomic_add(cnt_ptr + cidx, 1, sem=SPLIT_ARRIVE_SEM, scope="gpu") == split - 1


@triton.jit
def split_total(cols, rows, m, N, T, split, ws_ptr):
    """The sum of the row block's `split` partials, added in split order (bitwise reproducible), loaded
    SPLIT_UNROLL at a time."""
    tot = tl.zeros(m.shape, tl.float32)
    zero = tl.zeros(m.shape, tl.int32)      # the split index as a tensor: a scalar in a mask breaks the interpreter
    for s0 in range(0, split, SPLIT_UNROLL):
        parts = ()
        for i in tl.static_range(SPLIT_UNROLL):
            parts = parts + (tl.load(ws_ptr + ((s0 + i) * T + cols) * N + rows, mask=m & (zero + (s0 + i) < split),
                                     other=0.0, cache_modifier=".cg"),)
        for i in tl.static_range(SPLIT_UNROLL):
            tot = tl.where(s0 + i < split, tot + parts[i], tot)
    return tot


@triton.jit
def split_release(cnt_ptr):
    """Reset the row block's counter (by its last CTA) so the workspace is reusable and graph-safe."""
    tl.atomic_xchg(cnt_ptr + tl.program_id(2) * tl.num_programs(0) + tl.program_id(0), 0, sem="relaxed",
                   scope="gpu")
