"""Plain formats f32 / f16 / bf16 / i32: little-endian row-major bytes.

numpy has no bf16, so bf16 arrays travel as np.uint16 bit patterns. `bf16_bits` rounds float32 to bf16 with
round-to-nearest-even (what torch's `.to(torch.bfloat16)` does); NaN stays a quiet NaN with its sign.
Encoding accepts float32/float16 (or, for bf16, uint16 bits taken as they are); NaN/Inf are refused, as are
finite values that overflow f16/bf16. i32 accepts any integer array whose values fit in int32.
decode returns float32 for the float formats and int32 for i32 (a float32 result would lose integers > 2^24).
"""
from __future__ import annotations

import numpy as np

from ..errors import FormatError
from .inputs import check_finite, check_shape, encoded_bytes, float_weights, to_numpy

_LE = {"f32": "<f4", "f16": "<f2", "bf16": "<u2", "i32": "<i4"}
PLAIN = frozenset(_LE)


def bf16_bits(x) -> np.ndarray:
    """float32 (or float16) array -> bf16 bit patterns as uint16, round-to-nearest-even."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():  # the carry above could turn a NaN payload into Inf; force a quiet NaN instead
        rounded[nan] = ((u[nan] >> 16).astype(np.uint16) & np.uint16(0x8000)) | np.uint16(0x7FC0)
    return rounded


def bf16_to_f32(bits) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32, exact."""
    b = np.ascontiguousarray(bits, dtype=np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)


def _to_int32(a: np.ndarray, name: str) -> np.ndarray:
    if a.dtype.kind not in "iub":
        raise FormatError(f"{name}: i32 input must be an integer array, got {a.dtype}")
    if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
        raise FormatError(f"{name}: i32 input has values outside the int32 range")
    return a.astype("<i4")


def _to_halfwidth(fmt: str, a: np.ndarray, name: str) -> np.ndarray:
    if fmt == "bf16" and a.dtype == np.uint16:
        bits = a.astype("<u2")  # already bf16 bit patterns
        check_finite(bf16_to_f32(bits), fmt, name)
        return bits
    f = float_weights(a, fmt, name)
    with np.errstate(over="ignore"):  # overflow is reported below, naming the value
        out = bf16_bits(f) if fmt == "bf16" else f.astype("<f2")
    wide = bf16_to_f32(out) if fmt == "bf16" else out.astype(np.float32)
    if not np.isfinite(wide).all():
        idx = tuple(int(i) for i in np.argwhere(~np.isfinite(wide))[0])
        raise FormatError(f"{name}: value {f[idx]!r} at index {idx} overflows {fmt}")
    return out


def encode(fmt: str, w, name: str = "tensor") -> np.ndarray:
    """Container bytes (flat uint8) of a plain-format tensor of any allowed rank."""
    a = to_numpy(w, name)
    check_shape(fmt, a.shape, name)
    if fmt == "i32":
        out = _to_int32(a, name)
    elif fmt == "f32":
        out = float_weights(a, fmt, name).astype("<f4")
    else:
        out = _to_halfwidth(fmt, a, name)
    return np.ascontiguousarray(out).reshape(-1).view(np.uint8)


def decode(fmt: str, data, shape, name: str = "tensor") -> np.ndarray:
    """float32 array of `shape` (int32 for i32) from container bytes."""
    flat, shape = encoded_bytes(fmt, data, shape, name)
    raw = flat.view(_LE[fmt]).reshape(shape)
    if fmt == "i32":
        return raw.astype(np.int32)
    if fmt == "bf16":
        return bf16_to_f32(raw)
    return raw.astype(np.float32)
