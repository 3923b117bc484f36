"""The GDN causal conv + SiLU (reference §7.2) and the token-by-token gated delta rule (§7.6-8) in one kernel, for
the decode / verify steps: `gdn_conv.causal_conv` followed by `gdn_recurrent.gdn_recurrent`, with the same results
(the conv outputs are rounded to the activation dtype in between, as the two-kernel path stores them).

Why: in the decode step the conv is one more kernel between the q/k/v/z GEMV and the recurrence (~1.9 us of the
step's timeline per GDN layer on the H200, bench/NOTES.md §16); here each recurrence program convolves what it
reads itself, from the projection rows x and the slot's conv window.

One program per (sequence, value head h, tile of BLOCK_V value columns), as `gdn_recurrent`. It reads the conv
windows of the q and k channels of key head kh = h // REP and of its own v columns, keeps them in registers and
shifts them token by token, and writes the v columns' windows (after a CTA barrier behind its reads: the graph
runner's snapshot rows are pool rows, and a sequence's committed window can be one of its own snapshot rows).
The q / k windows are read by every program of the key head (REP value heads x n_vt tiles), so none of them may
write those: `conv_window_kernel` advances them afterwards (the Triton backend runs it as a side-stream branch of
a captured step, beside the next kernels: bench/NOTES.md §17 measured an arrival-counter handshake inside the
fused kernel, whose scalar atomic stalls every program for a round trip, as a loss).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .gdn_recurrent import TILES, delta_step, program_coords
from .ops_common import KernelInputError, pow2
from .pdl import pdl_enter, pdl_kw

FUSED_ENV = "NINFER_GDN_FUSED"
MAX_BLOCK_T = 16             # tokens per step of the window kernel's snapshot writer
WINDOW_BLOCK_C = 128         # channels per program of the window kernel (4 per thread of one warp)


@triton.jit
def _conv(xv, rows, ws, CK: tl.constexpr):
    """silu(sum_j ws[j] * window[j]) with window = rows (the CK - 1 previous inputs, oldest first) + xv."""
    acc = xv * ws[CK - 1]
    for j in tl.static_range(CK - 1):
        acc += rows[j] * ws[j]
    return acc * tl.sigmoid(acc)


@triton.jit
def _shift(rows, xv, CK: tl.constexpr):
    out = ()
    for j in tl.static_range(1, CK - 1):
        out = out + (rows[j],)
    return out + (xv,)


@triton.jit
def _load_window(pool_ptr, base, c, m, C, CK: tl.constexpr):
    rows = ()
    for j in tl.static_range(CK - 1):
        rows = rows + (tl.load(pool_ptr + base + j * C + c, mask=m, other=0.0),)
    return rows


@triton.jit
def _taps(w_ptr, c, m, CK: tl.constexpr):
    ws = ()
    for j in tl.static_range(CK):
        ws = ws + (tl.load(w_ptr + c * CK + j, mask=m, other=0.0).to(tl.float32),)
    return ws


@triton.jit
def _store_window(dst, rows, c, m, C, CK: tl.constexpr):
    for j in tl.static_range(CK - 1):
        tl.store(dst + j * C + c, rows[j], mask=m)


@triton.jit
def _x(x_ptr, tok, sx_t, c, m, live):
    """Token tok's inputs of channels c as fp32; not `live` (past the sequence): token 0's, never used."""
    return tl.load(x_ptr + tl.where(live, tok, 0) * sx_t + c, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _snapshots(x_ptr, csnap_ptr, s0, T, snap, sx_t, c, m, rows0, C, CK: tl.constexpr, BLOCK_T: tl.constexpr):
    """The windows after every token, BLOCK_T tokens per step (one round of loads, not one per token):
    window row j after token t is input t + 1 + j of [initial window (CK - 1 rows) | x rows]."""
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        mm = (t < T)[:, None] & m[None, :]
        dst = csnap_ptr + (snap + t).to(tl.int64)[:, None] * ((CK - 1) * C) + c[None, :]
        for j in tl.static_range(CK - 1):
            idx = t + 1 + j
            src = (s0 + idx - (CK - 1)).to(tl.int64)
            val = tl.load(x_ptr + src[:, None] * sx_t + c[None, :], mask=mm & (idx >= CK - 1)[:, None],
                          other=0.0).to(tl.float32)
            for r in tl.static_range(CK - 1):
                val = tl.where((idx == r)[:, None], rows0[r][None, :], val)
            tl.store(dst + j * C, val, mask=mm)


@triton.jit
def gdn_conv_recurrent_kernel(x_ptr, cw_ptr, g_ptr, beta_ptr, o_ptr, pool_ptr, snap_ptr, cpool_ptr, csnap_ptr,
                              cu_ptr, slot_ptr, snapidx_ptr, sx_t, Hv, Hk, REP, DK, DV, C, q_scale,
                              CK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                              PDL: tl.constexpr = 0):
    pdl_enter(PDL)   # ninfer_kernels.pdl: before any load or store
    b, h, kh, s0, T, snap, dk, dv, k_ok, v_ok = program_coords(cu_ptr, snapidx_ptr, REP, DK, DV, BLOCK_K, BLOCK_V)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    cq = kh * DK + dk
    ck = Hk * DK + cq
    cv = 2 * Hk * DK + h * DV + dv
    cbase = slot * ((CK - 1) * C)
    rq, rk, rv = (_load_window(cpool_ptr, cbase, cq, k_ok, C, CK), _load_window(cpool_ptr, cbase, ck, k_ok, C, CK),
                  _load_window(cpool_ptr, cbase, cv, v_ok, C, CK))
    wq, wk, wv = _taps(cw_ptr, cq, k_ok, CK), _taps(cw_ptr, ck, k_ok, CK), _taps(cw_ptr, cv, v_ok, CK)
    tile = dk[:, None] * DV + dv[None, :]
    tmask = k_ok[:, None] & v_ok[None, :]
    head_base = h.to(tl.int64) * DK * DV
    pool_off = slot * Hv * DK * DV + head_base
    S = tl.load(pool_ptr + pool_off + tile, mask=tmask, other=0.0)
    nq = _x(x_ptr, s0.to(tl.int64), sx_t, cq, k_ok, T > 0)        # x is never written here: read before the
    nk = _x(x_ptr, s0.to(tl.int64), sx_t, ck, k_ok, T > 0)        # barrier, in the same round as the windows
    nv = _x(x_ptr, s0.to(tl.int64), sx_t, cv, v_ok, T > 0)
    tl.debug_barrier()             # this CTA's v windows are read before it writes any row (pool rows can alias)
    act = o_ptr.dtype.element_ty
    for i in range(0, T):
        tok = (s0 + i).to(tl.int64)
        xq, xk, xv = nq, nk, nv
        live = i + 1 < T                                   # the next token's inputs, one token ahead
        nq = _x(x_ptr, tok + 1, sx_t, cq, k_ok, live)
        nk = _x(x_ptr, tok + 1, sx_t, ck, k_ok, live)
        nv = _x(x_ptr, tok + 1, sx_t, cv, v_ok, live)
        q = _conv(xq, rq, wq, CK).to(act).to(tl.float32)
        k = _conv(xk, rk, wk, CK).to(act).to(tl.float32)
        v = _conv(xv, rv, wv, CK).to(act).to(tl.float32)
        rq, rk, rv = _shift(rq, xq, CK), _shift(rk, xk, CK), _shift(rv, xv, CK)
        g = tl.load(g_ptr + tok * Hv + h)
        beta = tl.load(beta_ptr + tok * Hv + h)
        S, o = delta_step(S, q, k, v, g, beta, q_scale)
        tl.store(o_ptr + (tok * Hv + h) * DV + dv, o.to(act), mask=v_ok)
        if snap >= 0:
            tl.store(snap_ptr + (snap + i).to(tl.int64) * Hv * DK * DV + head_base + tile, S, mask=tmask)
            _store_window(csnap_ptr + (snap + i).to(tl.int64) * ((CK - 1) * C), rv, cv, v_ok, C, CK)
    if snap < 0:
        tl.store(pool_ptr + pool_off + tile, S, mask=tmask)
        _store_window(cpool_ptr + cbase, rv, cv, v_ok, C, CK)


@triton.jit
def conv_window_kernel(x_ptr, pool_ptr, snap_ptr, cu_ptr, slot_ptr, snapidx_ptr, C, n_ch, sx_t,
                       CK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = 0):
    """Advance the conv windows of channels 0 .. n_ch-1 by each sequence's inputs: the window after the last token
    into the slot (snap_index < 0) or after every token into the snapshot rows; no conv output."""
    pdl_enter(PDL)   # ninfer_kernels.pdl: before any load or store
    b = tl.program_id(0)
    s0 = tl.load(cu_ptr + b)
    T = tl.load(cu_ptr + b + 1) - s0
    snap = tl.load(snapidx_ptr + b)
    base = tl.load(slot_ptr + b).to(tl.int64) * ((CK - 1) * C)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = c < n_ch
    rows0 = _load_window(pool_ptr, base, c, m, C, CK)
    tl.debug_barrier()             # the old window is read before any row (the slot's, or one aliasing it) is written
    if snap >= 0:
        _snapshots(x_ptr, snap_ptr, s0, T, snap, sx_t, c, m, rows0, C, CK, BLOCK_T)
    else:
        for j in tl.static_range(CK - 1):
            idx = T + j                                   # position in [window (CK - 1 rows) | x rows]
            val = _x(x_ptr, (s0 + idx - (CK - 1)).to(tl.int64), sx_t, c, m, idx >= CK - 1)
            for r in tl.static_range(CK - 1):
                val = tl.where(idx == r, rows0[r], val)
            tl.store(pool_ptr + base + j * C + c, val, mask=m)


def fused_on() -> bool:
    """NINFER_GDN_FUSED: '1' runs decode / verify through these kernels, '0' (default: measured faster on the H200,
    bench/NOTES.md §18) through causal_conv + gdn_recurrent; anything else is a one-line error naming the variable."""
    v = os.environ.get(FUSED_ENV, "0")
    if v not in ("1", "0"):
        raise KernelInputError(f"{FUSED_ENV}={v!r}: expected 1 or 0")
    return v == "1"


def _block_t(max_t: int) -> int:
    return min(pow2(max(max_t, 1)), MAX_BLOCK_T)


def _checked(qkv, conv_w, conv_pool, g, beta, state_pool, conv_snaps, rec_snaps) -> tuple[int, int, int, int, int]:
    total, c = qkv.shape
    hv, dk, dv = state_pool.shape[1:]
    ck = conv_w.shape[-1]
    hk = (c - hv * dv) // (2 * dk) if dk else 0
    if conv_w.shape != (c, ck) or conv_pool.shape[1:] != (ck - 1, c) or hk <= 0 or 2 * hk * dk + hv * dv != c \
            or hv % hk or g.shape != (total, hv) or beta.shape != (total, hv) or ck < 2:
        raise KernelInputError(f"gdn_conv_recurrent: qkv {tuple(qkv.shape)} conv_w {tuple(conv_w.shape)} conv pool "
                               f"{tuple(conv_pool.shape)} state {tuple(state_pool.shape)} g {tuple(g.shape)}")
    for name, t, ref in (("conv pool", conv_pool, None), ("state pool", state_pool, None),
                         ("conv snapshots", conv_snaps, conv_pool), ("state snapshots", rec_snaps, state_pool)):
        if t is not None and (t.dtype != torch.float32 or not t.is_contiguous()
                              or (ref is not None and t.shape[1:] != ref.shape[1:])):
            raise KernelInputError(f"gdn_conv_recurrent: the {name} must be contiguous fp32 rows like the pool's")
    return hk, hv, dk, dv, ck


def conv_recurrent(qkv: torch.Tensor, conv_w: torch.Tensor, conv_pool: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, state_pool: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                   snap_index: torch.Tensor, conv_snaps: torch.Tensor | None = None,
                   rec_snaps: torch.Tensor | None = None, tile: tuple[int, int] | None = None) -> torch.Tensor:
    """qkv [sumT, C] (the q | k | v columns of the projection, C = 2 Hk dk + Hv dv; may be a row-strided view);
    conv_w [C, ck]; conv_pool fp32 [S, ck-1, C]; g, beta fp32 [sumT, Hv]; state_pool fp32 [S, Hv, dk, dv];
    cu_seqlens int32 [B+1]; slots, snap_index int64 [B]; conv_snaps / rec_snaps: the snapshot rows of each state
    when any snap_index >= 0; tile: (BLOCK_V, warps), default `gdn_recurrent.TILES[0]`. -> o [sumT, Hv, dv].
    Writes the recurrent states and the v columns' conv windows; the q / k windows are left for
    `advance_qk_windows`, which must run after it (and before anything reads them)."""
    hk, hv, dk, dv, ck = _checked(qkv, conv_w, conv_pool, g, beta, state_pool, conv_snaps, rec_snaps)
    total, c = qkv.shape
    batch = cu_seqlens.numel() - 1
    out = torch.empty(total, hv, dv, dtype=qkv.dtype, device=qkv.device)
    if not (total and batch):
        return out
    bv, warps = tile or TILES[0]
    x = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    gdn_conv_recurrent_kernel[(batch, hv, triton.cdiv(dv, bv))](
        x, conv_w.contiguous(), g.float().contiguous(), beta.float().contiguous(), out, state_pool,
        state_pool if rec_snaps is None else rec_snaps, conv_pool, conv_pool if conv_snaps is None else conv_snaps,
        cu_seqlens, slots, snap_index, x.stride(0), hv, hk, hv // hk, dk, dv, c, dk ** -0.5, CK=ck,
        BLOCK_K=pow2(dk), BLOCK_V=bv, num_warps=warps, **pdl_kw(x.device))
    return out


def advance_qk_windows(qkv: torch.Tensor, conv_pool: torch.Tensor, state_pool: torch.Tensor,
                       cu_seqlens: torch.Tensor, slots: torch.Tensor, snap_index: torch.Tensor,
                       conv_snaps: torch.Tensor | None = None, max_t: int = 1) -> None:
    """The q / k channels' conv windows (the first 2 Hk dk columns) advanced by the same inputs as `conv_recurrent`
    (run after it); max_t: the largest T_b (sizes the snapshot writer's token block)."""
    total, c = qkv.shape
    hv, dv = state_pool.shape[1], state_pool.shape[3]
    ck = conv_pool.shape[1] + 1
    batch = cu_seqlens.numel() - 1
    if not (total and batch):
        return
    x = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    n_ch = c - hv * dv
    conv_window_kernel[(batch, triton.cdiv(n_ch, WINDOW_BLOCK_C))](
        x, conv_pool, conv_pool if conv_snaps is None else conv_snaps, cu_seqlens, slots, snap_index, c, n_ch,
        x.stride(0), CK=ck, BLOCK_T=_block_t(max_t), BLOCK_C=WINDOW_BLOCK_C, num_warps=1, **pdl_kw(x.device))


def compile_specs(act: str):
    sig = {"x_ptr": f"*{act}", "cw_ptr": "*fp32", "g_ptr": "*fp32", "beta_ptr": "*fp32", "o_ptr": f"*{act}",
           "pool_ptr": "*fp32", "snap_ptr": "*fp32", "cpool_ptr": "*fp32", "csnap_ptr": "*fp32",
           "cu_ptr": "*i32", "slot_ptr": "*i64", "snapidx_ptr": "*i64", "sx_t": "i64", "Hv": "i32", "Hk": "i32",
           "REP": "i32", "DK": "i32", "DV": "i32", "C": "i32", "q_scale": "fp32"}
    win = {"x_ptr": f"*{act}", "pool_ptr": "*fp32", "snap_ptr": "*fp32", "cu_ptr": "*i32", "slot_ptr": "*i64",
           "snapidx_ptr": "*i64", "C": "i32", "n_ch": "i32", "sx_t": "i64"}
    return [(gdn_conv_recurrent_kernel, sig, {"CK": 4, "BLOCK_K": 128, "BLOCK_V": bv}, w) for bv, w in TILES[:1]] + \
        [(conv_window_kernel, win, {"CK": 4, "BLOCK_T": bt, "BLOCK_C": WINDOW_BLOCK_C}, 1) for bt in (1, 4, MAX_BLOCK_T)]
