"""Q6_K: encoder byte-identical to ggml (ggml-python), decoder bit-identical to gguf (quant-formats.md §8)."""
import zlib

import numpy as np
import pytest

from codec_oracles import ggml_quantize, gguf_dequantize, rel_rmse, same_bits
from ninfer_formats import codecs
from ninfer_formats.codecs import q6_k
from ninfer_formats.errors import FormatError

Q6_K_TYPE = 14              # GGML_TYPE_Q6_K
RMSE_GAUSS_MAX = 0.025      # quant-formats.md §9 regression threshold (measured 1.77 %)


def _gauss(rng, n, k):
    return rng.standard_normal((n, k)).astype(np.float32)


def _decades(rng, n, k):   # every 16-weight sub-block at its own magnitude, 1e-12 .. 1e4
    mult = (10.0 ** rng.uniform(-12, 4, (n, k // 16, 1))).repeat(16, -1).reshape(n, k)
    return (_gauss(rng, n, k) * mult).astype(np.float32)


def _outliers(rng, n, k):
    w = _gauss(rng, n, k) * 0.02
    w[rng.integers(0, n, 6), rng.integers(0, k, 6)] = rng.choice([-1, 1], 6) * 40.0
    return w


def _zero_parts(rng, n, k):  # whole zero rows/blocks, zero sub-blocks, sub-blocks around ggml's 1e-15 cut
    w = _gauss(rng, n, k)
    w[0, :16] = 0.0
    w[0, 32:48] = 1e-16
    w[0, 48:64] = 2e-15
    w[:, 256:512] = 0.0
    w[-1] = 0.0
    return w


def _all_equal(rng, n, k):
    w = np.repeat(rng.standard_normal((n, 1)), k, axis=1).astype(np.float32)
    w[1] = -0.75
    return w


def _bf16_small(rng, n, k):  # realistic LLM weight scale: fp16 d is subnormal
    w = _gauss(rng, n, k) * 0.02
    return ((w.view(np.uint32) + 0x8000) & 0xFFFF0000).view(np.float32)


INPUTS = {"gauss": _gauss, "decades": _decades, "outliers": _outliers, "zero_parts": _zero_parts,
          "all_equal": _all_equal, "bf16_small": _bf16_small,
          "student_t3": lambda rng, n, k: rng.standard_t(3, (n, k)).astype(np.float32),
          "huge": lambda rng, n, k: _gauss(rng, n, k) * np.float32(3e6)}
SHAPES = [(3, 768), (40, 512)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", list(INPUTS))
def test_quantize_byte_identical_to_ggml(kind, shape):
    w = INPUTS[kind](np.random.default_rng(zlib.crc32(f"{kind}{shape}".encode())), *shape)
    ours = codecs.quantize("q6_k", w)
    ref = ggml_quantize(Q6_K_TYPE, w)
    assert ours.shape == ref.shape == (shape[0], shape[1] // 256 * 210)
    bad = np.argwhere((ours != ref).reshape(-1, 210).any(axis=1)).ravel()
    assert bad.size == 0, f"{bad.size} blocks differ, first {bad[:5]}"


def test_quantize_byte_identical_large_random():
    rng = np.random.default_rng(11)   # 2,048 blocks = 32k sub-blocks: catches rare tie differences
    w = rng.standard_normal((64, 8192)).astype(np.float32) * rng.uniform(0.01, 3, (64, 1)).astype(np.float32)
    np.testing.assert_array_equal(codecs.quantize("q6_k", w), ggml_quantize(Q6_K_TYPE, w))


@pytest.mark.parametrize("kind", ["gauss", "decades", "zero_parts", "huge"])
def test_dequantize_bit_identical_to_gguf(kind):
    w = INPUTS[kind](np.random.default_rng(zlib.crc32(kind.encode())), 5, 512)
    blocks = ggml_quantize(Q6_K_TYPE, w)
    assert same_bits(codecs.dequantize("q6_k", blocks, w.shape), gguf_dequantize("q6_k", blocks))


def test_dequantize_random_bytes_bit_identical():
    rng = np.random.default_rng(12)
    blocks = rng.integers(0, 256, (7, 3, 210), dtype=np.uint8)
    d = rng.standard_normal((7, 3)).astype(np.float16) * np.float16(rng.choice([1e-4, 1, 100], (7, 3)))
    blocks[..., 208:210] = d.astype("<f2")[..., None].view(np.uint8)
    blocks = blocks.reshape(7, 630)
    assert same_bits(codecs.dequantize("q6_k", blocks, (7, 768)), gguf_dequantize("q6_k", blocks))


def test_dequantize_rejects_non_finite_d():
    blocks = np.zeros((2, 420), np.uint8)
    blocks[1, 210 + 208:210 + 210] = np.array([np.inf], "<f2").view(np.uint8)
    with pytest.raises(FormatError, match="block 1 of row 1"):
        codecs.dequantize("q6_k", blocks, (2, 512))


def test_round_trip_error_bound():
    w = _gauss(np.random.default_rng(13), 256, 1024)
    err = rel_rmse(codecs.dequantize("q6_k", codecs.quantize("q6_k", w), w.shape), w)
    assert 0.01 < err < RMSE_GAUSS_MAX


def test_zero_block_is_all_zero_bytes():
    w = np.zeros((2, 512), np.float32)
    w[1, 300] = 1.0
    q = codecs.quantize("q6_k", w)
    assert not q[0].any() and not q[1, :210].any() and q[1, 210:].any()


def test_input_validation():
    with pytest.raises(FormatError, match="multiple of 256"):
        codecs.quantize("q6_k", np.ones((2, 300), np.float32))
    w = np.ones((2, 256), np.float32)
    w[1, 7] = -np.inf
    with pytest.raises(FormatError, match="Inf at row 1, col 7"):
        codecs.quantize("q6_k", w, name="lm_head.weight")
    with pytest.raises(FormatError, match="largest representable"):
        codecs.quantize("q6_k", np.full((1, 256), q6_k.MAX_ABS * 2, np.float32))
    with pytest.raises(FormatError, match="needs 420 bytes"):
        codecs.dequantize("q6_k", np.zeros(400, np.uint8), (1, 512))
