"""The warp-MMA NVFP4 GEMV (kernels/gemv_nvfp4_mma.py) vs the codec-based reference.

On CPU the kernel runs in the interpreter with the warp-collective steps (mma.sync, the quad shuffles) written
as Triton ops over [warps, 8, 4] lane views; with CUDA on sm_80+ the inline-PTX path runs. That the compiled
kernel keeps every per-thread value in its own thread (which the PTX path relies on) is checked by
test_kernels_compile (`lane_layouts_bad`). Shapes are odd in N and T; K covers one chunk, several, split-K
ranges and 16-group steps; activations span many orders of magnitude per 128-weight chunk, because the
per-chunk power-of-two scaling into f16 is what this variant adds.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ninfer_kernels import gemv_launch as gl  # noqa: E402
from gemv_inputs import (check_mma_case, every_code_nvfp4, extreme_x, nvfp4_mma, nvfp4_weights, rel_l2,  # noqa: E402
                         tuner_tiles)
from ninfer_kernels import reference  # noqa: E402
from ninfer_kernels.gemv_launch import GemvConfig, KernelInputError, interpreting  # noqa: E402
from ninfer_kernels.gemv_nvfp4 import gemv_nvfp4, nvfp4_gemv_kernel, repack_nvfp4  # noqa: E402

RTOL_MMA = 2e-3      # fp32 output: activations rounded to f16 (2**-11 relative), products exact, fp32 sums
RTOL_HALF = 1e-2     # bf16/f16 output: the output rounding dominates (as in test_kernels_gemv)
DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
GPU_MMA = DEV == "cuda" and torch.cuda.get_device_capability() >= (8, 0)


def weights(N: int, K: int, seed: int):
    return nvfp4_weights(N, K, seed, DEV)


CASES = {  # T, dtype, N, K, block_n, block_g, num_warps, num_stages, split, residual
    "T1-bf16-one-chunk": (1, torch.bfloat16, 37, 128, 64, 8, 2, 1, 1, False),
    "T3-f32-split3-prefetch": (3, torch.float32, 37, 384, 64, 8, 2, 2, 3, True),
    "T8-f16-g16": (8, torch.float16, 70, 512, 32, 16, 2, 1, 1, False),
    "T5-bf16-split2-res": (5, torch.bfloat16, 19, 768, 64, 8, 4, 1, 2, True),
    "T11-f32-two-col-blocks-prefetch": (11, torch.float32, 37, 384, 32, 8, 2, 2, 1, False),
    "T16-bf16-split2-g16-prefetch": (16, torch.bfloat16, 33, 768, 64, 16, 2, 2, 2, True),
    "T6-bf16-split2-triple-buffer-res": (6, torch.bfloat16, 37, 1024, 64, 8, 2, 3, 2, True),
    "T4-f32-split3-triple-one-step": (4, torch.float32, 37, 384, 64, 8, 2, 3, 3, False),
}


@pytest.mark.parametrize("case", CASES)
def test_mma_matches_reference(case):
    check_mma_case(CASES[case], nvfp4_mma(DEV), RTOL_MMA, RTOL_HALF, DEV)


def test_mma_every_code_scale_and_extreme_chunks():
    """Every code byte at every position, E4M3 scales from subnormal (0x01, 0x07) to 448 (0x7E); chunks of
    all-zero, near-fp32-top, fp32-subnormal and beyond-f16 activations: the per-chunk scaling must neither
    overflow f16 nor lose a chunk, and subnormal block scales stay exact."""
    K, N = 512, 32
    codes, scales = every_code_nvfp4(N, K, DEV)
    x = extreme_x(K, 128, DEV)      # one 128-weight chunk each
    y = gemv_nvfp4(x, repack_nvfp4(codes, scales), 0.5, config=GemvConfig(32, 8, 2, 1, mma=True))
    ref = reference.ref_nvfp4(x, codes, scales, 0.5)
    assert torch.isfinite(y).all()
    for t in range(2):   # per row: the rows' magnitudes differ by 1e30
        assert rel_l2(y[t], ref[t]) < RTOL_MMA, t


def test_mma_config_and_input_errors():
    with pytest.raises(ValueError, match="mma"):
        GemvConfig(64, 4, 2, mma=True)            # block_g must be 8 or 16
    with pytest.raises(ValueError, match="mma"):
        GemvConfig(32, 8, 4, mma=True)            # 16 rows per warp and m-tile: 4 warps need 64
    with pytest.raises(ValueError, match="mma"):
        GemvConfig(16, 8, 2, mma=True)            # 2 warps need at least 32 rows
    with pytest.raises(ValueError, match="pick one"):
        GemvConfig(64, 8, 2, mma=True, h2=True)
    codes, scales, gs = weights(5, 144, seed=0)   # K = 144: 9 groups, not whole chunks
    with pytest.raises(KernelInputError, match="multiple of 128"):
        gemv_nvfp4(torch.randn(1, 144).to(DEV), repack_nvfp4(codes, scales), gs,
                   config=GemvConfig(32, 8, 2, mma=True))
    codes, scales, gs = weights(5, 128, seed=0)
    with pytest.raises(KernelInputError, match="T <= 16"):
        gemv_nvfp4(torch.randn(17, 128).to(DEV), repack_nvfp4(codes, scales), gs,
                   config=GemvConfig(32, 8, 2, mma=True))


def test_mma_candidates_only_where_they_run():
    """Offered on sm_80+ for fp16/bf16 activations at T >= 2 when K is whole 128-weight chunks; never elsewhere."""
    assert gl.has_variant(nvfp4_gemv_kernel, "mma")
    if not GPU_MMA:
        assert not any(c.mma for c in gl.candidates(4, 5120, 320, 16, torch.bfloat16, torch.device(DEV), mma=True))
        return
    dev = torch.device(DEV)
    for T in (2, 4, 16):
        assert any(c.mma for c in gl.candidates(T, 5120, 320, 16, torch.bfloat16, dev, mma=True))
    assert not any(c.mma for c in gl.candidates(1, 5120, 320, 16, torch.bfloat16, dev, mma=True))  # h2 wins T=1
    assert not any(c.mma for c in gl.candidates(4, 5120, 321, 16, torch.bfloat16, dev, mma=True))
    assert not any(c.mma for c in gl.candidates(4, 5120, 320, 16, torch.float32, dev, mma=True))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_MMA, reason="the PTX path needs an sm_80+ GPU")
@pytest.mark.parametrize("T", (1, 4, 8, 16))
@pytest.mark.parametrize("shape", ((5120, 6144), (17408, 5120)), ids=("attn_o", "mlp_gate_up_tp2"))
def test_gpu_mma_real_shapes(shape, T):
    N, K = shape
    codes, scales, gs = weights(N, K, seed=1)
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    ref = reference.ref_nvfp4(x, codes, scales, gs)
    for cfg in tuner_tiles(gl._DECODE_MMA_TILES, N, K, x.device, mma=True):
        assert rel_l2(gemv_nvfp4(x, repack_nvfp4(codes, scales), gs, config=cfg), ref) < RTOL_HALF, cfg
