"""Stream-K ("persistent") GEMV grids: as many CTAs as the device holds at once, each streaming an equal share of
the weights.

Why: a T = 1 GEMV of the decode step is a few microseconds of streaming, and its classic grid (row blocks x K
splits) rarely divides evenly over the SMs: 544 CTAs for 528 resident slots (mlp_gate_up) leave 16 CTAs to a second,
nearly idle wave, and Nsight Compute found the SMs without any CTA for 18-20 % of each kernel (bench/NOTES.md §15).
Here the grid is P CTAs, P = the CTAs per SM that fit (registers, threads, shared memory of the compiled kernel,
capped by `GemvConfig.persist`) times the SMs, so every CTA is resident from the start; the work is the row-major
space of W = R x C units (R row blocks of BLOCK_N rows, C K steps of BLOCK_G groups), and CTA p takes units
[p W / P, (p + 1) W / P) (floor), i.e. a contiguous run of K steps that may end one row block and start the next.
Each run within one row block is a segment; the kernels unroll their segment loop (`max_segments`, at most
MAX_SEGS; a grid that would need more runs classic). A row block whose units belong to one CTA is stored directly; one
shared by several CTAs gets a partial per CTA in the split-K workspace, slot = the CTA's rank among them, and the
last to arrive sums them in slot order (`gemv_common.split_finish`): deterministic for a given (config, device).
CTA p owns unit u iff p = ((u + 1) P - 1) // W, so every CTA computes the sharers of a row block without any
table. PDL: a CTA triggers when it finishes its last segment's K loop (`ninfer_kernels.pdl`).
"""
from __future__ import annotations

import os
from dataclasses import replace

import triton
import triton.language as tl

from .gemv_common import split_finish, store_out
from .pdl import pdl_trigger


@triton.jit
def stream_units(R, C):
    """[u, u_end): this CTA's units of the R x C space."""
    W = R * C
    p = tl.program_id(0)
    P = tl.num_programs(0)
    return p * W // P, (p + 1) * W // P


@triton.jit
def stream_segment(u, u_end, C):
    """(row block r, first K step c0, end step c1) of the segment that starts at unit u."""
    r = u // C
    c0 = u - r * C
    return r, c0, tl.minimum(C, c0 + (u_end - u))


@triton.jit
def _owner(u, W, P):
    return ((u + 1) * P - 1) // W


@triton.jit
def stream_finish(v, cols, rows, N, T, r, R, C, last, out_ptr, stride_ot, res_ptr, stride_rt, ws_ptr, cnt_ptr,
                  HAS_RES: tl.constexpr, PDL: tl.constexpr):
    """out[cols, rows] = v (+ residual) for this CTA's segment of row block r (`gemv_common.finish_at`'s stream-K
    twin); last: it is the CTA's last segment (the PDL trigger)."""
    if last:
        pdl_trigger(PDL)
    W = R * C
    P = tl.num_programs(0)
    first = _owner(r * C, W, P)
    parts = _owner(r * C + C - 1, W, P) - first + 1
    m = (rows < N) & (cols < T)
    if parts == 1:
        store_out(v, cols, rows, m, out_ptr, stride_ot, res_ptr, stride_rt, HAS_RES)
    else:
        split_finish(v, cols, rows, m, N, T, parts, tl.program_id(0) - first, tl.program_id(2) * R + r, out_ptr,
                     stride_ot, res_ptr, stride_rt, ws_ptr, cnt_ptr, HAS_RES)


def stream_ctas(R: int, C: int, per_sm: int, sms: int) -> int:
    """P: per_sm CTAs on every SM, but no CTA without a unit."""
    return max(1, min(per_sm * sms, R * C))


def max_parts(R: int, C: int, P: int) -> int:
    """The most CTAs sharing one row block (the workspace's slots); the kernel's owner rule, on the host."""
    W = R * C
    return max(((r * C + C) * P - 1) // W - ((r * C + 1) * P - 1) // W + 1 for r in range(R))


MAX_SEGS = 8   # segments per CTA the kernels unroll at most (a loop back-edge doubled the warp-MMA loop's registers)


def max_segments(R: int, C: int, P: int) -> int:
    """The most row blocks one CTA's units touch: the kernels' PERSIST constexpr (their segment loop, unrolled)."""
    W = R * C
    return max(((p + 1) * W // P - 1) // C - (p * W // P) // C + 1 for p in range(P))


def resident_ctas(n_regs: int, num_warps: int, shared: int, props) -> int:
    """CTAs of a compiled kernel that fit on one SM at once (CUDA's occupancy rules for sm_70..sm_90: registers are
    allocated per warp in units of 256 from four 16K sub-partitions, 1 KB of shared memory reserved per CTA)."""
    per_warp = triton.cdiv(max(1, n_regs) * 32, 256) * 256
    by_regs = 4 * (16384 // per_warp) // num_warps
    by_threads = props.max_threads_per_multi_processor // (32 * num_warps)
    by_smem = props.shared_memory_per_multiprocessor // (shared + 1024) if shared else 32
    return max(1, min(by_regs, by_threads, by_smem, 32))


PERSIST_ENV = "NINFER_GEMV_PERSIST"
PERSIST_MODES = ("0", "1", "force", "force-h2", "force-mma")
PERSIST_CAP = 8    # GemvConfig.persist of the tuner's stream-K candidates: a cap, the kernel's occupancy decides


def persist_mode() -> str:
    """NINFER_GEMV_PERSIST: '1' (default: stream-K configs compete in the tuner like any other), '0' (never: every
    stream-K choice runs its classic grid), 'force' (every h2 / mma choice whose kernel has the grid runs it),
    'force-h2' / 'force-mma' (only those of that variant: comparison runs); anything else is a one-line error
    naming the variable."""
    v = os.environ.get(PERSIST_ENV, "1")
    if v not in PERSIST_MODES:
        from .gemv_launch import KernelInputError   # (gemv_launch imports this module)
        raise KernelInputError(f"{PERSIST_ENV}={v!r}: expected one of {', '.join(PERSIST_MODES)}")
    return v


def with_mode(cfg, can_persist: bool, classic_split: int):
    """`cfg` as NINFER_GEMV_PERSIST has it run (classic_split: the K splits of its classic grid)."""
    mode = persist_mode()
    if mode == "0" and cfg.persist:
        return replace(cfg, persist=0, split=classic_split)
    kinds = {"force": (cfg.h2 or cfg.mma), "force-h2": cfg.h2, "force-mma": cfg.mma}
    if kinds.get(mode) and can_persist and not cfg.persist:
        return replace(cfg, persist=PERSIST_CAP, split=1)
    return cfg
