"""Balanced (stream-K) grids of the T = 1 packed-half2 GEMVs (kernels/gemv_balance.py, NINFER_GEMV_BALANCE).

The unit split is checked exhaustively on the host; the kernels (interpreter on CPU, PTX with CUDA) against the
codec references at shapes where CTAs span several row tiles, where row tiles are shared by several CTAs, and
with a ragged last tile and K chunk.
"""
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gemv_inputs import nvfp4_weights, rel_l2, wide_range_x  # noqa: E402
from ninfer_formats import codecs  # noqa: E402
from ninfer_kernels import gemv_balance as gb  # noqa: E402
from ninfer_kernels import gemv_launch as gl  # noqa: E402
from ninfer_kernels import reference  # noqa: E402
from ninfer_kernels.gemv_launch import GemvConfig, interpreting, workspace  # noqa: E402
from ninfer_kernels.gemv_nvfp4 import gemv_nvfp4, gemv_nvfp4_prepared, repack_nvfp4  # noqa: E402
from ninfer_kernels.gemv_q6_k import gemv_q6_k, repack_q6_k  # noqa: E402
from ninfer_kernels.x16 import x16_prep  # noqa: E402

RTOL_H2 = 2e-3       # fp32 output (as test_kernels_gemv_h2)
RTOL_HALF = 1e-2     # bf16 / f16 output: its rounding dominates
DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"


@pytest.mark.parametrize("N,G,bn,bg,sms,k", [(37, 11, 8, 4, 8, 1), (200, 96, 32, 8, 8, 3), (7, 2, 8, 1, 4, 16),
                                             (5120, 320, 64, 16, 132, 4), (248320, 320, 32, 16, 132, 16)],
                         ids=["ragged", "cta-spans-tiles", "more-ctas-than-units", "gate-up-like", "lm-head-like"])
def test_units_are_split_evenly_and_owned_once(N, G, bn, bg, sms, k):
    p, slots = gb.grid(N, G, bn, bg, sms, k)
    nc, tiles = -(-G // bg), -(-N // bn)
    units = tiles * nc
    assert p == min(units, k * sms)
    bounds = [c * units // p for c in range(p + 1)]
    sizes = np.diff(bounds)
    assert sizes.min() >= units // p and sizes.max() - sizes.min() <= 1     # even to within one chunk
    owner = np.repeat(np.arange(p), sizes)                                  # every unit exactly once
    for t in {0, tiles // 2, tiles - 1}:
        first, last = gb.owners(t, nc, units, p)
        held = owner[t * nc:(t + 1) * nc]
        assert (first, last) == (held[0], held[-1])
        assert last - first + 1 <= slots


def test_balance_switch_values(monkeypatch):
    for v, k in (("", 0), ("0", 0), ("4", 4), ("16", 16)):
        monkeypatch.setenv(gb.BALANCE_ENV, v)
        assert gb.balance_env_error() is None and gb.per_sm() == k
    for v in ("17", "-1", "x", "2.5"):
        monkeypatch.setenv(gb.BALANCE_ENV, v)
        err = gb.balance_env_error()
        assert err.startswith(f"{gb.BALANCE_ENV}={v!r}") and "\n" not in err and gb.per_sm() == 0


def _nvfp4(N, K, seed, prepared):
    codes, scales, gs = nvfp4_weights(N, K, seed, DEV)
    w = repack_nvfp4(codes, scales)
    if prepared:
        run = lambda x, out, res, cfg: gemv_nvfp4_prepared(x16_prep(x), w, gs, out, res, config=cfg)  # noqa: E731
    else:
        run = lambda x, out, res, cfg: gemv_nvfp4(x, w, gs, out, res, config=cfg)  # noqa: E731
    return run, lambda x, res: reference.ref_nvfp4(x, codes, scales, gs, residual=res)


def _q6_k(N, K, seed, prepared):
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05
    blocks = torch.from_numpy(codecs.quantize("q6_k", w)).to(DEV)
    packed = repack_q6_k(blocks, K)
    return (lambda x, out, res, cfg: gemv_q6_k(x, packed, out, res, config=cfg),
            lambda x, res: reference.ref_q6_k(x, blocks, residual=res))


CASES = {  # format, dtype, N, K, GemvConfig(block_n, block_g, warps, stages), CTAs per SM, residual, prepared
    "nvfp4-bf16-spans-tiles": ("nvfp4", torch.bfloat16, 77, 1536, GemvConfig(16, 8, 2, 1, h2=True), 1, False, False),
    "nvfp4-f32-shared-tiles-res": ("nvfp4", torch.float32, 37, 512, GemvConfig(32, 4, 2, 1, h2=True), 16, True,
                                   False),
    "nvfp4-f16-ragged-g-stages": ("nvfp4", torch.float16, 45, 176, GemvConfig(16, 4, 2, 3, h2=True), 2, False,
                                  False),
    "nvfp4-bf16-prepared-res": ("nvfp4", torch.bfloat16, 61, 1024, GemvConfig(32, 16, 2, 1, h2=True), 3, True, True),
    "q6_k-bf16-spans-tiles": ("q6_k", torch.bfloat16, 53, 768, GemvConfig(16, 4, 2, 1, h2=True), 1, False, False),
    "q6_k-f32-shared-tiles-res": ("q6_k", torch.float32, 29, 512, GemvConfig(32, 8, 2, 1, h2=True), 16, True, False),
    # 16 row tiles x 20 chunks over 132 SMs: CTAs hold 2-3 units across tile edges (the interpreter: 8 "SMs")
    "nvfp4-bf16-27b-k-gpu": ("nvfp4", torch.bfloat16, 1000, 5120, GemvConfig(64, 16, 4, 1, h2=True), 1, True, True),
}
GPU_ONLY = {"nvfp4-bf16-27b-k-gpu"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.skipif(c in GPU_ONLY and DEV == "cpu",
                                                                           reason="27B-sized K: GPU only"))
                                  for c in CASES])
def test_balanced_matches_reference(case, monkeypatch):
    fmt, dtype, N, K, cfg, k, has_res, prepared = CASES[case]
    monkeypatch.setenv(gb.BALANCE_ENV, str(k))
    run, ref_fn = (_nvfp4 if fmt == "nvfp4" else _q6_k)(N, K, seed=N + K, prepared=prepared)
    x = wide_range_x(1, K, seed=K)
    x = (x.clamp(-6e4, 6e4) if dtype == torch.float16 else x).to(dtype).to(DEV)
    res = torch.randn(1, N).to(dtype).to(DEV) if has_res else None
    out = torch.full((1, N), float("nan"), dtype=dtype, device=DEV)
    seen = []
    real = gl._balanced_grid
    monkeypatch.setattr(gl, "_balanced_grid", lambda *a: seen.append(real(*a)) or seen[-1])
    y = run(x, out, res, cfg)
    p, slots = gb.grid(N, K // 16, cfg.block_n, cfg.block_g, gl.sm_count(x.device), k)
    assert seen and seen[0][0] == (p, 1, 1)                       # the balanced grid was launched
    assert y is out and torch.isfinite(y).all()
    assert rel_l2(y, ref_fn(x, res)) < (RTOL_H2 if dtype == torch.float32 else RTOL_HALF)
    assert torch.equal(run(x, torch.full_like(out, float("nan")), res, cfg), y)   # deterministic for one grid
    assert int(workspace(x.device, 0, 0)[1].abs().sum()) == 0     # every counter back at zero


def test_balance_off_and_other_launches_keep_the_plain_grid(monkeypatch):
    """T > 1, the SwiGLU epilogue's launches and NINFER_GEMV_BALANCE=0 use the row-tile x split grid."""
    N, K = 37, 512
    run, ref_fn = _nvfp4(N, K, seed=3, prepared=False)
    called = []
    monkeypatch.setattr(gl, "_balanced_grid", lambda *a: called.append(a))
    monkeypatch.setenv(gb.BALANCE_ENV, "0")
    x = torch.randn(1, K).to(DEV)
    assert rel_l2(run(x, None, None, GemvConfig(16, 4, 2, 1, split=2, h2=True)), ref_fn(x, None)) < RTOL_H2
    monkeypatch.setenv(gb.BALANCE_ENV, "4")
    x2 = torch.randn(2, K).to(DEV)
    assert rel_l2(run(x2, None, None, GemvConfig(16, 4, 2, 1, h2=True)), ref_fn(x2, None)) < RTOL_H2
    assert not called
