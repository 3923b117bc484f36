"""The warp-MMA IQ3_S GEMV (kernels/gemv_iq3_s_mma.py, skeleton kernels/gemv_mma_body.py) vs the codec reference.

As for the other MMA variants: the interpreter runs the warp steps as Triton ops on CPU (and the table gather with
numpy), the PTX path runs on sm_80+. Weights come from the numpy codec (the packer's path) and from hand-set
blocks that put all 512 grid indices, every sign pattern and every scale nibble at every position; activations
span many orders of magnitude per 128-weight chunk; prepared activations (XPRE) too.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gemv_inputs import (as_h200, check_mma_case, ggml_mma, iq3_s_every_index_blocks, random_ggml_blocks,  # noqa: E402
                         rel_l2, tuner_tiles, wide_range_x)
from gemv_inputs import codec_blocks as _codec_blocks  # noqa: E402
from ninfer_kernels import gemv_launch as gl  # noqa: E402
from ninfer_kernels import reference  # noqa: E402
from ninfer_kernels.gemv_iq3_s import MMA_TILES, gemv_iq3_s, iq3_s_gemv_kernel, repack_iq3_s  # noqa: E402
from ninfer_kernels.gemv_launch import GemvConfig, KernelInputError, interpreting  # noqa: E402

RTOL_MMA = 2e-3      # fp32 output: activations rounded to f16 (the weights' f16 pairs are exact)
RTOL_HALF = 1e-2     # bf16/f16 output rounding dominates
DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cuda" and torch.cuda.get_device_capability() < (8, 0),
                                reason="the warp-MMA variant needs sm_80+")


def codec_blocks(N: int, K: int, seed: int) -> torch.Tensor:
    return _codec_blocks("iq3_s", N, K, seed, DEV)


CASES = {  # T, dtype, N, K, block_n, block_g, num_warps, num_stages, split, residual
    "T1-bf16-one-superblock": (1, torch.bfloat16, 37, 256, 32, 8, 2, 1, 1, False),
    "T3-f32-split3-prefetch-res": (3, torch.float32, 37, 768, 64, 8, 2, 2, 3, True),
    "T8-f16-g16": (8, torch.float16, 19, 512, 32, 16, 2, 1, 1, False),
    "T11-f32-two-col-blocks": (11, torch.float32, 21, 512, 32, 8, 2, 1, 1, False),
    "T6-bf16-split2-triple-buffer-res": (6, torch.bfloat16, 37, 1024, 64, 8, 2, 3, 2, True),
}


@pytest.mark.parametrize("case", CASES)
def test_iq3_s_mma_matches_reference(case):
    check_mma_case(CASES[case], ggml_mma("iq3_s", gemv_iq3_s, repack_iq3_s, reference.ref_iq3_s, DEV), RTOL_MMA,
                   RTOL_HALF, DEV)


def test_iq3_s_mma_every_grid_point_sign_and_scale():
    """All 512 grid indices at every 4-weight position of a chunk, every scale nibble; an all-zero activation
    chunk and a huge one next to ordinary ones."""
    rows, K = 16, 256
    blocks = iq3_s_every_index_blocks(rows, DEV)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(0))
    x[1] = 0.0
    x[2, 128:] *= 1e30
    x = x.to(DEV)
    y = gemv_iq3_s(x, repack_iq3_s(blocks, K), config=GemvConfig(16, 8, 1, 1, mma=True))
    ref = reference.ref_iq3_s(x, blocks)
    assert torch.isfinite(y).all() and torch.equal(y[1], torch.zeros_like(y[1]))
    for t in (0, 2):
        assert rel_l2(y[t], ref[t]) < RTOL_MMA, t


def test_iq3_s_mma_on_prepared_activations():
    from ninfer_kernels.x16 import launch_prepared, x16_prep
    T, N, K = 5, 37, 512
    blocks = codec_blocks(N, K, seed=1)
    x = wide_range_x(T, K, seed=2).to(DEV)
    out = torch.full((T, N), float("nan"), device=DEV)
    p = repack_iq3_s(blocks, K)
    w = (p["qs"], p["signs"], p["qh"], p["sc"], p["d"], p["grid"])
    launch_prepared(iq3_s_gemv_kernel, w, x16_prep(x), N, K, 16, 1.0, out, None, GemvConfig(32, 8, 2, 1, mma=True),
                    "test")
    assert rel_l2(out, reference.ref_iq3_s(x, blocks)) < RTOL_MMA


def test_iq3_s_has_the_mma_variant_and_its_tiles(monkeypatch):
    """Registered with its own tiles (T = 1 too, against the h2 variant); T > 16 is a clear error."""
    assert gl.has_variant(iq3_s_gemv_kernel, "mma") and gl.mma_tiles(iq3_s_gemv_kernel) is MMA_TILES
    dev = as_h200(monkeypatch)
    for T, b in ((1, 1), (3, 4), (16, 16)):
        c = gl.kernel_candidates(iq3_s_gemv_kernel, T, 14336, 320, 16, torch.bfloat16, dev)
        assert {(x.block_n, x.block_g, x.num_warps, x.num_stages) for x in c if x.mma} == set(MMA_TILES[b])
    with pytest.raises(KernelInputError, match="IQ3_S"):
        gemv_iq3_s(torch.zeros(17, 256).to(DEV), repack_iq3_s(codec_blocks(32, 256, 0), 256),
                   config=GemvConfig(32, 8, 2, 1, mma=True))         # T = 17 > 16


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="the compiled path (inline PTX, shared-memory gather) needs CUDA")
@pytest.mark.parametrize("T", (1, 4, 13))
@pytest.mark.parametrize("shape", ((5120, 6144), (8192, 5120)), ids=("attn_o", "gdn_qkvz_tp2"))
def test_gpu_iq3_s_mma_real_shapes(shape, T):
    """Every tile the tuner may pick, at 27B shapes, with the split-K the tuner would give it; plain and prepared
    activations."""
    from ninfer_kernels.x16 import launch_prepared, x16_prep
    N, K = shape
    blocks = random_ggml_blocks("iq3_s", N, K, 1, DEV)
    p = repack_iq3_s(blocks, K)
    w = (p["qs"], p["signs"], p["qh"], p["sc"], p["d"], p["grid"])
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    ref = reference.ref_iq3_s(x, blocks)
    for cfg in tuner_tiles(MMA_TILES, N, K, x.device, mma=True):
        assert rel_l2(gemv_iq3_s(x, p, config=cfg), ref) < RTOL_HALF, cfg
        out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device=DEV)
        launch_prepared(iq3_s_gemv_kernel, w, x16_prep(x), N, K, 16, 1.0, out, None, cfg, "test")
        assert rel_l2(out, ref) < RTOL_HALF, cfg
