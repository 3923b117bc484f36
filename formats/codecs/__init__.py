"""Numeric codecs: numpy reference encoders/decoders for every format in `constants.FORMATS`.

    quantize(fmt, w) / dequantize(fmt, data, shape)      GGML rows of blocks, fmt in {"q6_k", "iq3_s"}
    nvfp4.quantize / nvfp4.dequantize / nvfp4.global_scale
    encode(fmt, w, *, global_scale=None) / decode(fmt, data, shape)   container bytes, any format
    split_nvfp4(data, shape) -> (codes, scales, global_scale) views
    slice_encoded(fmt, data, shape, dim, start, stop) -> (bytes, new_shape)
    bf16_bits(f32) / bf16_to_f32(u16)

Weights are numpy float32/float16 arrays or torch tensors (`.float().numpy()`); bf16 numpy data is uint16
bits (accepted by encode("bf16", ...) as is). Bad input raises `FormatError` with a one-line message; every
function takes an optional `name=` (the tensor name) that the message starts with.
"""
from __future__ import annotations

import numpy as np

from ..constants import FORMATS
from ..errors import FormatError
from . import fp8, nvfp4, plain, q6_k
from .inputs import check_shape, encoded_bytes, float_weights, to_numpy
from .plain import bf16_bits, bf16_to_f32
from .slicing import slice_encoded

__all__ = ["quantize", "dequantize", "encode", "decode", "split_nvfp4", "slice_encoded",
           "bf16_bits", "bf16_to_f32", "nvfp4", "fp8", "plain", "q6_k", "GGML_FORMATS"]

GGML_FORMATS = ("q6_k", "iq3_s")


def _ggml_module(fmt: str, name: str):
    if fmt == "q6_k":
        return q6_k
    if fmt == "iq3_s":
        try:
            from . import iq3_s  # lazily: it builds large tables on import
        except ImportError as e:
            raise FormatError(f"{name}: the iq3_s codec is not available ({e})") from None
        return iq3_s
    raise FormatError(f"{name}: {fmt!r} is not a GGML block format (expected one of {', '.join(GGML_FORMATS)})")


def quantize(fmt: str, w, *, name: str = "tensor") -> np.ndarray:
    """[rows, K] float weights -> u8 [rows, K/256 * block bytes] (GGML row layout)."""
    mod = _ggml_module(fmt, name)
    return mod.quantize_rows(float_weights(w, fmt, name))


def dequantize(fmt: str, data, shape, *, name: str = "tensor") -> np.ndarray:
    """GGML blocks ([rows, bytes_per_row] or flat) -> float32 [rows, cols]."""
    mod = _ggml_module(fmt, name)
    flat, shape = encoded_bytes(fmt, np.ascontiguousarray(data), shape, name)
    return mod.dequantize_rows(flat.reshape(shape[0], -1), shape)


def encode(fmt: str, w, *, global_scale=None, name: str = "tensor") -> np.ndarray:
    """Container bytes (flat uint8) of `w` in `fmt`; `global_scale` is for nvfp4 fusion groups only."""
    w = to_numpy(w, name)
    check_shape(fmt, w.shape, name)
    if global_scale is not None and fmt != "nvfp4":
        raise FormatError(f"{name}: global_scale applies to nvfp4 only, not {fmt}")
    if fmt in plain.PLAIN:
        out = plain.encode(fmt, w, name)
    elif fmt == "nvfp4":
        out = nvfp4.encode(w, global_scale, name)
    elif fmt == "f8_e4m3_row":
        out = fp8.encode(w, name)
    else:
        out = quantize(fmt, w, name=name).reshape(-1)
    assert out.size == FORMATS[fmt].encoded_size(w.shape), "codec size disagrees with the registry"
    return out


def decode(fmt: str, data, shape, *, name: str = "tensor") -> np.ndarray:
    """float32 array of `shape` from container bytes (int32 for i32)."""
    check_shape(fmt, shape, name)
    if fmt in plain.PLAIN:
        return plain.decode(fmt, data, shape, name)
    if fmt == "nvfp4":
        return nvfp4.decode(data, shape, name)
    if fmt == "f8_e4m3_row":
        return fp8.decode(data, shape, name)
    return dequantize(fmt, data, shape, name=name)


def split_nvfp4(data, shape, *, name: str = "tensor") -> tuple[np.ndarray, np.ndarray, np.float32]:
    """(codes u8 [N, K/2], scales u8 [N, K/16], global scale) views into nvfp4 container bytes."""
    return nvfp4.split(data, shape, name)
