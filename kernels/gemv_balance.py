"""Balanced ("stream-K") grids for the T = 1 packed-half2 GEMVs: k CTAs per SM share the work evenly.

Why: a decode GEMV's grid is row tiles x K splits, a few partial waves. Nsight Compute found every SM without a
CTA for 18-20 % of a lone launch (bench/NOTES.md §15): the ramp and the last partial wave (mlp_gate_up, 544 CTAs
of one split on 132 SMs: 16 SMs run a fifth while the rest idle). Here the grid is P = k x SMs CTAs (at most one
per unit) and the U = row tiles x K chunks units (a chunk: BLOCK_G groups) are taken in row-tile-major order, CTA
p holding units [p U / P, (p + 1) U / P): every CTA reads the same bytes to within one chunk. A row tile that one
CTA holds whole is stored directly; one that c CTAs share goes through split-K's workspace, a slot per CTA (its
rank among the c), and the last to arrive sums the c partials in rank order (reproducible for a given P).

NINFER_GEMV_BALANCE: "0" (default: off) or k in 1..16 CTAs per SM, for the launches of h2 configs at T = 1
without the SwiGLU epilogue (the config's split is then unused). A comparison switch until measured in the step.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from .gemv_common import split_arrive, split_partial, split_release, split_total, store_out
from .gemv_glu import _EPI_RES
from .pdl import pdl_trigger

BALANCE_ENV = "NINFER_GEMV_BALANCE"
MAX_PER_SM = 16


def balance_env_error() -> str | None:
    """None, or a one-line message when NINFER_GEMV_BALANCE is not 0 or a CTA count per SM in 1..16."""
    v = os.environ.get(BALANCE_ENV, "0") or "0"
    if v.isdigit() and 0 <= int(v) <= MAX_PER_SM:
        return None
    return f"{BALANCE_ENV}={v!r}: expected 0 (off) or CTAs per SM in 1..{MAX_PER_SM}"


def per_sm() -> int:
    """k of NINFER_GEMV_BALANCE (0: off; an invalid value, which the runtime refuses at start, counts as off)."""
    return 0 if balance_env_error() else int(os.environ.get(BALANCE_ENV, "0") or "0")


def grid(N: int, G: int, block_n: int, block_g: int, sms: int, k: int) -> tuple[int, int]:
    """(P, the most CTAs any row tile is shared by: the workspace slots needed) for k CTAs per SM."""
    nc = triton.cdiv(G, block_g)
    units = triton.cdiv(N, block_n) * nc
    p = max(1, min(units, k * sms))
    per = units // p            # every CTA holds at least this many units
    return p, min(p, 1 + triton.cdiv(nc - 1, per))


def owners(tile: int, nc: int, units: int, p: int) -> tuple[int, int]:
    """(first, last) CTA holding units of row tile `tile` (the host twin of `_owner`, for tests)."""
    return ((tile * nc + 1) * p - 1) // units, (((tile + 1) * nc) * p - 1) // units


@triton.jit
def _owner(a, units, P):
    """The CTA whose range [p U / P, (p + 1) U / P) holds unit a (P int64: the product needs 64 bits)."""
    return ((a + 1) * P - 1) // units


@triton.jit
def unit_range(units):
    """[u0, u1) of this CTA (int32; the products in int64)."""
    P = tl.num_programs(0).to(tl.int64)
    p = tl.program_id(0).to(tl.int64)
    return (p * units // P).to(tl.int32), ((p + 1) * units // P).to(tl.int32)


@triton.jit
def finish_shared(v, tile, nc, units, N, T, out_ptr, stride_ot, res_ptr, stride_rt, ws_ptr, cnt_ptr,
                  BLOCK_N: tl.constexpr, EPI: tl.constexpr, PDL: tl.constexpr):
    """v [BLOCK_N, 1] fp32, this CTA's part of row tile `tile`, -> out: stored when the CTA holds the whole
    tile, else through workspace slot (rank among the tile's CTAs) and the tile's counter."""
    tl.static_assert(EPI <= _EPI_RES)
    pdl_trigger(PDL)
    P = tl.num_programs(0).to(tl.int64)
    first = _owner(tile * nc, units, P)
    count = (_owner((tile + 1) * nc - 1, units, P) - first + 1).to(tl.int32)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    cols = tl.arange(0, 1)[None, :]
    m = (rows < N) & (cols < T)
    if count == 1:
        store_out(v, cols, rows, m, out_ptr, stride_ot, res_ptr, stride_rt, EPI)
    else:
        split_partial(v, cols, rows, m, N, T, ws_ptr, (tl.program_id(0) - first).to(tl.int32))
        if split_arrive(cnt_ptr, tile, count):
            store_out(split_total(cols, rows, m, N, T, count, ws_ptr), cols, rows, m, out_ptr, stride_ot,
                      res_ptr, stride_rt, EPI)
            split_release(cnt_ptr, tile)
