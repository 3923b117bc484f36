"""The GDN recurrence's tiles and the graph runner's row layout at the kernel level: every tile the first launch
may pick against the reference, the tile mode's check, bench/gdn_tiles.py on the interpreter, and conv window /
recurrent state read from a row of the snapshot span the same launch writes (`ninfer_rt.graphs`). Helpers and
tolerances are test_kernels_ops.py's (which sets TRITON_INTERPRET on a CPU box before any kernel import)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from test_kernels_ops import (CK, DEV, DK, DTYPES, DV, HV, REF, TOL, TRI, C, _gdn_inputs, _gdn_meta, check,
                              poisoned, rnd)

from ninfer_kernels import gdn_recurrent
from ninfer_kernels.ops_common import KernelInputError
from numerics import rel


@pytest.mark.parametrize("tile", [pytest.param(t, id=f"v{t[0]}-w{t[1]}") for t in gdn_recurrent.TILES])
def test_gdn_recurrent_every_tile(tile):
    """Every tile the first launch may pick (`gdn_recurrent._pick`) against the reference, verify rows."""
    meta, n_snap = _gdn_meta((3, 1), (True, False), slots=(0, 2))
    args = _gdn_inputs(4, torch.float32, seed=11)
    pool = rnd(3, HV, DK, DV, seed=7, scale=0.3)
    snaps = torch.full((n_snap, HV, DK, DV), float("nan"), device=DEV)
    want_pool, want_snaps = pool.clone(), snaps.clone()
    want = REF.gdn_recurrent(*args, want_pool, meta, want_snaps)
    with poisoned():
        got = gdn_recurrent.gdn_recurrent(*args, pool, meta.cu_seqlens, meta.slots, meta.snap_index, snaps,
                                          max_t=3, tile=tile)
    check(got, want, torch.float32)
    assert rel(pool, want_pool) <= TOL[torch.float32] and rel(snaps, want_snaps) <= TOL[torch.float32]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU check of the script; on a GPU the benchmark runs")
def test_bench_gdn_tiles_smoke(tmp_path):
    """bench/gdn_tiles.py end to end on the interpreter: a record per (T, tile) with the named fields."""
    from bench_smoke import bench_smoke
    recs, _ = bench_smoke("gdn_tiles.py", tmp_path, "--T", "1", "3")
    assert [(r["T"], r["tile"]) for r in recs] == [(t, f"{a}x{b}") for t in (1, 3) for a, b in gdn_recurrent.TILES]
    for r in recs:
        assert r["us"] > 0 and r["picked"] == "16x1" and {"gbps", "pct_copy_bw", "copy_tbps", "gpu"} <= set(r)


def test_gdn_recurrent_tile_mode_is_checked(monkeypatch):
    """NINFER_GDN_TILES takes 'first' (default) or 'time'; anything else is a one-line error naming it."""
    monkeypatch.setenv(gdn_recurrent.TILES_ENV, "fast")
    meta, _ = _gdn_meta((1,), (False,), slots=(0,))
    with pytest.raises(KernelInputError, match="NINFER_GDN_TILES='fast'"):
        TRI.gdn_recurrent(*_gdn_inputs(1, torch.float32, seed=12), rnd(1, HV, DK, DV, seed=7), meta)


def test_gdn_recurrent_rejects_an_unknown_tile():
    meta, _ = _gdn_meta((1,), (False,), slots=(0,))
    with pytest.raises(KernelInputError, match=r"tile \(64, 4\) is not one of"):
        gdn_recurrent.gdn_recurrent(*_gdn_inputs(1, torch.float32, seed=12), rnd(1, HV, DK, DV, seed=7),
                                    meta.cu_seqlens, meta.slots, meta.snap_index, tile=(64, 4))


def _own_rows_meta(base: int):
    """Two verifies of 3 tokens whose snapshot rows are pool rows base.. and whose states are rows of their own
    spans (the graph runner after a commit without copy, `ninfer_rt.graphs`)."""
    meta, _ = _gdn_meta((3, 3), (True, True), slots=(base + 1, base + 5))
    return dataclasses.replace(meta, snap_index=torch.tensor([base, base + 3], device=DEV),
                               snap_index_host=(base, base + 3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_state_read_from_its_own_snapshot_rows(dtype):
    """Conv window and recurrent state are read before any row of the span holding them is written."""
    meta = _own_rows_meta(2)
    x, w = rnd(6, C, dtype=dtype), rnd(C, CK, seed=1, scale=0.5)
    conv = rnd(8, CK - 1, C, seed=2)
    want_conv = conv.clone()
    want = REF.causal_conv(x, w, want_conv, meta, want_conv)
    with poisoned():
        got = TRI.causal_conv(x, w, conv, meta, conv)
    check(got, want, dtype)
    assert torch.allclose(conv, want_conv, rtol=1e-5, atol=1e-6)
    args = _gdn_inputs(6, dtype, seed=9)
    rec = rnd(8, HV, DK, DV, seed=7, scale=0.3)
    want_rec = rec.clone()
    want = REF.gdn_recurrent(*args, want_rec, meta, want_rec)
    with poisoned():
        got = TRI.gdn_recurrent(*args, rec, meta, rec)
    check(got, want, dtype)
    assert rel(rec, want_rec) <= TOL[torch.float32]
