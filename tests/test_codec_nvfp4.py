"""NVFP4 codec vs an independent ModelOpt transcription on ml_dtypes (tests/codec_oracles.py)."""
import zlib

import ml_dtypes
import numpy as np
import pytest

from codec_oracles import nvfp4_reference, nvfp4_reference_decode, rel_rmse, same_bits
from ninfer_formats.codecs import fp8, nvfp4
from ninfer_formats.errors import FormatError

RMSE_GAUSS_MAX = 0.11       # quant-formats.md §9 regression threshold (measured 9.5 %)
RMSE_T5_MAX = 0.11


def _gauss(rng, n, k):
    return rng.standard_normal((n, k)).astype(np.float32)


def _outliers(rng, n, k):
    w = _gauss(rng, n, k) * 0.01
    w[rng.integers(0, n, 5), rng.integers(0, k, 5)] = rng.choice([-1, 1], 5) * 300.0
    return w


def _decades(rng, n, k):   # blocks spanning 12 decades: many land on subnormal / clamped E4M3 scales
    mult = (10.0 ** rng.uniform(-9, 3, (n, k // 16, 1))).repeat(16, -1).reshape(n, k)
    return (_gauss(rng, n, k) * mult).astype(np.float32)


def _zero_blocks(rng, n, k):
    w = _gauss(rng, n, k)
    w[:, :8] = -0.0
    w[1:, :16] = 0.0        # (row 0 keeps a non-zero block so the tensor is never all zero)
    w[1::2, 16:32] = -0.0
    w[2:3] = 0.0
    return w


def _all_equal_rows(rng, n, k):
    return np.repeat(rng.standard_normal((n, 1)), k, axis=1).astype(np.float32)


def _bf16_rounded(rng, n, k):
    w = _gauss(rng, n, k)
    return ((w.view(np.uint32) + 0x8000) & 0xFFFF0000).view(np.float32)


INPUTS = {"gauss": _gauss, "outliers": _outliers, "decades": _decades, "zero_blocks": _zero_blocks,
          "all_equal_rows": _all_equal_rows, "bf16_rounded": _bf16_rounded,
          "student_t3": lambda rng, n, k: rng.standard_t(3, (n, k)).astype(np.float32)}
SHAPES = [(1, 16), (3, 48), (17, 160), (64, 512)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", list(INPUTS))
def test_matches_modelopt_reference(kind, shape):
    w = INPUTS[kind](np.random.default_rng(zlib.crc32(f"{kind}{shape}".encode())), *shape)
    codes, scales, s2 = nvfp4.quantize(w)
    rc, rs, rs2 = nvfp4_reference(w)
    assert s2 == rs2 and s2.dtype == np.float32
    np.testing.assert_array_equal(scales, rs)
    np.testing.assert_array_equal(codes, rc)
    assert same_bits(nvfp4.dequantize(codes, scales, s2), nvfp4_reference_decode(rc, rs, rs2))


def test_ties_round_to_even_code_and_saturate():
    # global scale 1 and a 6 in the block make the block scale exactly 1.0, so q == w
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -5.0, -0.1, -0.0, 0.0, 0.3, 7.0]
    w = np.array([ties], dtype=np.float32)
    w[0, -1] = 6.0
    codes, scales, _ = nvfp4.quantize(w, global_scale=1.0)
    assert scales[0, 0] == 0x38  # E4M3 1.0
    nib = np.stack([codes[0] & 0xF, codes[0] >> 4], -1).reshape(-1)
    # 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4, 6, negatives, tiny neg -> 0x8, -0.0 -> 0x0
    assert nib.tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 14, 8, 0, 0, 1, 7]


def test_block_scale_rounding_saturates_codes():
    # amax_b / 6 = 1.0625 is an E4M3 tie that rounds down to 1.0, so the block max scales to 6.375 -> 6
    w = np.zeros((1, 32), np.float32)
    w[0, 0], w[0, 16] = 6.375, 6.0
    codes, scales, _ = nvfp4.quantize(w, global_scale=1.0)
    assert scales[0].tolist() == [0x38, 0x38] and codes[0, 0] & 0xF == 7


def test_zero_tensor_and_zero_blocks():
    codes, scales, s2 = nvfp4.quantize(np.zeros((2, 32), np.float32))
    assert s2 == 1.0 and not codes.any() and (scales == 0x38).all()
    with np.errstate(divide="raise", invalid="raise"):   # s2 would be subnormal: as if all zero
        codes, scales, s2 = nvfp4.quantize(np.full((1, 16), 1e-36, np.float32))
    assert s2 == 1.0 and not codes.any() and (scales == 0x01).all()  # block scale clamped to 2^-9
    w = np.zeros((1, 32), np.float32)
    w[0, 16:] = np.linspace(-1, 1, 16)
    w[0, :16] = -0.0
    codes, scales, s2 = nvfp4.quantize(w)
    assert scales[0, 0] == 0x38 and not codes[0, :8].any()


def test_fusion_group_shares_global_scale():
    rng = np.random.default_rng(1)
    a, b = _gauss(rng, 4, 32), 3 * _gauss(rng, 8, 32)
    g = nvfp4.global_scale(a, b)
    assert g == np.float32(max(np.abs(a).max(), np.abs(b).max())) / np.float32(2688)
    for w in (a, b):
        assert nvfp4.quantize(w, g)[2] == g
        np.testing.assert_array_equal(nvfp4.quantize(w, g)[0], nvfp4_reference(w, g)[0])


def test_e4m3_encode_matches_ml_dtypes_everywhere():
    lut = fp8.E4M3_LUT[:0x7F].astype(np.float64)   # all finite non-negative values, ascending
    mids = (lut[1:] + lut[:-1]) / 2
    near = np.concatenate([lut, mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9), [448.0, 460, 464]])
    rng = np.random.default_rng(2)
    x = np.concatenate([near, -near, rng.uniform(0, 448, 4000), 2.0 ** rng.uniform(-12, 8.8, 4000)])
    x = x.astype(np.float32)
    np.testing.assert_array_equal(fp8.e4m3_encode(x), x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    with np.errstate(all="raise"):   # saturation, not overflow or NaN
        assert fp8.e4m3_encode(np.float32([1e6, -500, 3e38, -np.inf])).tolist() == [0x7E, 0xFE, 0x7E, 0xFE]


def test_decode_random_bytes_matches_reference():
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 256, (9, 40), dtype=np.uint8)
    scales = rng.integers(0, 0x7F, (9, 5), dtype=np.uint8)
    s2 = np.float32(0.37)
    assert same_bits(nvfp4.dequantize(codes, scales, s2), nvfp4_reference_decode(codes, scales, s2))


def test_decode_rejects_negative_or_nan_scales():
    codes = np.zeros((2, 8), np.uint8)
    for bad in (0x7F, 0xB8):
        scales = np.full((2, 1), 0x38, np.uint8)
        scales[1, 0] = bad
        with pytest.raises(FormatError, match="row 1, block 0"):
            nvfp4.dequantize(codes, scales, 1.0)


@pytest.mark.parametrize("dist,limit", [("gauss", RMSE_GAUSS_MAX), ("student_t5", RMSE_T5_MAX)])
def test_round_trip_error_bounds(dist, limit):
    rng = np.random.default_rng(4)
    w = _gauss(rng, 256, 1024) if dist == "gauss" else rng.standard_t(5, (256, 1024)).astype(np.float32)
    err = rel_rmse(nvfp4.dequantize(*nvfp4.quantize(w)), w)
    assert 0.05 < err < limit


def test_input_validation():
    w = np.ones((3, 32), np.float32)
    w[2, 17] = np.nan
    with pytest.raises(FormatError, match="row 2, col 17"):
        nvfp4.quantize(w, name="layers.0.mlp.up_proj.weight")
    with pytest.raises(FormatError, match="multiple of 16"):
        nvfp4.quantize(np.ones((2, 24), np.float32))
    with pytest.raises(FormatError, match="rank 2"):
        nvfp4.quantize(np.ones(32, np.float32))
    with pytest.raises(FormatError, match="float32 or float16"):
        nvfp4.quantize(np.ones((2, 16), np.float64))
    for bad in (0.0, -1.0, np.inf, 1e-40):
        with pytest.raises(FormatError, match="global scale"):
            nvfp4.quantize(np.ones((2, 16), np.float32), global_scale=bad)
