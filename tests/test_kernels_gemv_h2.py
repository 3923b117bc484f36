"""The packed-half2 GEMVs (kernels/gemv_nvfp4_h2.py, gemv_q6_k_h2.py) vs the codec-based references.

On CPU the kernel runs in the interpreter with H2_MODE = EMULATE (the same f16 roundings written as Triton
ops); with CUDA the inline-PTX path runs. Activations span many orders of magnitude per 16-weight group,
because the per-group power-of-two scaling to f16 is what this variant adds.
"""
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ninfer_formats import codecs  # noqa: E402
from gemv_inputs import (every_code_nvfp4, extreme_x, nvfp4_weights, prepared_inputs, rel_l2,  # noqa: E402
                         wide_range_x)
from ninfer_kernels import reference  # noqa: E402
from ninfer_kernels import gemv_launch as gl  # noqa: E402
from ninfer_kernels.gemv_launch import GemvConfig, KernelInputError, interpreting, workspace  # noqa: E402
from ninfer_kernels.gemv_nvfp4 import gemv_nvfp4, nvfp4_gemv_kernel, repack_nvfp4  # noqa: E402
from ninfer_kernels.gemv_q6_k import gemv_q6_k, q6_k_gemv_kernel, repack_q6_k  # noqa: E402

RTOL_H2 = 2e-3       # fp32 output: f16 block sums (~2**-11 per FMA over 16 terms), measured ~4e-4
RTOL_HALF = 1e-2     # bf16/f16 output: the output rounding dominates (as in test_kernels_gemv)
DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
N = 37


def weights(N: int, K: int, seed: int):
    return nvfp4_weights(N, K, seed, DEV)


CASES = {  # format, T, dtype, K, block_n, block_g, split, residual, num_stages (3: pipelined loads)
    "nvfp4-T1-bf16": ("nvfp4", 1, torch.bfloat16, 160, 32, 4, 1, False, 1),
    "nvfp4-T1-bf16-stages-ragged": ("nvfp4", 1, torch.bfloat16, 176, 32, 4, 1, False, 3),
    "nvfp4-T1-f16-ragged-split-res": ("nvfp4", 1, torch.float16, 176, 32, 4, 3, True, 1),
    "q6_k-T1-bf16-stages": ("q6_k", 1, torch.bfloat16, 512, 32, 4, 1, False, 3),
    "nvfp4-T2-f16-ragged-split": ("nvfp4", 2, torch.float16, 176, 16, 4, 3, True, 1),
    "nvfp4-T3-f32-stages": ("nvfp4", 3, torch.float32, 96, 64, 2, 1, False, 3),
    "nvfp4-T5-bf16-split-stages": ("nvfp4", 5, torch.bfloat16, 144, 32, 2, 2, True, 3),
    "nvfp4-T8-f16": ("nvfp4", 8, torch.float16, 48, 16, 2, 1, False, 1),
    "q6_k-T1-bf16": ("q6_k", 1, torch.bfloat16, 512, 32, 4, 1, False, 1),
    "q6_k-T2-f16-ragged-split": ("q6_k", 2, torch.float16, 768, 16, 4, 3, True, 1),
    "q6_k-T3-f32-stages": ("q6_k", 3, torch.float32, 512, 64, 2, 1, False, 3),
    "q6_k-T3-bf16-split-stages": ("q6_k", 3, torch.bfloat16, 512, 32, 2, 2, True, 3),
}


def h2_linear(fmt: str, N: int, K: int, seed: int):
    """(y = f(x, out, residual, config), ref = r(x, residual)) for a random weight of `fmt`."""
    if fmt == "nvfp4":
        codes, scales, gs = weights(N, K, seed)
        return (lambda x, out, res, cfg: gemv_nvfp4(x, repack_nvfp4(codes, scales), gs, out, res, config=cfg),
                lambda x, res: reference.ref_nvfp4(x, codes, scales, gs, residual=res))
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05
    blocks = torch.from_numpy(codecs.quantize("q6_k", w)).to(DEV)
    packed = repack_q6_k(blocks, K)
    return (lambda x, out, res, cfg: gemv_q6_k(x, packed, out, res, config=cfg),
            lambda x, res: reference.ref_q6_k(x, blocks, residual=res))


@pytest.mark.parametrize("case", CASES)
def test_h2_matches_reference(case):
    """NVFP4 nibbles and Q6_K codes (under the f16 exponent of 1024) to f16x2 pairs; activations spanning
    2**32 (fp16 inputs: a smaller range, they must fit in fp16 themselves)."""
    fmt, T, dtype, K, bn, bg, split, has_res, stages = CASES[case]
    run, ref_fn = h2_linear(fmt, N, K, seed=T)
    x = (wide_range_x(T, K, seed=T) if dtype != torch.float16 else torch.randn(T, K) * 30).to(dtype).to(DEV)
    res = torch.randn(T, N).to(dtype).to(DEV) if has_res else None
    cfg = GemvConfig(bn, bg, num_stages=stages, split=split, h2=True)
    y = run(x, torch.full((T, N), float("nan"), dtype=dtype, device=DEV), res, cfg)
    assert torch.isfinite(y).all()
    assert rel_l2(y, ref_fn(x, res)) < (RTOL_H2 if dtype == torch.float32 else RTOL_HALF)
    if split > 1:   # deterministic, counters back at zero
        assert torch.equal(run(x, None, res, cfg), y)
        assert int(workspace(x.device, 0, 0)[1].abs().sum()) == 0


def test_h2_every_code_and_extreme_groups():
    """Every code byte and scale pattern; groups whose activations are all zero, near the fp32 top or
    fp32-subnormal-small: the scaling must neither overflow f16 nor lose the group."""
    K = 256
    codes, scales = every_code_nvfp4(8, K, DEV)
    x = extreme_x(K, 16, DEV)       # one 16-weight group each
    y = gemv_nvfp4(x, repack_nvfp4(codes, scales), 0.5, config=GemvConfig(8, 4, num_stages=1, h2=True))
    ref = reference.ref_nvfp4(x, codes, scales, 0.5)
    assert torch.isfinite(y).all() and rel_l2(y, ref) < RTOL_H2


def test_q6_k_h2_every_code():
    """All 64 codes at every position of a group (bytes cycled through the planes), extreme groups."""
    K = 512
    raw = (np.arange(N * K // 256 * 210) * 37 % 251).astype(np.uint8).reshape(N, -1)
    raw.reshape(N, K // 256, 210)[..., 208:210] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    blocks = torch.from_numpy(raw).to(DEV)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(0))
    x[0, :16] = 0.0
    x[1, 16:32] *= 1e30
    x = x.to(DEV)
    y = gemv_q6_k(x, repack_q6_k(blocks, K), config=GemvConfig(16, 4, num_stages=1, h2=True))
    ref = reference.ref_q6_k(x, blocks)
    assert torch.isfinite(y).all() and rel_l2(y, ref) < RTOL_H2


@pytest.mark.parametrize("T,split,has_res,stages", [(1, 1, False, 1), (1, 3, True, 3), (3, 2, True, 1)],
                         ids=["T1", "T1-ragged-split-res-stages", "T3-split-res"])
def test_q6_k_h2_on_prepared_activations(T, split, has_res, stages):
    """Q6_K codes scaled by 2**-8 against prepared pairs (|x'| < 2**14): every code, activations spanning 2**32,
    an all-zero chunk and a huge one; bf16 out."""
    from ninfer_kernels.x16 import launch_prepared, x16_prep
    K = 768
    raw = (np.arange(N * K // 256 * 210) * 37 % 251).astype(np.uint8).reshape(N, -1)
    raw.reshape(N, K // 256, 210)[..., 208:210] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    blocks = torch.from_numpy(raw).to(DEV)
    x, res, out = prepared_inputs(T, K, N, has_res, DEV)
    packed = repack_q6_k(blocks, K)
    w = (packed["ql"], packed["qh"], packed["sc"], packed["d"])
    cfg = GemvConfig(32, 4, num_stages=stages, split=split, h2=True)
    launch_prepared(q6_k_gemv_kernel, w, x16_prep(x), N, K, 16, 1.0, out, res, cfg, "test")
    ref = reference.ref_q6_k(x, blocks, residual=res)
    assert torch.isfinite(out).all()
    for t in range(T):
        assert rel_l2(out[t], ref[t]) < RTOL_HALF, t


def test_h2_config_rules():
    assert gl.has_h2(q6_k_gemv_kernel) and gl.has_h2(nvfp4_gemv_kernel)
    codes, scales, gs = weights(N, 64, seed=1)
    with pytest.raises(KernelInputError, match="T <= 8"):
        gemv_nvfp4(torch.randn(9, 64).to(DEV), repack_nvfp4(codes, scales), gs, config=GemvConfig(16, 4, h2=True))
    with pytest.raises(ValueError, match="h2"):
        GemvConfig(16, 4, use_dot=True, h2=True)

