"""The stream-K GEMV grid (kernels/gemv_stream.py, GemvConfig.persist) of the h2 and warp-MMA variants.

The partition is checked on the host against a brute-force owner table; the kernels run in the interpreter (on
CPU; the PTX paths with CUDA) with a faked SM count, so that one CTA's units span several row blocks, a row block
is shared by up to four CTAs, and the grid is capped by the number of units. Outputs are NaN-poisoned, results
deterministic, the arrival counters back at zero.
"""
import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gemv_inputs import as_h200, ggml_mma, nvfp4_mma, rel_l2, wide_range_x  # noqa: E402
from ninfer_kernels import gemv_launch as gl  # noqa: E402
from ninfer_kernels import reference  # noqa: E402
from ninfer_kernels.gemv_iq3_s import gemv_iq3_s, iq3_s_gemv_kernel, repack_iq3_s  # noqa: E402
from ninfer_kernels.gemv_launch import GemvConfig, KernelInputError, interpreting, workspace  # noqa: E402
from ninfer_kernels.gemv_nvfp4 import gemv_nvfp4_prepared, nvfp4_gemv_kernel, repack_nvfp4  # noqa: E402
from ninfer_kernels.gemv_q6_k import gemv_q6_k, q6_k_gemv_kernel, repack_q6_k  # noqa: E402
from ninfer_kernels.gemv_stream import (MAX_SEGS, PERSIST_CAP, max_parts, max_segments, resident_ctas,  # noqa: E402
                                        stream_ctas, with_mode)
from ninfer_kernels.x16 import x16_prep  # noqa: E402

RTOL_F32 = 2e-3      # fp32 output: activations rounded to f16, f16 block sums (h2)
RTOL_HALF = 1e-2     # bf16/f16 output: the output rounding dominates
DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
GPU_MMA = DEV == "cpu" or torch.cuda.get_device_capability() >= (8, 0)


def _owners(R: int, C: int, P: int) -> list[int]:
    """The CTA of every unit, by the definition: CTA p takes units [p W / P, (p + 1) W / P)."""
    W = R * C
    return [p for p in range(P) for _ in range(p * W // P, (p + 1) * W // P)]


@pytest.mark.parametrize("R,C,P", [(3, 3, 8), (3, 3, 2), (40, 24, 528), (1, 5, 5), (7, 1, 3), (136, 20, 528),
                                   (5, 48, 16), (1940, 20, 528)])
def test_partition_matches_brute_force(R, C, P):
    own = _owners(R, C, P)
    assert len(own) == R * C and sorted(set(own)) == list(range(P))   # every CTA has a unit
    parts = max(len(set(own[r * C:(r + 1) * C])) for r in range(R))
    assert max_parts(R, C, P) == parts
    segs = max(len({u // C for u, o in enumerate(own) if o == p}) for p in range(P))
    assert max_segments(R, C, P) == segs
    assert stream_ctas(R, C, 4, 132) == min(528, R * C)


@pytest.mark.parametrize("regs,warps,shared,want", [(127, 4, 0, 4), (96, 4, 0, 5), (64, 4, 0, 8), (40, 4, 0, 12),
                                                    (32, 4, 0, 16), (168, 8, 0, 1), (64, 4, 60000, 3)],
                         ids=["h2-127", "h2-96", "64-regs", "40-regs", "thread-limit", "168-regs-8-warps", "smem"])
def test_resident_ctas(regs, warps, shared, want):
    props = SimpleNamespace(max_threads_per_multi_processor=2048, shared_memory_per_multiprocessor=233472)
    assert resident_ctas(regs, warps, shared, props) == want


def _q6_k(dev):
    return ggml_mma("q6_k", gemv_q6_k, repack_q6_k, reference.ref_q6_k, dev)


def _iq3_s(dev):
    return ggml_mma("iq3_s", gemv_iq3_s, repack_iq3_s, reference.ref_iq3_s, dev)


CASES = {  # maker, T, dtype, N, K, GemvConfig, faked SMs, residual
    "nvfp4-h2-T1-rows-span-ctas": (nvfp4_mma, 1, torch.bfloat16, 37, 176, GemvConfig(16, 4, 4, 1, h2=True, persist=1),
                                   2, True),
    "nvfp4-h2-T1-four-share-a-row": (nvfp4_mma, 1, torch.float32, 37, 256, GemvConfig(16, 4, 4, 1, h2=True, persist=2),
                                     5, False),
    "nvfp4-h2-T3-capped-grid": (nvfp4_mma, 3, torch.float16, 19, 96, GemvConfig(16, 2, 4, 1, h2=True, persist=8), 8,
                                True),
    "q6_k-h2-T2-ragged": (_q6_k, 2, torch.bfloat16, 37, 768, GemvConfig(16, 4, 4, 1, h2=True, persist=1), 3, True),
    "nvfp4-mma-T4-prefetch": (nvfp4_mma, 4, torch.bfloat16, 37, 512, GemvConfig(32, 8, 2, 2, mma=True, persist=1), 3,
                              True),
    "nvfp4-mma-T8-triple": (nvfp4_mma, 8, torch.float32, 70, 768, GemvConfig(64, 8, 2, 3, mma=True, persist=2), 2,
                            False),
    "q6_k-mma-T3": (_q6_k, 3, torch.float16, 37, 512, GemvConfig(32, 8, 2, 1, mma=True, persist=1), 5, True),
    "iq3_s-mma-T2": (_iq3_s, 2, torch.bfloat16, 19, 768, GemvConfig(32, 8, 2, 2, mma=True, persist=1), 4, False),
}


@pytest.mark.parametrize("case", CASES)
def test_stream_grid_matches_reference(case, monkeypatch):
    make, T, dtype, N, K, cfg, sms, has_res = CASES[case]
    if cfg.mma and not GPU_MMA:
        pytest.skip("warp-MMA needs sm_80+")
    monkeypatch.setattr(gl, "sm_count", lambda device: sms)
    gemv, ref = make(DEV)(N, K, T)
    x = (wide_range_x(T, K, seed=T) if dtype != torch.float16 else torch.randn(T, K) * 30).to(dtype).to(DEV)
    res = torch.randn(T, N).to(dtype).to(DEV) if has_res else None
    y = gemv(x, torch.full((T, N), float("nan"), dtype=dtype, device=DEV), res, cfg)
    assert torch.isfinite(y).all()
    assert rel_l2(y, ref(x, res)) < (RTOL_F32 if dtype == torch.float32 else RTOL_HALF)
    assert torch.equal(gemv(x, None, res, cfg), y)
    assert int(workspace(x.device, 0, 0)[1].abs().sum()) == 0


@pytest.mark.parametrize("cfg", [GemvConfig(32, 16, 4, 1, h2=True, persist=1), GemvConfig(32, 8, 2, 2, mma=True,
                                                                                          persist=1)],
                         ids=["h2", "mma"])
def test_stream_grid_on_prepared_activations(cfg, monkeypatch):
    """The decode step's form: x16-prepared activations (XPRE), in place of x."""
    if cfg.mma and not GPU_MMA:
        pytest.skip("warp-MMA needs sm_80+")
    monkeypatch.setattr(gl, "sm_count", lambda device: 3)
    from gemv_inputs import nvfp4_weights
    N, K, T = 37, 640, 2
    codes, scales, gs = nvfp4_weights(N, K, 3, DEV)
    x = wide_range_x(T, K, seed=5).to(torch.bfloat16).to(DEV)
    out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device=DEV)
    y = gemv_nvfp4_prepared(x16_prep(x), repack_nvfp4(codes, scales), gs, out, config=cfg)
    assert rel_l2(y, reference.ref_nvfp4(x, codes, scales, gs)) < RTOL_HALF


def test_config_rules(monkeypatch):
    with pytest.raises(ValueError, match="persist"):
        GemvConfig(16, 4, split=2, h2=True, persist=4)
    with pytest.raises(ValueError, match="persist"):
        GemvConfig(16, 4, persist=4)
    with pytest.raises(ValueError, match="persist"):
        GemvConfig(16, 4, h2=True, persist=-1)
    gemv, _ = _iq3_s(DEV)(19, 256, 0)      # IQ3_S's h2 variant has no stream-K grid
    with pytest.raises(KernelInputError, match="stream-K"):
        gemv(torch.randn(1, 256).to(DEV), None, None, GemvConfig(32, 8, 4, 1, h2=True, persist=1))
    monkeypatch.setenv("NINFER_GEMV_PERSIST", "yes")
    with pytest.raises(KernelInputError, match="NINFER_GEMV_PERSIST='yes'"):
        with_mode(GemvConfig(16, 4, h2=True), True, 3)


def test_mode_switch(monkeypatch):
    h2, h2_k = GemvConfig(64, 16, 4, 1, split=3, h2=True), GemvConfig(64, 16, 4, 1, h2=True, persist=PERSIST_CAP)
    monkeypatch.setenv("NINFER_GEMV_PERSIST", "0")
    assert with_mode(h2_k, True, 5) == GemvConfig(64, 16, 4, 1, split=5, h2=True) and with_mode(h2, True, 5) == h2
    monkeypatch.setenv("NINFER_GEMV_PERSIST", "force")
    assert with_mode(h2, True, 5) == h2_k and with_mode(h2, False, 5) == h2
    assert with_mode(GemvConfig(64, 16, 4, 1, split=3), True, 5) == GemvConfig(64, 16, 4, 1, split=3)
    mma, mma_k = GemvConfig(128, 8, 4, 2, split=7, mma=True), GemvConfig(128, 8, 4, 2, mma=True, persist=PERSIST_CAP)
    monkeypatch.setenv("NINFER_GEMV_PERSIST", "force-h2")
    assert with_mode(h2, True, 5) == h2_k and with_mode(mma, True, 5) == mma
    monkeypatch.setenv("NINFER_GEMV_PERSIST", "force-mma")
    assert with_mode(h2, True, 5) == h2 and with_mode(mma, True, 5) == mma_k
    monkeypatch.setenv("NINFER_GEMV_PERSIST", "1")
    assert with_mode(h2, True, 5) == h2 and with_mode(h2_k, True, 5) == h2_k


def test_candidates_offer_the_stream_grid(monkeypatch):
    """On an H200: the T = 1..2 h2 tiles of NVFP4 and Q6_K and the T = 2..8 mma tiles of all three formats, each
    once; none with NINFER_GEMV_PERSIST=0."""
    dev = as_h200(monkeypatch)

    def persist(kernel, T, G, GS):
        return {(c.h2, c.mma) for c in gl.kernel_candidates(kernel, T, 5120, G, GS, torch.bfloat16, dev)
                if c.persist}
    assert persist(nvfp4_gemv_kernel, 1, 320, 16) == {(True, False)}
    assert persist(q6_k_gemv_kernel, 2, 320, 16) == {(True, False), (False, True)}
    assert persist(iq3_s_gemv_kernel, 4, 320, 16) == {(False, True)}
    assert persist(iq3_s_gemv_kernel, 1, 320, 16) == set()
    assert persist(nvfp4_gemv_kernel, 16, 320, 16) == set()
    monkeypatch.setenv("NINFER_GEMV_PERSIST", "0")
    assert persist(nvfp4_gemv_kernel, 1, 320, 16) == set()


@pytest.mark.skipif(DEV != "cuda", reason="the occupancy of a compiled kernel needs CUDA")
def test_stream_grid_real_shape_gpu():
    """The decode step's out-projection shape: the grid is the occupancy of the compiled kernel times the SMs, and
    the result matches the classic grid's."""
    from gemv_inputs import nvfp4_weights
    N, K = 5120, 6144
    codes, scales, gs = nvfp4_weights(N, K, 0, DEV)
    planes = repack_nvfp4(codes, scales)
    xp = x16_prep(torch.randn(1, K, device=DEV, dtype=torch.bfloat16))
    out = torch.empty(1, N, dtype=torch.bfloat16, device=DEV)
    classic = gemv_nvfp4_prepared(xp, planes, gs, out.clone(), config=GemvConfig(128, 16, 4, 1, split=16, h2=True))
    cfg = GemvConfig(128, 16, 4, 1, h2=True, persist=PERSIST_CAP)
    y = gemv_nvfp4_prepared(xp, planes, gs, out, config=cfg)
    assert rel_l2(y, classic) < RTOL_HALF
    per_sm = [v for k, v in gl._PER_SM.items() if k[0] == "nvfp4_gemv_kernel"]
    assert per_sm and all(1 <= v <= PERSIST_CAP for v in per_sm)


def test_too_many_segments_take_the_classic_grid(monkeypatch):
    """One CTA for 9 row blocks of one K step each needs 9 > MAX_SEGS segments: the launch runs the classic grid
    (and is still right)."""
    monkeypatch.setattr(gl, "sm_count", lambda device: 1)
    gemv, ref = nvfp4_mma(DEV)(9 * 16, 64, 1)
    x = wide_range_x(1, 64, seed=2).to(torch.float32).to(DEV)
    cfg = GemvConfig(16, 4, 4, 1, h2=True, persist=1)
    assert max_segments(9, 1, 1) == 9 > MAX_SEGS
    grids, launch = [], gl._launch

    def spy(*a, **kw):
        r = launch(*a, **kw)
        grids.append(r[1])
        return r
    monkeypatch.setattr(gl, "_launch", spy)
    y = gemv(x, torch.full((1, 9 * 16), float("nan"), device=DEV), None, cfg)
    assert rel_l2(y, ref(x, None)) < RTOL_F32
    assert grids[0] == (9, 1, 1)       # 9 row blocks, no split (one K step)
