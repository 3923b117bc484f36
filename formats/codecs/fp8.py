"""E4M3FN (FP8) helpers and the `f8_e4m3_row` codec (per-row f32 scale x E4M3 codes).

`e4m3_encode` rounds float32 to the nearest E4M3FN value, ties to even -- the same as torch's
`.to(torch.float8_e4m3fn)` and `ml_dtypes.float8_e4m3fn` for |x| <= 448 -- but SATURATES: anything beyond
±448 becomes ±448 (0x7E/0xFE), where torch would produce NaN above 464. It never emits the NaN codes.

f8_e4m3_row policy: row scale = amax_row / 448 in float32 (so the row max maps to 448 before rounding);
a row whose scale is 0 (an all-zero row, or one so tiny that amax/448 underflows) gets scale 1.0 and its
values round to E4M3 directly. Codes keep the sign bit of the scaled value (-0.0 -> 0x80).
Layout: f32 LE scales [N], zero-padded to a multiple of 16 bytes, then codes u8 [N, K].
"""
from __future__ import annotations

import numpy as np

from ..constants import E4M3_MAX, F8_ROW_HEADER_ALIGN
from ..errors import FormatError
from .inputs import encoded_bytes, float_weights

_MIN_NORMAL = np.float32(2.0 ** -6)
_SUBNORMAL_STEPS = np.float32(2.0 ** 9)  # subnormal code m encodes m * 2^-9, and m = 8 is exactly 2^-6
_BIAS_SHIFT = (127 - 7) << 3             # f32 exponent bias minus E4M3 bias, in (exp << 3 | mantissa) units


def _build_lut() -> np.ndarray:
    c = np.arange(256, dtype=np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e, m = (c >> 3) & 0xF, c & 0x7
    mag = np.where(e == 0, m * 2.0 ** -9, 2.0 ** (e - 7) * (1 + m / 8))
    lut = (sign * mag).astype(np.float32)
    lut[(c & 0x7F) == 0x7F] = np.nan
    return lut


E4M3_LUT = _build_lut()
"""float32 value of every E4M3FN byte (0x7F / 0xFF are NaN)."""


def e4m3_encode(x) -> np.ndarray:
    """float32 array -> E4M3FN bytes (uint8), RNE, saturating at ±448. Input must be NaN-free."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x)
    bits = a.view(np.int32)
    # normal range: drop 20 mantissa bits with round-half-even; a carry rolls into the exponent correctly
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - _BIAS_SHIFT
    # subnormal range: exact scaling by 2^9, RNE to the integer step (capped first so huge |x| cannot overflow)
    sub = np.rint(np.minimum(a, _MIN_NORMAL) * _SUBNORMAL_STEPS).astype(np.int32)
    code = np.where(a < _MIN_NORMAL, sub, normal)
    np.minimum(code, 0x7E, out=code)
    code = code.astype(np.uint8)
    code |= np.signbit(x).astype(np.uint8) << 7
    return code


def e4m3_decode(codes) -> np.ndarray:
    """E4M3FN bytes -> float32."""
    return E4M3_LUT[np.asarray(codes, dtype=np.uint8)]


def _header_bytes(n: int) -> int:
    return (4 * n + F8_ROW_HEADER_ALIGN - 1) // F8_ROW_HEADER_ALIGN * F8_ROW_HEADER_ALIGN


def quantize_rows(w, name: str = "tensor") -> tuple[np.ndarray, np.ndarray]:
    """[N, K] float -> (row scales f32 [N], codes u8 [N, K]); w ≈ e4m3(code) * scale[row]."""
    w = float_weights(w, "f8_e4m3_row", name)
    amax = np.maximum(w.max(axis=1, initial=0.0), -w.min(axis=1, initial=0.0))
    scale = amax / np.float32(E4M3_MAX)
    scale[scale == 0] = 1.0
    return scale, e4m3_encode(w / scale[:, None])


def encode(w, name: str = "tensor") -> np.ndarray:
    return join(*quantize_rows(w, name))


def join(scale: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Container bytes from row scales [N] and codes [N, K]."""
    h = _header_bytes(codes.shape[0])
    out = np.zeros(h + codes.size, dtype=np.uint8)
    out[: 4 * scale.size] = np.ascontiguousarray(scale, dtype="<f4").view(np.uint8)
    out[h:] = codes.reshape(-1)
    return out


def split(data, shape, name: str = "tensor") -> tuple[np.ndarray, np.ndarray]:
    """(row scales f32 [N], codes u8 [N, K]) views into f8_e4m3_row container bytes."""
    flat, (n, k) = encoded_bytes("f8_e4m3_row", data, shape, name)
    h = _header_bytes(n)
    return flat[: 4 * n].view("<f4"), flat[h:].reshape(n, k)


def decode(data, shape, name: str = "tensor") -> np.ndarray:
    scale, codes = split(data, shape, name)
    if not np.isfinite(scale).all():
        raise FormatError(f"{name}: f8_e4m3_row scale of row {int(np.argmax(~np.isfinite(scale)))} is not finite")
    nan = (codes & 0x7F) == 0x7F
    if nan.any():
        r, c = (int(i) for i in np.argwhere(nan)[0])
        raise FormatError(f"{name}: f8_e4m3_row code at row {r}, col {c} is NaN (0x{int(codes[r, c]):02x})")
    return E4M3_LUT[codes] * scale.astype(np.float32)[:, None]
