"""The IQ3_S packed-half2 GEMV (kernels/gemv_iq3_s_h2.py) vs the codec reference, and its repack.

On CPU the kernel runs in the interpreter with H2_MODE = EMULATE; with CUDA the inline-PTX path runs (and the
shared-memory gather that the interpreter computes with numpy).
"""
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ninfer_formats import codecs  # noqa: E402
from gemv_inputs import (as_h200, iq3_s_every_index_blocks, prepared_inputs, random_ggml_blocks, rel_l2,  # noqa: E402
                         tuner_tiles, wide_range_x)
from ninfer_kernels import reference  # noqa: E402
from ninfer_kernels import gemv_launch as gl  # noqa: E402
from ninfer_kernels.gemv_iq3_s import (H2_TILES, SIGN_BITS, gemv_iq3_s, iq3_s_gemv_kernel, permute_signs,  # noqa: E402
                                       repack_iq3_s)
from ninfer_kernels.gemv_launch import GemvConfig, KernelInputError, interpreting, workspace  # noqa: E402

RTOL_H2 = 2e-3       # fp32 output: f16 sums over 32-weight sub-blocks (as test_kernels_gemv_h2)
RTOL_HALF = 1e-2     # bf16/f16 output: the output rounding dominates
DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
N = 37

CASES = {  # T, dtype, K, block_n, block_g, num_warps, split, residual
    "T1-bf16-g4-w1": (1, torch.bfloat16, 512, 32, 4, 1, 1, False),
    "T1-bf16-g4-w1-split": (1, torch.bfloat16, 768, 32, 4, 1, 2, False),
    "T2-f16-g8-split-res": (2, torch.float16, 768, 16, 8, 1, 3, True),
    "T3-f32-g16-w2": (3, torch.float32, 512, 64, 16, 2, 1, False),
}


def _blocks(N: int, K: int, seed: int) -> torch.Tensor:
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05
    return torch.from_numpy(codecs.quantize("iq3_s", w)).to(DEV)


@pytest.mark.parametrize("case", CASES)
def test_iq3_s_h2_matches_reference(case):
    """Odd N, T up to 3 (a T tile of 4), split-K with a residual; activations spanning 2**32 where the dtype
    allows."""
    T, dtype, K, bn, bg, nw, split, has_res = CASES[case]
    blocks = _blocks(N, K, seed=T)
    packed = repack_iq3_s(blocks, K)
    x = (wide_range_x(T, K, seed=T) if dtype != torch.float16 else torch.randn(T, K) * 30).to(dtype).to(DEV)
    res = torch.randn(T, N).to(dtype).to(DEV) if has_res else None
    cfg = GemvConfig(bn, bg, num_warps=nw, num_stages=1, split=split, h2=True)
    y = gemv_iq3_s(x, packed, torch.full((T, N), float("nan"), dtype=dtype, device=DEV), res, config=cfg)
    assert torch.isfinite(y).all()
    assert rel_l2(y, reference.ref_iq3_s(x, blocks, residual=res)) < (RTOL_H2 if dtype == torch.float32
                                                                       else RTOL_HALF)
    if split > 1:   # deterministic, counters back at zero
        assert torch.equal(gemv_iq3_s(x, packed, None, res, config=cfg), y)
        assert int(workspace(x.device, 0, 0)[1].abs().sum()) == 0


def test_iq3_s_h2_every_grid_point_and_sign():
    """All 512 grid indices (qs byte + qh bit) at every 4-weight position, every sign pattern, every sub-block
    scale nibble; one row's activations all zero, another's near the fp32 top."""
    rows, K = 8, 256
    blocks = iq3_s_every_index_blocks(rows, DEV)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(0))
    x[1] = 0.0
    x[2] *= 1e30
    x = x.to(DEV)
    y = gemv_iq3_s(x, repack_iq3_s(blocks, K), config=GemvConfig(16, 16, num_warps=1, h2=True))
    ref = reference.ref_iq3_s(x, blocks)
    assert torch.isfinite(y).all() and torch.equal(y[1], torch.zeros_like(y[1]))
    assert rel_l2(y[0::2], ref[0::2]) < RTOL_H2


@pytest.mark.parametrize("T,split,has_res", [(1, 1, False), (1, 3, True), (3, 2, True)],
                         ids=["T1", "T1-split-res", "T3-split-res"])
def test_iq3_s_h2_on_prepared_activations(T, split, has_res):
    """Prepared pairs (|x'| < 2**14 per 128-chunk, their (j, j + 4) order permuted into the weights'): every grid
    index, sign and scale nibble, activations spanning 2**32, an all-zero chunk and a huge one; bf16 out."""
    from ninfer_kernels.x16 import launch_prepared, x16_prep
    K = 768
    blocks = iq3_s_every_index_blocks(N * K // 256, DEV).reshape(N, -1)
    x, res, out = prepared_inputs(T, K, N, has_res, DEV)
    p = repack_iq3_s(blocks, K)
    w = tuple(p[k] for k in ("qs", "signs", "qh", "sc", "d", "grid"))
    cfg = GemvConfig(32, 8, num_warps=1, num_stages=1, split=split, h2=True)
    launch_prepared(iq3_s_gemv_kernel, w, x16_prep(x), N, K, 16, 1.0, out, res, cfg, "test")
    ref = reference.ref_iq3_s(x, blocks, residual=res)
    assert torch.isfinite(out).all()
    for t in range(T):
        assert rel_l2(out[t], ref[t]) < RTOL_HALF, t
    with pytest.raises(KernelInputError, match="h2 variant needs"):
        launch_prepared(iq3_s_gemv_kernel, w, x16_prep(x), N, K, 16, 1.0, out, res,
                        GemvConfig(16, 16, 8, h2=True), "test")


def test_sign_permutation():
    """Bit i of a GGML sign word lands at SIGN_BITS[i // 4][i % 4] (one bit at a time, and all at once)."""
    for i in range(16):
        k, j = divmod(i, 4)
        got = int(permute_signs(torch.tensor([1 << i], dtype=torch.int32).to(torch.int16))[0]) & 0xFFFF
        assert got == 1 << SIGN_BITS[k][j]
    assert int(permute_signs(torch.tensor([-1], dtype=torch.int16))[0]) == -1
    assert sorted(b for row in SIGN_BITS for b in row) == list(range(16))


def test_iq3_s_h2_bad_tile_is_a_clear_error():
    blocks = _blocks(4, 256, seed=0)
    packed, x = repack_iq3_s(blocks, 256), torch.randn(1, 256).to(DEV)
    for cfg in (GemvConfig(16, 8, 4, h2=True), GemvConfig(16, 16, 8, h2=True), GemvConfig(64, 1, 1, h2=True)):
        with pytest.raises(KernelInputError, match="h2 variant needs"):
            gemv_iq3_s(x, packed, config=cfg)
    with pytest.raises(KernelInputError, match="T <= 8"):
        gemv_iq3_s(torch.randn(9, 256).to(DEV), packed, config=GemvConfig(32, 16, 2, h2=True))


def test_iq3_s_h2_tiles_and_candidates():
    """The variant registers its own tiles (none past T = 4), each a whole number of rows per thread."""
    assert gl.has_h2(iq3_s_gemv_kernel) and gl.h2_tiles(iq3_s_gemv_kernel) is H2_TILES
    assert H2_TILES[8] == () and H2_TILES[16] == ()
    for tiles in H2_TILES.values():
        for bn, bg, nw, _ in tiles:
            assert (bn * bg) % (64 * nw) == 0 and 16 % bg == 0


def test_iq3_s_h2_candidates_use_its_tiles(monkeypatch):
    """On an sm_90 device the tuner offers exactly the variant's own h2 tiles (bf16 activations; not fp32)."""
    dev = as_h200(monkeypatch)
    for T, b in ((1, 1), (2, 2), (3, 4), (8, 8)):
        c = gl.candidates(T, 14336, 320, 16, torch.bfloat16, dev, h2=True, h2_tiles=H2_TILES)
        assert {(x.block_n, x.block_g, x.num_warps, x.num_stages) for x in c if x.h2} == set(H2_TILES[b])
    assert not any(x.h2 for x in gl.candidates(1, 14336, 320, 16, torch.float32, dev, h2=True, h2_tiles=H2_TILES))


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="the compiled path (inline PTX, shared-memory gather) needs CUDA")
@pytest.mark.parametrize("T", (1, 2, 4))
@pytest.mark.parametrize("shape", ((5120, 6144), (8192, 5120)), ids=("attn_o", "gdn_qkvz_tp2"))
def test_gpu_iq3_s_h2_real_shapes(shape, T):
    """Every tile the tuner may pick, at 27B shapes, with the split-K the tuner would give it."""
    N, K = shape
    blocks = random_ggml_blocks("iq3_s", N, K, 1, DEV)
    packed = repack_iq3_s(blocks, K)
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    ref = reference.ref_iq3_s(x, blocks)
    for cfg in tuner_tiles(H2_TILES, N, K, x.device, h2=True):
        assert rel_l2(gemv_iq3_s(x, packed, config=cfg), ref) < RTOL_HALF, cfg
