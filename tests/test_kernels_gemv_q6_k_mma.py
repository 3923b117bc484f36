"""The warp-MMA Q6_K GEMV (kernels/gemv_q6_k_mma.py, skeleton kernels/gemv_mma_body.py) vs the codec reference.

As for the NVFP4 MMA variant (test_kernels_gemv_mma.py): the interpreter runs the warp steps as Triton ops on
CPU, the PTX path runs on sm_80+. Weights come from the numpy codec (the packer's path) and from cycled bytes
that put all 64 codes and every int8 sub-block scale (-128..127: (code - 32) * sc up to 4096) at every position;
activations span many orders of magnitude per 128-weight chunk; prepared activations (XPRE) too.
"""
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gemv_inputs import check_mma_case, ggml_mma, rel_l2, wide_range_x  # noqa: E402
from gemv_inputs import codec_blocks as _codec_blocks  # noqa: E402
from ninfer_kernels import gemv_launch as gl  # noqa: E402
from ninfer_kernels import reference  # noqa: E402
from ninfer_kernels.gemv_launch import GemvConfig, KernelInputError, interpreting  # noqa: E402
from ninfer_kernels.gemv_q6_k import gemv_q6_k, q6_k_gemv_kernel, repack_q6_k  # noqa: E402

RTOL_MMA = 2e-3      # fp32 output: activations rounded to f16, (code - 32) * sc above 2048 rounded in f16
RTOL_HALF = 1e-2     # bf16/f16 output rounding dominates
DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cuda" and torch.cuda.get_device_capability() < (8, 0),
                                reason="the warp-MMA variant needs sm_80+")


def codec_blocks(N: int, K: int, seed: int) -> torch.Tensor:
    return _codec_blocks("q6_k", N, K, seed, DEV)


def cycled_blocks(N: int, K: int) -> torch.Tensor:
    """Bytes cycled through the planes (every code, every sc byte), d = 0.01 so that sums stay moderate."""
    raw = (np.arange(N * K // 256 * 210) * 37 % 251).astype(np.uint8).reshape(N, -1)
    raw.reshape(N, K // 256, 210)[..., 208:210] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return torch.from_numpy(raw).to(DEV)


CASES = {  # T, dtype, N, K, block_n, block_g, num_warps, num_stages, split, residual
    "T1-bf16-one-superblock": (1, torch.bfloat16, 37, 256, 32, 8, 2, 1, 1, False),
    "T3-f32-split3-prefetch-res": (3, torch.float32, 37, 768, 64, 8, 2, 2, 3, True),
    "T8-f16-g16": (8, torch.float16, 70, 512, 32, 16, 2, 1, 1, False),
    "T11-f32-two-col-blocks": (11, torch.float32, 21, 512, 32, 8, 2, 1, 1, False),
    "T16-bf16-split2-g16-prefetch": (16, torch.bfloat16, 33, 1024, 64, 16, 2, 2, 2, True),
    "T6-bf16-split2-triple-buffer-res": (6, torch.bfloat16, 37, 1024, 64, 8, 2, 3, 2, True),
}


@pytest.mark.parametrize("case", CASES)
def test_q6_k_mma_matches_reference(case):
    check_mma_case(CASES[case], ggml_mma("q6_k", gemv_q6_k, repack_q6_k, reference.ref_q6_k, DEV), RTOL_MMA, RTOL_HALF,
                   DEV)


def test_q6_k_mma_every_code_and_scale():
    K, N = 512, 32
    blocks = cycled_blocks(N, K)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(0))
    x[0, :128] = 0.0                  # an all-zero chunk
    x[1, 128:256] *= 1e30             # a huge one next to ordinary ones
    x = x.to(DEV)
    y = gemv_q6_k(x, repack_q6_k(blocks, K), config=GemvConfig(32, 8, 2, 1, mma=True))
    ref = reference.ref_q6_k(x, blocks)
    assert torch.isfinite(y).all()
    for t in range(2):
        assert rel_l2(y[t], ref[t]) < RTOL_MMA, t


def test_q6_k_mma_on_prepared_activations():
    from ninfer_kernels.x16 import launch_prepared, x16_prep
    T, N, K = 5, 37, 512
    blocks = codec_blocks(N, K, seed=1)
    x = wide_range_x(T, K, seed=2).to(DEV)
    out = torch.full((T, N), float("nan"), device=DEV)
    packed = repack_q6_k(blocks, K)
    w = (packed["ql"], packed["qh"], packed["sc"], packed["d"])
    launch_prepared(q6_k_gemv_kernel, w, x16_prep(x), N, K, 16, 1.0, out, None, GemvConfig(32, 8, 2, 1, mma=True),
                    "test")
    assert rel_l2(out, reference.ref_q6_k(x, blocks)) < RTOL_MMA


def test_q6_k_has_the_mma_variant():
    assert gl.has_variant(q6_k_gemv_kernel, "mma")
    with pytest.raises(KernelInputError, match="Q6_K"):
        gemv_q6_k(torch.zeros(17, 256, device=DEV), repack_q6_k(codec_blocks(32, 256, 0), 256),
                  config=GemvConfig(32, 8, 2, 1, mma=True))         # T = 17 > 16
