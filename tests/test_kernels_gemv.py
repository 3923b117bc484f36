"""Fused dequant-GEMV kernels vs the codec-based torch references.

Without CUDA the kernels run under TRITON_INTERPRET=1 (set here before ninfer_kernels is imported, or by
tools/test.sh) on small odd shapes; with CUDA (and no TRITON_INTERPRET) the same tests run compiled, and the
`gpu` tests add the real Qwen3.8 shapes.
"""
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gemv_inputs import run_kernel  # noqa: E402
from ninfer_formats import codecs  # noqa: E402
from ninfer_kernels import dispatch, randweights, reference  # noqa: E402
from ninfer_kernels.gemv_f8 import dequant_f8, gemv_f8  # noqa: E402
from ninfer_kernels.gemv_iq3_s import dequant_iq3_s, gemv_iq3_s, repack_iq3_s  # noqa: E402
from ninfer_kernels.gemv_launch import GemvConfig, KernelInputError, interpreting, workspace  # noqa: E402
from ninfer_kernels.gemv_nvfp4 import dequant_nvfp4, gemv_nvfp4, repack_nvfp4  # noqa: E402
from ninfer_kernels.gemv_plain import gemv_plain  # noqa: E402
from ninfer_kernels.gemv_q6_k import dequant_q6_k, gemv_q6_k, repack_q6_k  # noqa: E402
from ninfer_rt.weights import QWeight  # noqa: E402

RTOL_FP32 = 1e-5     # fp32 activations: only summation order differs
RTOL_HALF = 1e-2     # fp16/bf16 activations: output rounding (bf16: 2^-9) dominates
RTOL_DEQUANT = 1e-6  # dense weights: at most two fp32 roundings per weight
DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
FMTS = ("nvfp4", "q6_k", "iq3_s", "f8_e4m3_row", "bf16", "f16", "f32")
K_SMALL = {"nvfp4": 80, "q6_k": 512, "iq3_s": 512, "f8_e4m3_row": 88, "bf16": 84, "f16": 84, "f32": 86}
K_RAGGED = {"nvfp4": 176, "q6_k": 768, "iq3_s": 768, "f8_e4m3_row": 200, "bf16": 100, "f16": 100, "f32": 98}
N_SMALL = 37
GS = {"nvfp4": 16, "q6_k": 16, "iq3_s": 16, "f8_e4m3_row": 8, "f32": 2}   # weights per group (plain: 4)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def rtol(dtype) -> float:
    return RTOL_FP32 if dtype == torch.float32 else RTOL_HALF


def quantized(fmt: str, N: int, K: int, seed: int = 0) -> QWeight:
    """A weight quantized from N(0, 1) by the numpy codecs (the packer's path)."""
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05
    if fmt == "nvfp4":
        c, s, g = codecs.nvfp4.quantize(w)
        data = {"codes": torch.from_numpy(c), "scales": torch.from_numpy(s), "gscale": float(g)}
    elif fmt in ("q6_k", "iq3_s"):
        data = {"blocks": torch.from_numpy(codecs.quantize(fmt, w))}
    elif fmt == "f8_e4m3_row":
        s, c = codecs.fp8.quantize_rows(w)
        data = {"codes": torch.from_numpy(c), "row_scale": torch.from_numpy(s)}
    else:
        data = {"w": torch.from_numpy(w).to({"bf16": torch.bfloat16, "f16": torch.float16}.get(fmt, torch.float32))}
    data = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in data.items()}
    return QWeight(fmt, (N, K), data, name=f"test.{fmt}")


def poisoned(T: int, N: int, dtype) -> torch.Tensor:
    return torch.full((T, N), float("nan"), dtype=dtype, device=DEV)


@pytest.mark.parametrize("T,dtype", [(1, torch.float32), (3, torch.bfloat16), (16, torch.float16)],
                         ids=["T1-f32", "T3-bf16", "T16-f16"])
@pytest.mark.parametrize("fmt", FMTS)
def test_gemv_matches_reference(fmt, T, dtype):
    K = K_SMALL[fmt]
    qw = quantized(fmt, N_SMALL, K, seed=T)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, K, generator=g).to(dtype).to(DEV)
    res = torch.randn(T, N_SMALL, generator=g).to(dtype).to(DEV)
    y = run_kernel(qw, x, out=poisoned(T, N_SMALL, dtype), residual=res)
    ref = reference.ref_linear(x, fmt, qw, residual=res)
    assert y.dtype == dtype and y.shape == (T, N_SMALL) and torch.isfinite(y).all()
    assert rel_l2(y, ref) < rtol(dtype)


PATHS = {"split-ragged": (2, torch.float32, 64, dict(split=3)),
         # more partials than the reduction loads per round (gemv_split.SPLIT_UNROLL), the last round partial
         "split-rounds": (3, torch.float16, 32, dict(split=6)),
         "dot-split": (5, torch.float16, 16, dict(split=2, use_dot=True)),
         "dot-ttiles": (21, torch.float32, 16, dict(use_dot=True, t_tile=16)),
         # bf16 activations (nvfp4: x * 2**64 as one integer multiply-add) through the register-prefetch loop
         "prefetch-bf16": (3, torch.bfloat16, 32, dict(split=2, num_stages=2)),
         "load-then-decode": (2, torch.float16, 64, dict(num_stages=1))}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", FMTS)
def test_gemv_paths(fmt, path):
    """Split-K (partials + last-CTA epilogue), ragged K tails, several row blocks and T tiles, tl.dot."""
    T, dtype, bn, kw = PATHS[path]
    K = K_RAGGED[fmt]
    gs = GS.get(fmt, 4)
    bg = max(4, 16 // gs) if (K // gs) % max(4, 16 // gs) else 32  # a block that leaves a K tail
    qw = quantized(fmt, N_SMALL, K, seed=7)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEV)
    cfg = GemvConfig(bn, bg, **kw)
    y = run_kernel(qw, x, out=poisoned(T, N_SMALL, dtype), config=cfg)
    assert rel_l2(y, reference.ref_linear(x, fmt, qw)) < rtol(dtype)
    if cfg.split > 1:  # deterministic, and the arrival counters are back at zero for the next launch
        assert torch.equal(run_kernel(qw, x, config=cfg), y)
        assert int(workspace(x.device, 0, 0)[1].abs().sum()) == 0


@pytest.mark.parametrize("fmt", FMTS)
def test_gemv_fma_dot_step(fmt):
    """The sm_70 tl.dot tiles (gemv_tiles.FMA_DOT_K weights per step, 2 groups of NVFP4: the scale bytes'
    byte-load route) give the reference, with split-K and a ragged K tail."""
    from ninfer_kernels.gemv_tiles import FMA_DOT_K, dot_block_g
    gs = GS.get(fmt, 4)
    qw = quantized(fmt, N_SMALL, K_RAGGED[fmt], seed=11)
    x = torch.randn(6, K_RAGGED[fmt], generator=torch.Generator().manual_seed(4)).to(torch.float16).to(DEV)
    cfg = GemvConfig(16, dot_block_g(FMA_DOT_K, gs), split=2, use_dot=True)
    y = run_kernel(qw, x, out=poisoned(6, N_SMALL, torch.float16), config=cfg)
    assert rel_l2(y, reference.ref_linear(x, fmt, qw)) < rtol(torch.float16)


def test_nvfp4_large_global_scale_dot_path():
    """gscale too large to fold e4m3 * 2**126 * gscale into one fp32 multiplier: the two-step scaling."""
    qw = quantized("nvfp4", N_SMALL, 64, seed=3)
    x = torch.randn(4, 64).to(torch.float16).to(DEV)
    d = qw.data
    y = gemv_nvfp4(x, repack_nvfp4(d["codes"], d["scales"]), 0.75, config=GemvConfig(16, 4, use_dot=True))
    ref = reference.ref_nvfp4(x, d["codes"], d["scales"], 0.75)
    assert torch.isfinite(y).all() and rel_l2(y, ref) < RTOL_HALF


@pytest.mark.parametrize("bg,split", [(4, 1), (8, 3), (16, 2)], ids=["g4", "g8-split3", "g16-split2"])
def test_nvfp4_dot_word_scales(bg, split):
    """The tl.dot route on whole tiles reads the E4M3 scale bytes as int32 words (4 groups each): every byte
    value at every position of a word, several tiles and splits, and a scales plane starting at an odd byte
    (re-aligned by a copy) give the reference."""
    K, n = 512, 24
    qw = quantized("nvfp4", n, K, seed=5)
    codes = qw.data["codes"]
    sc = (torch.arange(n * K // 16) * 7 % 127).to(torch.uint8).reshape(n, K // 16).to(DEV)   # 0x00..0x7E
    planes = repack_nvfp4(codes, sc)
    odd = torch.empty(planes["scales"].numel() + 1, dtype=torch.uint8, device=DEV)[1:].view(planes["scales"].shape)
    odd.copy_(planes["scales"])
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(2)).to(DEV)
    for scales in (planes["scales"], odd):
        y = gemv_nvfp4(x, {"codes": planes["codes"], "scales": scales}, 0.5, out=poisoned(5, n, torch.float32),
                       config=GemvConfig(16, bg, split=split, use_dot=True))
        assert torch.isfinite(y).all() and rel_l2(y, reference.ref_nvfp4(x, codes, sc, 0.5)) < RTOL_FP32


def test_decode_every_code_pattern():
    """Dense weights from the kernels' decode vs the codecs on all codes: every E2M1 nibble with normal and
    subnormal E4M3 block scales, all non-NaN E4M3 bytes, random GGML block bytes."""
    rng = np.random.default_rng(3)
    codes = (np.arange(12 * 128) % 256).astype(np.uint8).reshape(12, 128)       # [12, K/2]: every byte
    scales = np.array([0x01, 0x07, 0x08, 0x38, 0x7E, 0x30] * 32, dtype=np.uint8).reshape(12, 16)
    ref = codecs.nvfp4.dequantize(codes, scales, np.float32(0.37))
    got = dequant_nvfp4(repack_nvfp4(torch.from_numpy(codes).to(DEV), torch.from_numpy(scales).to(DEV)), 256, 0.37,
                        torch.float32)
    assert rel_l2(got, torch.from_numpy(ref)) < RTOL_DEQUANT
    f8 = np.concatenate([np.arange(256, dtype=np.uint8)[(np.arange(256) & 0x7F) != 0x7F],
                         np.zeros(2, np.uint8)]).reshape(2, 128)
    rs = np.array([0.5, 3e-3], dtype=np.float32)
    ref = codecs.decode("f8_e4m3_row", codecs.fp8.join(rs, f8), f8.shape)
    got = dequant_f8(torch.from_numpy(f8).to(DEV), torch.from_numpy(rs).to(DEV), torch.float32)
    assert torch.equal(got.cpu(), torch.from_numpy(ref))
    for fmt, repack, deq in (("q6_k", repack_q6_k, dequant_q6_k), ("iq3_s", repack_iq3_s, dequant_iq3_s)):
        blocks = randweights.make(fmt, 9, 768, seed=int(rng.integers(1 << 30)))["blocks"]
        ref = codecs.dequantize(fmt, blocks.numpy(), (9, 768))
        got = deq(repack(blocks.to(DEV), 768), 768, torch.float32)
        assert torch.equal(got.cpu(), torch.from_numpy(ref)), fmt


@pytest.mark.parametrize("path", ["fused", "dequant"])
@pytest.mark.parametrize("fmt", ("nvfp4", "q6_k", "iq3_s", "f8_e4m3_row", "bf16"))
def test_linear_prefill_paths(fmt, path):
    K = K_SMALL[fmt]
    qw = quantized(fmt, N_SMALL, K, seed=11)
    x = torch.randn(2, 10, K, generator=torch.Generator().manual_seed(2)).to(DEV)   # T = 20 > 16
    res = torch.randn(2, 10, N_SMALL).to(DEV)
    y = dispatch.linear(x, qw, residual=res, prefill_path=path)
    ref = reference.ref_linear(x.reshape(20, K), fmt, qw, residual=res.reshape(20, N_SMALL))
    assert y.shape == (2, 10, N_SMALL)
    assert rel_l2(y.reshape(20, N_SMALL), ref) < RTOL_FP32


@pytest.mark.parametrize("fmt", ("q6_k", "iq3_s", "f16"))
def test_linear_decode_caches_repack(fmt):
    qw = quantized(fmt, N_SMALL, K_SMALL[fmt], seed=5)
    dispatch.prepare(qw)
    x = torch.randn(4, K_SMALL[fmt]).to(DEV)
    out = poisoned(4, N_SMALL, torch.float32)
    assert dispatch.linear(x, qw, out=out) is out
    assert rel_l2(out, reference.ref_linear(x, fmt, qw)) < RTOL_FP32
    assert (f"triton.{fmt}" in qw.cache) == (fmt in ("q6_k", "iq3_s"))


@pytest.mark.parametrize("T", [2, 20], ids=["decode", "prefill"])
def test_in_place_residual(T):
    """out may be the residual itself (h += x @ W^T), decode and prefill."""
    qw = quantized("q6_k", N_SMALL, 256, seed=9)
    x = torch.randn(T, 256).to(DEV)
    h = torch.randn(T, N_SMALL).to(DEV)
    ref = reference.ref_linear(x, "q6_k", qw, residual=h.clone())
    assert dispatch.linear(x, qw, out=h, residual=h) is h
    assert rel_l2(h, ref) < RTOL_FP32


@pytest.mark.parametrize("fmt", ("nvfp4", "iq3_s", "bf16"))
def test_linear_decode_plan_reuse_and_fallback(fmt):
    """The second decode call runs from the weight's cached plan; calls that do not fit it (another out
    stride, a residual, a bad out) take the checked path and still give the right answer or a named error."""
    K = K_SMALL[fmt]
    qw = quantized(fmt, N_SMALL, K, seed=11)
    x = torch.randn(3, K).to(DEV)
    ref = reference.ref_linear(x, fmt, qw)
    first = dispatch.linear(x, qw)
    plans = qw.cache["triton.plans"]
    assert list(plans) == [(3, torch.float32, False)]
    out = poisoned(3, N_SMALL, torch.float32)
    assert dispatch.linear(x, qw, out=out) is out and torch.equal(out, first)
    assert rel_l2(out, ref) < RTOL_FP32
    wide = poisoned(3, N_SMALL + 5, torch.float32)[:, :N_SMALL]     # row stride != N: the plan's launch path
    dispatch.linear(x, qw, out=wide)
    assert torch.equal(wide, first)
    res = torch.randn(3, N_SMALL).to(DEV)
    y = dispatch.linear(x, qw, residual=res)
    assert rel_l2(y, reference.ref_linear(x, fmt, qw, residual=res)) < RTOL_FP32
    assert (3, torch.float32, True) in plans
    with pytest.raises(KernelInputError, match="out must be"):
        dispatch.linear(x, qw, out=torch.zeros(3, N_SMALL, dtype=torch.float16, device=DEV))


def test_bad_inputs_are_named():
    qw = quantized("nvfp4", 8, 32)
    d = qw.data
    p = repack_nvfp4(d["codes"], d["scales"])
    with pytest.raises(KernelInputError, match="activations must be"):
        gemv_nvfp4(torch.zeros(3, dtype=torch.float32, device=DEV), p, 1.0)
    with pytest.raises(KernelInputError, match="K=40 is not a multiple of 16"):
        gemv_nvfp4(torch.zeros(1, 40, device=DEV), p, 1.0)
    with pytest.raises(KernelInputError, match="scales must be"):
        gemv_nvfp4(torch.zeros(1, 32, device=DEV), {"codes": p["codes"], "scales": p["scales"][:, :1]}, 1.0)
    with pytest.raises(KernelInputError, match="codes must be"):
        gemv_nvfp4(torch.zeros(1, 160, device=DEV), p, 1.0)              # planes of K=32 for K=160 activations
    with pytest.raises(KernelInputError, match="repack_nvfp4's planes"):
        gemv_nvfp4(torch.zeros(1, 32, device=DEV), d["codes"], 1.0)
    with pytest.raises(KernelInputError, match="codes must be u8"):
        repack_nvfp4(d["codes"], d["scales"][:, :1])
    with pytest.raises(KernelInputError, match="out must be"):
        gemv_nvfp4(torch.zeros(2, 32, device=DEV), p, 1.0, out=torch.zeros(2, 9, device=DEV))
    with pytest.raises(KernelInputError, match="blocks must be u8"):
        repack_q6_k(torch.zeros(4, 100, dtype=torch.uint8), 256)
    with pytest.raises(KernelInputError, match="x must end in K=32"):
        dispatch.linear(torch.zeros(2, 31, device=DEV), qw)
    with pytest.raises(ValueError, match="power of two"):
        GemvConfig(48, 4)
    assert dispatch.linear(torch.zeros(2, 0, 32, device=DEV), qw).shape == (2, 0, 8)


# ---- real shapes (GPU only) ------------------------------------------------------------------------
GPU_SHAPES = [(14336, 5120), (5120, 6144), (5120, 8704), (124160, 5120)]


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA (and TRITON_INTERPRET unset)")
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("fmt", FMTS)
def test_gpu_real_shapes(fmt, shape):
    N, K = shape
    qw = QWeight(fmt, shape, randweights.make(fmt, N, K, device="cuda", seed=N % 97), name="gpu")
    rows = np.unique(np.concatenate([np.arange(8), np.arange(N - 8, N), np.random.default_rng(0).integers(0, N, 240)]))
    for T, dtype in ((1, torch.bfloat16), (8, torch.float16), (16, torch.bfloat16), (40, torch.bfloat16)):
        x = torch.randn(T, K, device="cuda").to(dtype)
        res = torch.randn(T, N, device="cuda").to(dtype)
        y = dispatch.linear(x, qw, residual=res)
        ref = reference.ref_linear(x, fmt, qw, residual=res, rows=rows)
        assert rel_l2(y[:, torch.as_tensor(rows, device="cuda")], ref) < RTOL_HALF, (T, dtype)
