"""The public codecs API: encode/decode for every registry format, TP slicing, plain formats, f8_e4m3_row,
input validation and the golden vectors in formats/testdata."""
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from codec_oracles import rel_rmse, same_bits
from ninfer_formats import codecs
from ninfer_formats.constants import FORMATS
from ninfer_formats.errors import FormatError, NinferError

GOLDEN = Path(codecs.__file__).resolve().parents[1] / "testdata" / "codec_vectors.json"
# round-trip rel-RMSE ceilings on N(0,1) (quant-formats.md §9; f8/f16/bf16 from their mantissa widths)
RMSE_MAX = {"f32": 0.0, "f16": 1e-3, "bf16": 5e-3, "f8_e4m3_row": 0.04, "nvfp4": 0.11, "q6_k": 0.025,
            "iq3_s": 0.20, "i32": 0.0}
SHAPES = {"f32": (3, 5, 7), "f16": (9, 13), "bf16": (33,), "i32": (4, 6), "f8_e4m3_row": (7, 19),
          "nvfp4": (5, 48), "q6_k": (3, 512), "iq3_s": (2, 512)}


def _weights(fmt, shape, seed=0):
    rng = np.random.default_rng(seed)
    if fmt == "i32":
        return rng.integers(-2**31, 2**31 - 1, shape, dtype=np.int64).astype(np.int32)
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_encode_decode_round_trip(fmt):
    w = _weights(fmt, SHAPES[fmt])
    enc = codecs.encode(fmt, w)
    assert enc.dtype == np.uint8 and enc.ndim == 1 and enc.size == FORMATS[fmt].encoded_size(w.shape)
    dec = codecs.decode(fmt, enc, w.shape)
    assert dec.shape == w.shape
    if fmt == "i32":
        np.testing.assert_array_equal(dec, w)
    else:
        assert dec.dtype == np.float32 and rel_rmse(dec, w) <= RMSE_MAX[fmt]


@pytest.mark.parametrize("fmt", ["q6_k", "iq3_s"])
def test_ggml_quantize_rows_layout(fmt):
    w = _weights(fmt, (2, 512), seed=1)
    q = codecs.quantize(fmt, w)
    assert q.shape == (2, FORMATS[fmt].encoded_size((1, 512)))
    assert same_bits(codecs.dequantize(fmt, q, w.shape), codecs.decode(fmt, q.reshape(-1), w.shape))
    assert same_bits(codecs.dequantize(fmt, q[1], (1, 512)), codecs.dequantize(fmt, q, w.shape)[1:])


CUTS = [  # (fmt, shape, dim, start, stop)
    ("nvfp4", (6, 64), 0, 2, 5), ("nvfp4", (6, 64), 1, 16, 48), ("nvfp4", (3, 32), 1, 0, 16),
    ("q6_k", (4, 768), 0, 1, 3), ("q6_k", (4, 768), 1, 256, 768),
    ("iq3_s", (3, 512), 0, 2, 3), ("iq3_s", (3, 512), 1, 256, 512),
    ("f8_e4m3_row", (5, 21), 0, 1, 4), ("f8_e4m3_row", (5, 21), 1, 3, 20),
    ("bf16", (6, 10), 1, 5, 10), ("f16", (4, 3, 8), 2, 2, 6), ("f32", (9,), 0, 4, 9), ("i32", (4, 6), 0, 0, 2),
]


@pytest.mark.parametrize("fmt,shape,dim,start,stop", CUTS,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}-d{c[2]}-{c[3]}:{c[4]}" for c in CUTS])
def test_slice_matches_decoded_slice_bit_exactly(fmt, shape, dim, start, stop):
    w = _weights(fmt, shape, seed=2) * (np.float32(1e-3) if fmt != "i32" else 1)
    if fmt != "i32":
        w[0] *= 1000      # rows at different magnitudes: the nvfp4 slice must keep the tensor's s2
    enc = codecs.encode(fmt, w)
    part, new_shape = codecs.slice_encoded(fmt, enc, shape, dim, start, stop)
    idx = tuple(slice(start, stop) if d == dim else slice(None) for d in range(len(shape)))
    full = codecs.decode(fmt, enc, shape)[idx]
    assert new_shape == full.shape and part.size == FORMATS[fmt].encoded_size(new_shape)
    got = codecs.decode(fmt, part, new_shape)
    assert np.array_equal(got, full) if fmt == "i32" else same_bits(got, full)
    if fmt == "nvfp4":
        assert codecs.split_nvfp4(part, new_shape)[2] == codecs.split_nvfp4(enc, shape)[2]


@pytest.mark.parametrize("fmt,shape,dim,start,stop,match", [
    ("nvfp4", (2, 64), 1, 8, 32, "16-column block boundary"),
    ("q6_k", (2, 512), 1, 0, 128, "256-column block boundary"),
    ("nvfp4", (2, 64), 2, 0, 1, "cannot slice dim 2"),
    ("q6_k", (2, 512), 0, 1, 1, "empty or outside"),
    ("f8_e4m3_row", (2, 8), 0, 0, 3, "empty or outside"),
], ids=["nvfp4-misaligned", "q6k-misaligned", "bad-dim", "empty", "past-end"])
def test_slice_errors(fmt, shape, dim, start, stop, match):
    enc = codecs.encode(fmt, _weights(fmt, shape))
    with pytest.raises(NinferError, match=match):
        codecs.slice_encoded(fmt, enc, shape, dim, start, stop)


def test_split_nvfp4_views_and_header():
    w = _weights("nvfp4", (4, 32))
    enc = codecs.encode("nvfp4", w)
    codes, scales, s2 = codecs.split_nvfp4(enc, w.shape)
    ref = codecs.nvfp4.quantize(w)
    np.testing.assert_array_equal(codes, ref[0])
    np.testing.assert_array_equal(scales, ref[1])
    assert s2 == ref[2] and np.shares_memory(codes, enc) and not enc[4:16].any()
    bad = enc.copy()
    bad[9] = 1
    with pytest.raises(FormatError, match="header bytes"):
        codecs.decode("nvfp4", bad, w.shape)


def test_bf16_rne_matches_torch_and_accepts_bits():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(2000), [1 + 2**-8, 1 + 3 * 2**-8, 1e-40, -0.0, 3.3e38]]).astype(np.float32)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(codecs.bf16_bits(x), want)
    np.testing.assert_array_equal(codecs.encode("bf16", want).view("<u2"), want)   # uint16 bits pass through
    assert same_bits(codecs.bf16_to_f32(want), torch.from_numpy(want.view(np.int16)).view(torch.bfloat16).float().numpy())
    assert np.isnan(codecs.bf16_to_f32(codecs.bf16_bits(np.float32([np.nan])))).all()
    t = torch.randn(4, 6).to(torch.bfloat16)     # torch tensors are accepted and arrive exactly
    np.testing.assert_array_equal(codecs.encode("bf16", t).view("<u2"), t.view(torch.int16).numpy().view(np.uint16).ravel())


def test_plain_overflow_and_type_errors():
    with pytest.raises(FormatError, match="overflows f16"):
        codecs.encode("f16", np.float32([[1.0, 7e4]]))
    with pytest.raises(FormatError, match="overflows bf16"):
        codecs.encode("bf16", np.float32([3.4e38]))
    with pytest.raises(FormatError, match="integer array"):
        codecs.encode("i32", np.float32([1.0]))
    with pytest.raises(FormatError, match="int32 range"):
        codecs.encode("i32", np.array([2**40]))
    with pytest.raises(FormatError, match="NaN at index"):
        codecs.encode("f32", np.float32([[[0, np.nan]]]))


def test_f8_e4m3_row_matches_ml_dtypes_and_zero_rows():
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((6, 40)) * 10.0 ** rng.uniform(-8, 3, (6, 1))).astype(np.float32)
    w[2] = 0.0
    scale, codes = codecs.fp8.quantize_rows(w)
    want_scale = np.abs(w).max(axis=1).astype(np.float32) / np.float32(448)
    want_scale[2] = 1.0
    np.testing.assert_array_equal(scale, want_scale)
    want = np.clip(w / scale[:, None], -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(codes, want)
    dec = codecs.decode("f8_e4m3_row", codecs.encode("f8_e4m3_row", w), w.shape)
    assert same_bits(dec, want.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale[:, None])
    assert (np.abs(dec).max(axis=1)[[0, 1, 3]] == np.abs(w).max(axis=1)[[0, 1, 3]]).all()  # row max exact


@pytest.mark.parametrize("call,match", [
    (lambda: codecs.encode("nvfp4", np.ones((2, 16), np.float32), global_scale="half"), "global scale must be a float"),
    (lambda: codecs.encode("q6_k", np.ones((2, 256), np.float32), global_scale=1.0), "nvfp4 only"),
    (lambda: codecs.encode("fp4", np.ones((2, 16), np.float32)), "unknown numeric format 'fp4'"),
    (lambda: codecs.encode("q6_k", [[1.0] * 256]), "numpy array or torch tensor"),
    (lambda: codecs.encode("q6_k", np.ones((2, 2, 256), np.float32)), "rank 2"),
    (lambda: codecs.decode("nvfp4", np.zeros(10, np.uint8), (2, 16)), "needs 34 bytes, got 10"),
    (lambda: codecs.decode("bf16", np.zeros(4, np.float32), (8,)), "uint8 bytes"),
    (lambda: codecs.quantize("nvfp4", np.ones((2, 16), np.float32)), "not a GGML block format"),
    (lambda: codecs.decode("f8_e4m3_row", np.full(16 + 8, 0x7F, np.uint8), (1, 8)), "not finite|NaN"),
    (lambda: codecs.encode("nvfp4", np.ones((0, 16), np.float32)), "cannot be empty"),
], ids=["bad-gscale", "gscale-not-nvfp4", "unknown-fmt", "list-input", "rank3", "short-data", "dtype",
        "quantize-nvfp4", "f8-nan", "empty"])
def test_errors_are_one_line_format_errors(call, match):
    with pytest.raises(FormatError, match=match) as e:
        call()
    assert "\n" not in str(e.value)


def test_error_names_tensor_and_position():
    w = np.zeros((4, 32), np.float16)
    w[3, 30] = np.inf
    with pytest.raises(FormatError, match=r"^layers\.3\.mlp\.down_proj\.weight: nvfp4 input has Inf at row 3, col 30$"):
        codecs.encode("nvfp4", w, name="layers.3.mlp.down_proj.weight")


def test_golden_vectors():
    cases = json.loads(GOLDEN.read_text())["cases"]
    assert {c["format"] for c in cases} >= {"nvfp4", "q6_k", "f8_e4m3_row", "bf16"}
    for c in cases:
        shape = tuple(c["shape"])
        w = np.array(c["input"], np.float32).reshape(shape)
        want = np.frombuffer(bytes.fromhex(c["encoded_hex"]), np.uint8)
        np.testing.assert_array_equal(codecs.encode(c["format"], w), want, err_msg=c["format"])
        assert same_bits(codecs.decode(c["format"], want, shape), np.array(c["decoded"], np.float32).reshape(shape))
