"""IQ3_S repacked as 4-bit offset codes (kernels/gemv_iq3_s4*.py): the repack against the blocks, and the fp32,
packed-half2 and warp-MMA GEMVs against the codec reference.

On CPU the kernels run in the interpreter (H2_MODE = EMULATE for the f16 variants); with CUDA the compiled paths.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gemv_inputs import (check_mma_case, ggml_mma, iq3_s_every_index_blocks, prepared_inputs,  # noqa: E402
                         random_ggml_blocks, rel_l2, wide_range_x)
from ninfer_kernels import reference  # noqa: E402
from ninfer_kernels.gemv_iq3_s import repack_iq3_s, unpack_iq3_s  # noqa: E402
from ninfer_kernels.gemv_iq3_s4 import (LAYOUT_ENV, dequant_iq3_s4, gemv_iq3_s4, iq3_s4_gemv_kernel,  # noqa: E402
                                        layout, repack_iq3_s4, unpack_iq3_s4)
from ninfer_kernels.gemv_launch import GemvConfig, KernelInputError, interpreting, workspace  # noqa: E402

RTOL_F32 = 1e-5      # the fp32 kernel: fp32 FMAs in another order than the reference
RTOL_H2 = 2e-3       # fp32 output of the f16 variants: f16 sums over 16-weight groups
RTOL_HALF = 1e-2     # bf16/f16 output: the output rounding dominates
DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
N = 37


def _every_index(n: int, K: int) -> torch.Tensor:
    """[n, K / 256 * 110] blocks with every grid index, sign pattern and scale nibble (gemv_inputs)."""
    return iq3_s_every_index_blocks(n * K // 256, DEV).reshape(n, -1)


def test_repack_round_trip_and_size():
    """The codes planes give the blocks back byte for byte (every grid index and sign; random bytes), and hold
    134 bytes per 256 weights."""
    for blocks, K in ((_every_index(8, 512), 512), (random_ggml_blocks("iq3_s", 5, 768, 3, DEV), 768)):
        p = repack_iq3_s4(blocks, K, chunk_rows=3)
        assert torch.equal(unpack_iq3_s4(p), blocks) and torch.equal(unpack_iq3_s4(p, chunk_rows=2), blocks)
        rows = torch.tensor([4, 1], device=DEV)
        assert torch.equal(unpack_iq3_s4(p, rows), blocks.index_select(0, rows))
        assert sum(t.numel() * t.element_size() for t in p.values()) == blocks.shape[0] * K // 256 * 134


def test_codes_are_the_signed_coordinates():
    """Weight j of a word sits at bits 4j+1..4j+4 mod 32 as (c + 15) / 2, c its signed grid coordinate: the
    dequantizer (the fp32 decode) matches the codec's, scale for scale."""
    K = 512
    blocks = _every_index(6, K)
    dense = dequant_iq3_s4(repack_iq3_s4(blocks, K), K, torch.float32)
    ref = torch.from_numpy(reference.dense_ggml("iq3_s", blocks, K)).float()
    assert torch.equal(dense.cpu(), ref)


CASES = {  # T, dtype, K, block_n, block_g, num_warps, split, residual
    "T1-f32-g4": (1, torch.float32, 512, 32, 4, 1, 1, False),
    "T2-bf16-g8-split-res": (2, torch.bfloat16, 768, 16, 8, 1, 3, True),
    "T3-f16-g16-w2": (3, torch.float16, 512, 64, 16, 2, 1, False),
}


@pytest.mark.parametrize("variant", ("fp32", "h2"))
@pytest.mark.parametrize("case", CASES)
def test_iq3_s4_matches_reference(case, variant):
    """Odd N, T up to 3, split-K with a residual; activations spanning 2**32 where the dtype allows."""
    T, dtype, K, bn, bg, nw, split, has_res = CASES[case]
    blocks = random_ggml_blocks("iq3_s", N, K, T, DEV)
    packed = repack_iq3_s4(blocks, K)
    x = (wide_range_x(T, K, seed=T) if dtype != torch.float16 else torch.randn(T, K) * 30).to(dtype).to(DEV)
    res = torch.randn(T, N).to(dtype).to(DEV) if has_res else None
    cfg = GemvConfig(bn, bg, num_warps=nw, num_stages=1, split=split, h2=variant == "h2")
    y = gemv_iq3_s4(x, packed, torch.full((T, N), float("nan"), dtype=dtype, device=DEV), res, config=cfg)
    assert torch.isfinite(y).all()
    tol = (RTOL_F32 if variant == "fp32" else RTOL_H2) if dtype == torch.float32 else RTOL_HALF
    assert rel_l2(y, reference.ref_iq3_s(x, blocks, residual=res)) < tol
    if split > 1:   # deterministic, counters back at zero
        assert torch.equal(gemv_iq3_s4(x, packed, None, res, config=cfg), y)
        assert int(workspace(x.device, 0, 0)[1].abs().sum()) == 0


def test_iq3_s4_h2_every_code_and_extremes():
    """Every grid index, sign and scale nibble; one row of activations all zero, one near the fp32 top."""
    K = 512
    blocks = _every_index(6, K)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(0))
    x[1] = 0.0
    x[2] *= 1e30
    x = x.to(DEV)
    y = gemv_iq3_s4(x, repack_iq3_s4(blocks, K), config=GemvConfig(16, 16, num_warps=1, h2=True))
    ref = reference.ref_iq3_s(x, blocks)
    assert torch.isfinite(y).all() and torch.equal(y[1], torch.zeros_like(y[1]))
    assert rel_l2(y[0::2], ref[0::2]) < RTOL_H2


@pytest.mark.parametrize("variant", ("h2", "mma"))
@pytest.mark.parametrize("T,split,has_res", [(1, 1, False), (3, 2, True)], ids=["T1", "T3-split-res"])
def test_iq3_s4_on_prepared_activations(T, split, has_res, variant):
    """Prepared pairs (|x'| < 2**14 per 128-chunk): every code, activations spanning 2**32, an all-zero chunk and a
    huge one; bf16 out."""
    from ninfer_kernels.x16 import launch_prepared, x16_prep
    K = 768
    blocks = _every_index(N, K)
    x, res, out = prepared_inputs(T, K, N, has_res, DEV)
    p = repack_iq3_s4(blocks, K)
    cfg = GemvConfig(32, 8, num_warps=1, num_stages=1, split=split, **{variant: True})
    launch_prepared(iq3_s4_gemv_kernel, (p["codes"], p["sc"], p["d"]), x16_prep(x), N, K, 16, 1.0, out, res, cfg,
                    "test")
    ref = reference.ref_iq3_s(x, blocks, residual=res)
    assert torch.isfinite(out).all()
    for t in range(T):
        assert rel_l2(out[t], ref[t]) < RTOL_HALF, t


MMA_CASES = {  # T, dtype, N, K, block_n, block_g, num_warps, num_stages, split, residual
    "T1-bf16-n32-g8": (1, torch.bfloat16, 37, 512, 32, 8, 2, 1, 1, False),
    "T5-f16-n16-g16-split-res": (5, torch.float16, 21, 768, 16, 16, 1, 2, 2, True),
    "T11-f32-n32-g8": (11, torch.float32, 19, 256, 32, 8, 2, 1, 1, False),
}


@pytest.mark.parametrize("case", MMA_CASES)
def test_iq3_s4_mma_matches_reference(case):
    make = ggml_mma("iq3_s", gemv_iq3_s4, repack_iq3_s4, reference.ref_iq3_s, DEV)
    check_mma_case(MMA_CASES[case], make, RTOL_H2, RTOL_HALF, DEV)


def test_layout_switch_and_bad_input(monkeypatch):
    monkeypatch.delenv(LAYOUT_ENV, raising=False)
    assert layout() == "codes4"
    monkeypatch.setenv(LAYOUT_ENV, "grid")
    assert layout() == "grid"
    monkeypatch.setenv(LAYOUT_ENV, "nibbles")
    with pytest.raises(KernelInputError, match="NINFER_IQ3S_LAYOUT='nibbles'"):
        layout()
    with pytest.raises(KernelInputError, match="repack_iq3_s4: blocks must be u8"):
        repack_iq3_s4(torch.zeros(2, 100, dtype=torch.uint8), 256)
    p = repack_iq3_s4(random_ggml_blocks("iq3_s", 2, 256, 0, DEV), 256)
    with pytest.raises(KernelInputError, match="codes"):
        gemv_iq3_s4(torch.randn(1, 256).to(DEV), {**p, "codes": p["codes"].to(torch.int32)})
    with pytest.raises(KernelInputError, match="h2 variant needs"):      # 1/2 row per thread
        gemv_iq3_s4(torch.randn(1, 256).to(DEV), p, config=GemvConfig(16, 8, 4, h2=True))
    bad = {**p, "codes": p["codes"].clone()}
    bad["codes"][0, 0] = 0      # codes (0, 0, 0, 0) = coordinates (-15, -15, -15, -15): not a grid point
    with pytest.raises(KernelInputError, match="not an IQ3_S grid point"):
        unpack_iq3_s4(bad)


def test_grid_planes_unpack_like_the_codes():
    """`unpack_iq3_s` of the grid planes is what the codes layout unpacks to."""
    blocks = random_ggml_blocks("iq3_s", 3, 512, 7, DEV)
    assert torch.equal(unpack_iq3_s(repack_iq3_s(blocks, 512)), unpack_iq3_s4(repack_iq3_s4(blocks, 512)))


@pytest.mark.parametrize("layout_", ["codes4", "grid", None], ids=["codes4", "grid", "default"])
@pytest.mark.parametrize("T,xpre,path", [(1, False, None), (3, True, None), (11, True, None), (20, False, "fused"),
                                         (20, False, "dequant")],
                         ids=["T1", "T3-prepared-h2", "T11-prepared-mma", "T20-fused", "T20-dequant"])
def test_linear_with_either_layout(monkeypatch, T, xpre, path, layout_):
    """`dispatch.linear` on an IQ3_S weight repacks it into the planes NINFER_IQ3S_LAYOUT names (unset: the code
    planes) and every path (decode, prepared h2 / warp-MMA, both prefill paths) matches the reference; released,
    the weight's blocks come back byte for byte from the planes."""
    from ninfer_kernels import dispatch, x16
    from ninfer_rt.weights import QWeight
    if layout_ is None:
        monkeypatch.delenv(LAYOUT_ENV, raising=False)
    else:
        monkeypatch.setenv(LAYOUT_ENV, layout_)
    codes = layout_ != "grid"
    N, K = 37, 256
    blocks = random_ggml_blocks("iq3_s", N, K, T, DEV)
    qw = QWeight("iq3_s", (N, K), {"blocks": blocks.clone()}, name="test.iq3_s4")
    x = wide_range_x(T, K, seed=T).to(DEV)
    res = torch.randn(T, N).to(DEV)
    y = dispatch.linear(x, qw, residual=res, xp=x16.x16_prep(x) if xpre else None, prefill_path=path)
    assert ("codes" in qw.cache["triton.iq3_s"]) == codes
    assert rel_l2(y, reference.ref_iq3_s(x, blocks, residual=res)) < RTOL_H2
    assert x16._kernel_name(qw) == ("iq3_s4_gemv_kernel" if codes else "iq3_s_gemv_kernel")
    dispatch.release(qw, qw.cache["triton.iq3_s"])
    assert qw.released and torch.equal(qw.blocks(), blocks)


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="the compiled path (inline PTX) needs CUDA")
@pytest.mark.parametrize("T", (1, 2, 4, 8))
@pytest.mark.parametrize("shape", ((5120, 6144), (8192, 5120)), ids=("attn_o", "gdn_qkvz_tp2"))
def test_gpu_iq3_s4_real_shapes(shape, T):
    """Every h2 and warp-MMA tile the tuner may pick, at 27B shapes, with the split-K the tuner would give it, on
    bf16 and on prepared activations."""
    from gemv_inputs import tuner_tiles
    from ninfer_kernels.gemv_iq3_s4 import H2_TILES
    from ninfer_kernels.gemv_tiles import _DECODE_MMA_TILES
    from ninfer_kernels.x16 import launch_prepared, x16_prep
    N, K = shape
    blocks = random_ggml_blocks("iq3_s", N, K, 1, DEV)
    p = repack_iq3_s4(blocks, K)
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    ref = reference.ref_iq3_s(x, blocks)
    cfgs = tuner_tiles({T: H2_TILES[T]}, N, K, x.device, h2=True) + tuner_tiles({T: _DECODE_MMA_TILES[T]}, N, K,
                                                                                 x.device, mma=True)
    for cfg in cfgs:
        assert rel_l2(gemv_iq3_s4(x, p, config=cfg), ref) < RTOL_HALF, cfg
        out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device=DEV)
        launch_prepared(iq3_s4_gemv_kernel, (p["codes"], p["sc"], p["d"]), x16_prep(x), N, K, 16, 1.0, out, None,
                        cfg, "test")
        assert rel_l2(out, ref) < RTOL_HALF, cfg


@pytest.mark.parametrize("layout_", ["codes4", "grid"])
def test_prepare_growth_is_the_planes_extra_bytes(monkeypatch, layout_):
    """What a repack adds on CUDA once the blocks are released: the code planes' bytes minus the blocks' (22 %
    more), nothing for the grid planes; nothing once the planes exist. The KV pool's auto size keeps it free
    (`TritonOps.repack_growth`), since the repacks run at warm-up, after the pool is sized."""
    from ninfer_kernels import dispatch
    from ninfer_kernels.gemv_iq3_s4 import repack_growth
    from ninfer_rt.backends.triton_ops import TritonOps
    from ninfer_rt.weights import QWeight
    monkeypatch.setenv(LAYOUT_ENV, layout_)
    N, K = 37, 512
    blocks = random_ggml_blocks("iq3_s", N, K, 3, DEV)
    planes = repack_iq3_s4(blocks, K) if layout_ == "codes4" else None
    want = sum(t.numel() * t.element_size() for t in planes.values()) - blocks.numel() if planes else 0
    assert repack_growth(N, K) == want and (want == 0 or want * 110 == blocks.numel() * 24)
    qw = QWeight("iq3_s", (N, K), {"blocks": blocks.clone()}, name="test.growth")
    from ninfer_kernels import randweights
    other = QWeight("nvfp4", (8, 64), randweights.make("nvfp4", 8, 64, seed=1), name="test.nvfp4")
    assert dispatch.prepare_growth(qw) == 0 if DEV == "cpu" else want     # released on CUDA only
    monkeypatch.setattr(QWeight, "device", property(lambda self: torch.device("cuda")))
    assert dispatch.prepare_growth(qw) == want and dispatch.prepare_growth(other) == 0
    assert TritonOps().repack_growth({"a": qw, "b": other, "norm": torch.ones(3)}) == want
    qw.cache["triton.iq3_s"] = {}           # built already: its bytes are on the device when the pool is sized
    assert dispatch.prepare_growth(qw) == 0
