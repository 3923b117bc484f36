"""Token-by-token gated delta rule (reference §7.6-8) for decode / MTP verify, with snapshot rows (§12).

One program per (sequence, value head, tile of BLOCK_V value columns) keeps its fp32 state tile
S [dk, BLOCK_V] in registers across the sequence's T new tokens. Per token: q, k are l2-normalised in fp32
(eps 1e-6 inside the rsqrt; q also scaled by dk^-0.5), then
    S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q.
Value head h reads key head h // (Hv / Hk) (GVA). snap_index[b] >= 0: S after token t goes to snapshot row
snap + t and the pool slot is left alone; otherwise the pool slot is updated in place at the end.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import gemv_timing
from .ops_common import KernelInputError, interpreting, pow2
from .pdl import pdl_kw, pdl_trigger, pdl_wait

# (value columns per program, warps). With T > 1 each token's four reductions over dk chain on the previous token's
# state, and a reduction that spans warps goes through shared memory and a CTA barrier; one warp per 16 columns
# reduces inside the warp. bench/gdn_tiles.py on the H200 (27B sizes, graph-timed, bench/NOTES.md §15): 16x1 is
# the fastest tile at every T (T = 1 5.55 vs 5.78 us for 32x4, T = 4 11.28 vs 13.00, T = 8 18.40 vs 22.15), so it
# is first: the default ("first") runs it. NINFER_GDN_TILES=time: the first launch per (T bucket, head sizes) on
# a CUDA device times the tiles on scratch copies of the states (`_pick`) and keeps another only when MARGIN faster.
# 4x1 was dropped: the slowest tile at every T there (1.4-2.4x 16x1), and 16 bytes of register spills on sm_70.
TILES = ((16, 1), (32, 4), (8, 1))
TILES_ENV = "NINFER_GDN_TILES"
MARGIN = 0.05                 # another tile replaces the first only when this much faster
_PICKED: dict = {}
TIMINGS: dict = {}      # key -> us per launch of each tile, as `_pick` measured them (benchmarks report them)


@triton.jit
def _token_inputs(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tok, live, kh, h, dk, dv, k_ok, v_ok, sq_t, sq_h, sk_t,
                  sk_h, sv_t, sv_h, Hv):
    """Token `tok`'s q, k (key head kh), v (value head h, this program's columns), g and beta, as fp32. Not
    `live` (past a sequence's tokens): token 0's, which every launch has (the caller never uses them)."""
    tok = tl.where(live, tok, 0)
    q = tl.load(q_ptr + tok * sq_t + kh * sq_h + dk, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + tok * sk_t + kh * sk_h + dk, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + tok * sv_t + h * sv_h + dv, mask=v_ok, other=0.0).to(tl.float32)
    return q, k, v, tl.load(g_ptr + tok * Hv + h), tl.load(beta_ptr + tok * Hv + h)


@triton.jit
def program_coords(cu_ptr, snapidx_ptr, REP, DK, DV, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """This program's sequence b (first packed row s0, T new tokens, snapshot row snap), value head h and its key
    head kh, and its dk / dv index vectors with their masks."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s0 = tl.load(cu_ptr + b)
    T = tl.load(cu_ptr + b + 1) - s0
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    return b, h, h // REP, s0, T, tl.load(snapidx_ptr + b), dk, dv, dk < DK, dv < DV


@triton.jit
def _state_tile(pool_ptr, cu_ptr, slot_ptr, snapidx_ptr, Hv, REP, DK, DV, BLOCK_K: tl.constexpr,
                BLOCK_V: tl.constexpr):
    """`program_coords`, the state tile's offsets (tile, its mask, the head's base, the slot's offset) and the
    tile S itself, loaded from the pool: nothing here is written by the kernels in front of this one in a step."""
    b, h, kh, s0, T, snap, dk, dv, k_ok, v_ok = program_coords(cu_ptr, snapidx_ptr, REP, DK, DV, BLOCK_K, BLOCK_V)
    tile = dk[:, None] * DV + dv[None, :]
    tmask = k_ok[:, None] & v_ok[None, :]
    head_base = h.to(tl.int64) * DK * DV
    pool_off = tl.load(slot_ptr + b).to(tl.int64) * Hv * DK * DV + head_base
    S = tl.load(pool_ptr + pool_off + tile, mask=tmask, other=0.0)
    return b, h, kh, s0, T, snap, dk, dv, k_ok, v_ok, tile, tmask, head_base, pool_off, S


@triton.jit
def delta_step(S, q, k, v, g, beta, q_scale):
    """One token on this program's fp32 state tile S [dk, BLOCK_V]: q, k l2-normalised (q also scaled), then
    S = exp(g) S; S += k (beta (v - S^T k))^T. -> (S, o = S^T q).
    Both reductions of S over dk read the state from before the token, so they do not wait for each other:
    with d = beta (v - exp(g) S^T k), the new state's S'^T q = exp(g) S^T q + d (k . q). One reduction round
    per token on the chain that links a verify step's tokens instead of two; the norms' scalars are applied to the
    sums, not to the vectors, so they wait for nothing either."""
    rq = tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
    rk = tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    kq = tl.sum(k * q, axis=0)
    sk = tl.sum(S * k[:, None], axis=0)
    sq = tl.sum(S * q[:, None], axis=0)
    eg = tl.exp(g)
    delta = beta * (v - (eg * rk) * sk)
    o = (eg * rq) * sq + delta * (rk * rq * kq)
    return S * eg + (k * rk)[:, None] * delta[None, :], o


@triton.jit
def gdn_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, pool_ptr, snap_ptr,
                         cu_ptr, slot_ptr, snapidx_ptr,
                         sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, Hv, REP, DK, DV, q_scale,
                         BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr = 0,
                         PRELOAD: tl.constexpr = 0, LATE: tl.constexpr = 0):
    # ninfer_kernels.pdl: with PRELOAD (NINFER_PDL_STATE) the state tile, the one DRAM read on this kernel's
    # path, is in flight while the conv in front runs; the token inputs, which that conv and the gates write,
    # are loaded after the wait either way; LATE (NINFER_PDL_LATE): the trigger follows the token loop
    if not LATE:
        pdl_trigger(PDL)
    if PRELOAD:
        b, h, kh, s0, T, snap, dk, dv, k_ok, v_ok, tile, tmask, head_base, pool_off, S = _state_tile(
            pool_ptr, cu_ptr, slot_ptr, snapidx_ptr, Hv, REP, DK, DV, BLOCK_K, BLOCK_V)
    pdl_wait(PDL)
    if not PRELOAD:
        b, h, kh, s0, T, snap, dk, dv, k_ok, v_ok, tile, tmask, head_base, pool_off, S = _state_tile(
            pool_ptr, cu_ptr, slot_ptr, snapidx_ptr, Hv, REP, DK, DV, BLOCK_K, BLOCK_V)
    # every input of a token is loaded one token ahead: with T > 1 (MTP verify) the next token's memory round
    # trip overlaps this token's reductions instead of following them
    nxt = _token_inputs(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0.to(tl.int64), T > 0, kh, h, dk, dv, k_ok, v_ok,
                        sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, Hv)
    for i in range(0, T):
        tok = (s0 + i).to(tl.int64)
        q, k, v, g, beta = nxt
        ahead = (s0 + i + 1).to(tl.int64)                        # not live past the last token
        nxt = _token_inputs(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, ahead, i + 1 < T, kh, h, dk, dv, k_ok, v_ok,
                            sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, Hv)
        S, o = delta_step(S, q, k, v, g, beta, q_scale)
        tl.store(o_ptr + (tok * Hv + h) * DV + dv, o.to(o_ptr.dtype.element_ty), mask=v_ok)
        if snap >= 0:
            tl.store(snap_ptr + (snap + i).to(tl.int64) * Hv * DK * DV + head_base + tile, S, mask=tmask)
    if LATE:
        pdl_trigger(PDL)
    if snap < 0:
        tl.store(pool_ptr + pool_off + tile, S, mask=tmask)


def _timing_on() -> bool:
    mode = os.environ.get(TILES_ENV, "first")
    if mode not in ("first", "time"):
        raise KernelInputError(f"{TILES_ENV}={mode!r}: expected 'first' or 'time'")
    return mode == "time"


def _pick(key, launch, state_pool, snapshots) -> tuple[int, int]:
    """The fastest of TILES for `key` (the first unless another is MARGIN faster), timed once on copies of the
    states the kernel writes; the first tile without CUDA, under the interpreter or while capturing."""
    if key in _PICKED:
        return _PICKED[key]
    dev = state_pool.device
    if not _timing_on() or interpreting() or dev.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return TILES[0]
    pool = state_pool.clone()
    same = snapshots is None or snapshots.data_ptr() == state_pool.data_ptr()   # the graph runner's pool rows
    snaps = pool if same else snapshots.clone()
    # inside a CUDA graph with the L2 flushed, as a decode step runs it (timing eager launches measured the
    # ~40 us of Python per launch and picked by noise: verify K=3 8.49 -> 9.05 ms in s13)
    times = [gemv_timing.time_ms(lambda tile=tile: launch(tile, pool, snaps)) * 1e3 for tile in TILES]
    TIMINGS[key] = [round(t, 2) for t in times]
    best = min(range(len(TILES)), key=times.__getitem__)
    _PICKED[key] = TILES[best] if times[best] < (1 - MARGIN) * times[0] else TILES[0]
    return _PICKED[key]


def gdn_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state_pool: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                  snap_index: torch.Tensor, snapshots: torch.Tensor | None = None,
                  max_t: int = 1, tile: tuple[int, int] | None = None) -> torch.Tensor:
    """q, k [sumT, Hk, dk]; v [sumT, Hv, dv]; g, beta fp32 [sumT, Hv]; state_pool fp32 [S, Hv, dk, dv];
    cu_seqlens int32 [B+1]; slots, snap_index int64 [B]; snapshots fp32 [N, Hv, dk, dv]; max_t: the largest
    T_b (keys the tile choice); tile: one of TILES instead of the choice (tests, benchmarks). -> o [sumT, Hv, dv]."""
    total, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != total or hv % hk or state_pool.shape[1:] != (hv, dk, dv):
        raise KernelInputError(f"gdn_recurrent: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"state {tuple(state_pool.shape)}")
    if not state_pool.is_contiguous() or state_pool.dtype != torch.float32:
        raise KernelInputError("gdn_recurrent: the state pool must be contiguous fp32")
    if snapshots is not None and (snapshots.shape[1:] != state_pool.shape[1:] or not snapshots.is_contiguous()):
        raise KernelInputError(f"gdn_recurrent: snapshots {tuple(snapshots.shape)} vs state {tuple(state_pool.shape)}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    out = torch.empty(total, hv, dv, dtype=v.dtype, device=v.device)
    batch = cu_seqlens.numel() - 1
    if not (total and batch):
        return out

    def launch(tile, pool, snaps):
        bv, w = tile
        gdn_recurrent_kernel[(batch, hv, triton.cdiv(dv, bv))](
            q, k, v, g, beta, out, pool, pool if snaps is None else snaps, cu_seqlens, slots, snap_index,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), hv, hv // hk, dk, dv,
            dk ** -0.5, BLOCK_K=pow2(dk), BLOCK_V=bv, num_warps=w, **pdl_kw(q.device, state=True, late="recurrence"))

    if tile is None:
        # prefill chunks (the fallback without flash-linear-attention) share one key
        key = (min(pow2(max_t), 16), hv, hk, dk, dv, str(state_pool.device))
        tile = _pick(key, launch, state_pool, snapshots)
    elif tile not in TILES:
        raise KernelInputError(f"gdn_recurrent: tile {tile!r} is not one of {TILES}")
    launch(tile, state_pool, snapshots)
    return out


def picks() -> dict:
    """What the timed choice decided so far: {T bucket: {"picked": "columns x warps", "us": {tile: us}}} (one
    head shape per process in the benchmarks that report it)."""
    name = lambda t: f"{t[0]}x{t[1]}"   # noqa: E731
    return {str(k[0]): {"picked": name(v), "us": dict(zip(map(name, TILES), TIMINGS.get(k, ())))}
            for k, v in sorted(_PICKED.items())}


def compile_specs(act: str):
    sig = {"q_ptr": f"*{act}", "k_ptr": f"*{act}", "v_ptr": f"*{act}", "g_ptr": "*fp32", "beta_ptr": "*fp32",
           "o_ptr": f"*{act}", "pool_ptr": "*fp32", "snap_ptr": "*fp32", "cu_ptr": "*i32", "slot_ptr": "*i64",
           "snapidx_ptr": "*i64", **{n: "i64" for n in ("sq_t", "sq_h", "sk_t", "sk_h", "sv_t", "sv_h")},
           "Hv": "i32", "REP": "i32", "DK": "i32", "DV": "i32", "q_scale": "fp32"}
    return [(gdn_recurrent_kernel, sig, {"BLOCK_K": 128, "BLOCK_V": bv, "LATE": 0}, w) for bv, w in TILES] + \
        [(gdn_recurrent_kernel, sig, {"BLOCK_K": 128, "BLOCK_V": TILES[0][0], "LATE": 1}, TILES[0][1])]
