"""GDN depthwise causal conv + SiLU with the per-slot window state (reference §7.2, §12).

Per sequence b with T_b new inputs, the window is [pool rows (the last CK-1 inputs, oldest first) | x rows];
output t = silu(sum_j w[:, j] * window[t + j]). One program per (sequence, block of BLOCK_T tokens, block of
channels), so verify (T <= 16) and prefill chunks run fully parallel; a step of at most one token per
sequence (decode) takes `conv_step_kernel`, one program per (sequence, block of channels).

State: snap_index[b] < 0 -> the pool slot gets the window after the last token (written by the program of
token block 0 after a CTA barrier: it may overwrite pool rows it has just read when T_b < CK-1);
snap_index[b] >= 0 -> the window after token t goes to snapshot row snap + t; the slot row is read first, all
of it before a CTA barrier, since it may be one of those snapshot rows (the graph runner's rows are pool rows
and a sequence's committed state can be one of its own, `ninfer_rt.graphs`).

PDL: both kernels take `PRELOAD` (NINFER_PDL_STATE, `ninfer_kernels.pdl`): the metadata, taps and pool window,
which no kernel in front writes within a step, are loaded before the wait; the x rows and every store after it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ops_common import KernelInputError
from .pdl import pdl_kw, pdl_trigger, pdl_wait

BLOCK_T = 16
BLOCK_C = 128
STEP_BLOCK_C = 128        # decode kernel: 4 channels per thread of one warp


@triton.jit
def _window(x_ptr, pool_ptr, s0, sx_t, pool_base, r, c, C, mask, CK: tl.constexpr):
    """Window values at relative input row(s) r (r < 0: pool row CK-1+r) for channels c, as fp32."""
    from_pool = r < 0
    xv = tl.load(x_ptr + (s0 + r).to(tl.int64) * sx_t + c, mask=mask & (r >= 0), other=0.0)
    pv = tl.load(pool_ptr + pool_base + (CK - 1 + r) * C + c, mask=mask & from_pool, other=0.0)
    return tl.where(from_pool, pv.to(tl.float32), xv.to(tl.float32))


@triton.jit
def _verify_state(w_ptr, pool_ptr, cu_ptr, slot_ptr, snapidx_ptr, C, n_tblocks, CK: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """What `causal_conv_kernel` reads that no kernel in front of it in a step writes: the sequence's offsets, slot
    and snapshot index, this program's channels' conv taps (fp32) and the CK-1 pool window rows, these only where
    the program's tokens read them (its first token is one of the sequence's and is < CK-1: token block 0)."""
    b = tl.program_id(0) // n_tblocks
    tb = tl.program_id(0) % n_tblocks
    s0 = tl.load(cu_ptr + b)
    T = tl.load(cu_ptr + b + 1) - s0
    pool_base = tl.load(slot_ptr + b).to(tl.int64) * ((CK - 1) * C)
    snap = tl.load(snapidx_ptr + b)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (c < C) & (tl.zeros([BLOCK_C], tl.int32) + tb * BLOCK_T < tl.minimum(T, CK - 1))
    ws = ()
    rows = ()
    for j in tl.static_range(CK):
        ws = ws + (tl.load(w_ptr + c * CK + j, mask=c < C, other=0.0).to(tl.float32),)
    for i in tl.static_range(CK - 1):
        rows = rows + (tl.load(pool_ptr + pool_base + i * C + c, mask=m, other=0.0).to(tl.float32),)
    return tb, s0, T, pool_base, snap, c, ws, rows


@triton.jit
def causal_conv_kernel(x_ptr, w_ptr, y_ptr, pool_ptr, snap_ptr, cu_ptr, slot_ptr, snapidx_ptr,
                       C, sx_t, n_tblocks, CK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                       PDL: tl.constexpr = 0, PRELOAD: tl.constexpr = 0):
    """With PRELOAD (NINFER_PDL_STATE, ninfer_kernels.pdl) the metadata, taps and pool window are loaded before
    the PDL wait, as in `conv_step_kernel` (the verify step's T = 4 conv lost 27 us beside the recurrence's
    preload, bench/NOTES.md §29); the x rows after it. The first output takes its pool inputs from those rows."""
    pdl_trigger(PDL)
    if PRELOAD:
        tb, s0, T, pool_base, snap, c, ws, rows = _verify_state(w_ptr, pool_ptr, cu_ptr, slot_ptr, snapidx_ptr, C,
                                                                n_tblocks, CK, BLOCK_T, BLOCK_C)
    pdl_wait(PDL)
    if not PRELOAD:
        tb, s0, T, pool_base, snap, c, ws, rows = _verify_state(w_ptr, pool_ptr, cu_ptr, slot_ptr, snapidx_ptr, C,
                                                                n_tblocks, CK, BLOCK_T, BLOCK_C)
    if tb * BLOCK_T < T:
        c_ok = c < C
        t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        m2 = (t < T)[:, None] & c_ok[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        for j in tl.static_range(CK):
            r = t[:, None] + (j - (CK - 1))     # relative input row; r < 0: pool row CK-1+r = t+j, preloaded
            val = tl.load(x_ptr + (s0 + r).to(tl.int64) * sx_t + c[None, :], mask=m2 & (r >= 0),
                          other=0.0).to(tl.float32)
            for i in tl.static_range(CK - 1):
                val = tl.where(t[:, None] + j == i, rows[i][None, :], val)
            acc += val * ws[j][None, :]
        y = acc * tl.sigmoid(acc)
        tl.store(y_ptr + (s0 + t).to(tl.int64)[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty), mask=m2)
        if snap >= 0:
            srow = (snap + t).to(tl.int64)[:, None] * ((CK - 1) * C)
            wins = ()
            for i in tl.static_range(CK - 1):
                wins = wins + (_window(x_ptr, pool_ptr, s0, sx_t, pool_base, t[:, None] + (i + 2 - CK), c[None, :],
                                       C, m2, CK),)
            # the graph runner's snapshot rows are pool rows: the window read may be one of the rows written here
            tl.debug_barrier()
            for i in tl.static_range(CK - 1):
                tl.store(snap_ptr + srow + i * C + c[None, :], wins[i], mask=m2)
        elif tb == 0:
            tl.debug_barrier()      # every read of the old window is done before it is overwritten
            for i in tl.static_range(CK - 1):
                # read row T+i (> i) before row i is written: increasing i never reads a row already written
                row = _window(x_ptr, pool_ptr, s0, sx_t, pool_base, T + (i + 1 - CK) + 0 * c, c, C, c_ok, CK)
                tl.store(pool_ptr + pool_base + i * C + c, row, mask=c_ok)


@triton.jit
def _step_state(w_ptr, pool_ptr, cu_ptr, slot_ptr, snapidx_ptr, C, CK: tl.constexpr, BLOCK_C: tl.constexpr):
    """What `conv_step_kernel` reads that no kernel in front of it in a step writes: the sequence's offsets, slot
    and snapshot index (loaded together), this program's channels' conv weights and window rows."""
    b = tl.program_id(0)
    s0 = tl.load(cu_ptr + b)
    s1 = tl.load(cu_ptr + b + 1)
    slot = tl.load(slot_ptr + b)
    snap = tl.load(snapidx_ptr + b)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (c < C) & (tl.zeros([BLOCK_C], tl.int32) + s1 > s0)     # a batch row without a token: nothing
    base = slot.to(tl.int64) * ((CK - 1) * C)
    ws = ()
    rows = ()
    for j in tl.static_range(CK):
        ws = ws + (tl.load(w_ptr + c * CK + j, mask=c < C, other=0.0).to(tl.float32),)
    for j in tl.static_range(CK - 1):
        rows = rows + (tl.load(pool_ptr + base + j * C + c, mask=m, other=0.0),)
    return s0, snap, c, m, base, ws, rows


@triton.jit
def conv_step_kernel(x_ptr, w_ptr, y_ptr, pool_ptr, snap_ptr, cu_ptr, slot_ptr, snapidx_ptr, C, sx_t,
                     CK: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = 0, PRELOAD: tl.constexpr = 0):
    """At most one new token per sequence (decode): each thread owns its channels in every window row, so the
    window moves up in registers -- no tile of masked token rows, no barrier before the rewrite. A sequence
    without a token masks its loads and stores (a branch on the offsets made the slot's load, and the window's
    behind it, wait for them: one more dependent memory round trip in a kernel that is little else). With PRELOAD
    (NINFER_PDL_STATE, ninfer_kernels.pdl) everything but the new token's row is loaded before the PDL wait, so
    the window's DRAM read overlaps the tail of the GEMV in front, which writes that row."""
    pdl_trigger(PDL)
    if PRELOAD:
        s0, snap, c, m, base, ws, rows = _step_state(w_ptr, pool_ptr, cu_ptr, slot_ptr, snapidx_ptr, C, CK, BLOCK_C)
    pdl_wait(PDL)
    if not PRELOAD:
        s0, snap, c, m, base, ws, rows = _step_state(w_ptr, pool_ptr, cu_ptr, slot_ptr, snapidx_ptr, C, CK, BLOCK_C)
    xv = tl.load(x_ptr + s0.to(tl.int64) * sx_t + c, mask=m, other=0.0).to(tl.float32)
    acc = xv * ws[CK - 1]
    for j in tl.static_range(CK - 1):
        acc += rows[j] * ws[j]
    tl.store(y_ptr + s0.to(tl.int64) * C + c, (acc * tl.sigmoid(acc)).to(y_ptr.dtype.element_ty), mask=m)
    if snap >= 0:
        dst = snap_ptr + snap.to(tl.int64) * ((CK - 1) * C)
    else:
        dst = pool_ptr + base
    for j in tl.static_range(CK - 2):
        tl.store(dst + j * C + c, rows[j + 1], mask=m)
    tl.store(dst + (CK - 2) * C + c, xv, mask=m)


def causal_conv(x: torch.Tensor, w: torch.Tensor, conv_pool: torch.Tensor, cu_seqlens: torch.Tensor,
                slots: torch.Tensor, snap_index: torch.Tensor, max_t: int,
                snapshots: torch.Tensor | None = None) -> torch.Tensor:
    """x [sumT, C]; w [C, ck]; conv_pool fp32 [S, ck-1, C] (contiguous); cu_seqlens int32 [B+1];
    slots, snap_index int64 [B]; snapshots fp32 [N, ck-1, C] when any snap_index >= 0. Returns y [sumT, C]."""
    total, c = x.shape
    ck = w.shape[1]
    if w.shape[0] != c or conv_pool.shape[1:] != (ck - 1, c) or not conv_pool.is_contiguous():
        raise KernelInputError(f"causal_conv: x {tuple(x.shape)} w {tuple(w.shape)} pool {tuple(conv_pool.shape)}")
    if ck - 1 > BLOCK_T:
        raise KernelInputError(f"causal_conv: kernel width {ck} exceeds {BLOCK_T + 1}")
    if snapshots is not None and (snapshots.shape[1:] != conv_pool.shape[1:] or not snapshots.is_contiguous()):
        raise KernelInputError(f"causal_conv: snapshots {tuple(snapshots.shape)} vs pool {tuple(conv_pool.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w.contiguous()
    y = torch.empty(total, c, dtype=x.dtype, device=x.device)
    batch = cu_seqlens.numel() - 1
    if total and batch and max_t == 1 and ck >= 2:
        conv_step_kernel[(batch, triton.cdiv(c, STEP_BLOCK_C))](
            x, w, y, conv_pool, conv_pool if snapshots is None else snapshots, cu_seqlens, slots, snap_index, c,
            x.stride(0), CK=ck, BLOCK_C=STEP_BLOCK_C, num_warps=1, **pdl_kw(x.device, state=True))
    elif total and batch:
        # short verify steps need no 16-token tile; the tile never drops below ck-1 tokens, so programs past
        # token block 0 never read the pool rows that block 0 rewrites
        block_t = min(BLOCK_T, max(triton.next_power_of_2(max(max_t, 1)), triton.next_power_of_2(ck - 1)))
        n_tb = triton.cdiv(max_t, block_t)
        causal_conv_kernel[(batch * n_tb, triton.cdiv(c, BLOCK_C))](
            x, w, y, conv_pool, conv_pool if snapshots is None else snapshots, cu_seqlens, slots, snap_index,
            c, x.stride(0), n_tb, CK=ck, BLOCK_T=block_t, BLOCK_C=BLOCK_C, num_warps=4,
            **pdl_kw(x.device, state=True))
    return y


def compile_specs(act: str):
    sig = {"x_ptr": f"*{act}", "w_ptr": "*fp32", "y_ptr": f"*{act}", "pool_ptr": "*fp32", "snap_ptr": "*fp32",
           "cu_ptr": "*i32", "slot_ptr": "*i64", "snapidx_ptr": "*i64", "C": "i32", "sx_t": "i64",
           "n_tblocks": "i32"}
    step = {k: v for k, v in sig.items() if k != "n_tblocks"}
    return [(causal_conv_kernel, sig, {"CK": 4, "BLOCK_T": bt, "BLOCK_C": BLOCK_C}) for bt in (4, 8, BLOCK_T)] + \
        [(conv_step_kernel, step, {"CK": 4, "BLOCK_C": STEP_BLOCK_C}, 1)]
