"""NVFP4 in the ModelOpt layout: E2M1 codes, one E4M3 scale per 16 weights along K, one f32 scale per tensor.

Quantization follows ModelOpt's default ("max") weight path exactly (quant-formats.md §3.1):
  s2  = amax(|W| over the fusion group) / (6·448)                       float32
  s_b = amax_b / (6·s2); 1.0 where 0; clamp [2^-9, 448]; E4M3 RNE    -> ŝ_b
  q   = W / (f32(ŝ_b)·s2)                                              float32
  code = 8·(q < 0) + E2M1 magnitude index (RNE, ties to the even code, > 5 saturates to 6)
so -0.0 gives 0x0 while small negatives that round to zero give 0x8. Even elements sit in the low nibble.
An all-zero group would make s2 = 0 (and ModelOpt divide 0/0); we use s2 = 1.0 instead, which decodes to
the same zeros -- likewise when amax < ~3e-35 makes s2 a float32 subnormal (such weights decode to 0). Dequantization is (e2m1 · ŝ_b) · s2: the first product is exact, so one rounding.
"""
from __future__ import annotations

import numpy as np

from ..constants import E2M1_MAX, E4M3_MAX, E4M3_MIN_SUBNORMAL, NVFP4_BLOCK, NVFP4_HEADER
from ..errors import FormatError
from .fp8 import E4M3_LUT, e4m3_encode
from .inputs import encoded_bytes, float_weights

E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
"""float32 value of every E2M1 code (code 8 is -0.0)."""

# Rounding boundaries between neighbouring magnitudes; at the ones marked True a tie rounds UP, because
# the upper neighbour has the even code (0.75 -> 1.0, 1.75 -> 2, 3.5 -> 4); elsewhere it rounds down.
_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
_TINY = np.finfo(np.float32).tiny  # a subnormal s2 would let ŝ_b·s2 underflow to 0
_CHUNK = 1 << 16  # elements per pass: keeps the temporaries in cache


def global_scale(*ws, name: str = "tensor") -> np.float32:
    """Shared per-tensor scale of a fusion group: max amax over all `ws` / (6·448), float32."""
    if not ws:
        raise FormatError(f"{name}: nvfp4.global_scale needs at least one weight")
    amax = np.float32(0.0)
    for w in ws:
        a = float_weights(w, "nvfp4", name)
        if a.size:
            amax = max(amax, np.float32(a.max()), np.float32(-a.min()))
    s2 = np.float32(amax) / np.float32(E2M1_MAX * E4M3_MAX)
    return s2 if s2 >= _TINY else np.float32(1.0)


_group_scale = global_scale  # `quantize` has a parameter of the same name


def _check_gscale(g, name: str) -> np.float32:
    try:
        g = np.float32(g)
    except (TypeError, ValueError):
        raise FormatError(f"{name}: nvfp4 global scale must be a float, got {type(g).__name__}") from None
    if g.shape != () or not np.isfinite(g) or g < _TINY:
        raise FormatError(f"{name}: nvfp4 global scale must be a finite normal float32 > 0, got {g!r}")
    return g


def e2m1_encode(q: np.ndarray) -> np.ndarray:
    """float32 (NaN-free) -> E2M1 codes uint8 in the low nibble, ModelOpt rounding and sign rule."""
    a = np.abs(q)
    mag = np.zeros(q.shape, dtype=np.uint8)
    for bound, tie_up in _BOUNDS:
        mag += (a >= bound) if tie_up else (a > bound)
    mag |= (q < 0).view(np.uint8) << 3
    return mag


def _quantize_chunk(blocks: np.ndarray, s2: np.float32) -> tuple[np.ndarray, np.ndarray]:
    amax_b = np.maximum(blocks.max(axis=-1), -blocks.min(axis=-1))
    sb = amax_b / (np.float32(E2M1_MAX) * s2)
    sb[sb == 0] = 1.0
    np.clip(sb, np.float32(E4M3_MIN_SUBNORMAL), np.float32(E4M3_MAX), out=sb)
    scale_bits = e4m3_encode(sb)
    q = blocks / (E4M3_LUT[scale_bits] * s2)[..., None]
    codes = e2m1_encode(q).reshape(blocks.shape[0], -1)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scale_bits


def quantize(w, global_scale=None, *, name: str = "tensor") -> tuple[np.ndarray, np.ndarray, np.float32]:
    """[N, K] float -> (codes u8 [N, K/2], scales u8 E4M3 [N, K/16], global scale float32).

    Pass `global_scale` (from `global_scale(*group)`) when the tensor is part of a fusion group.
    """
    w = float_weights(w, "nvfp4", name)
    s2 = _group_scale(w, name=name) if global_scale is None else _check_gscale(global_scale, name)
    n, k = w.shape
    codes = np.empty((n, k // 2), dtype=np.uint8)
    scales = np.empty((n, k // NVFP4_BLOCK), dtype=np.uint8)
    step = max(1, _CHUNK // max(k, 1))
    for r in range(0, n, step):
        blocks = w[r:r + step].reshape(-1, k // NVFP4_BLOCK, NVFP4_BLOCK)
        codes[r:r + step], scales[r:r + step] = _quantize_chunk(blocks, s2)
    return codes, scales, s2


def dequantize(codes, scales, global_scale) -> np.ndarray:
    """(codes [N, K/2], scales [N, K/16], s2) -> float32 [N, K]."""
    codes = np.asarray(codes, dtype=np.uint8)
    scales = np.asarray(scales, dtype=np.uint8)
    n, half = codes.shape
    if scales.shape != (n, 2 * half // NVFP4_BLOCK) or (2 * half) % NVFP4_BLOCK:
        raise FormatError(f"nvfp4: scales shape {scales.shape} does not match codes shape {codes.shape}")
    bad = (scales & 0x80) | ((scales & 0x7F) == 0x7F)
    if bad.any():
        r, b = (int(i) for i in np.argwhere(bad)[0])
        raise FormatError(f"nvfp4: block scale 0x{int(scales[r, b]):02x} at row {r}, block {b} "
                          "is negative or NaN")
    s2 = np.float32(global_scale)
    vals = np.empty((n, half, 2), dtype=np.float32)
    vals[..., 0] = E2M1_VALUES[codes & 0xF]
    vals[..., 1] = E2M1_VALUES[codes >> 4]
    blocks = vals.reshape(n, -1, NVFP4_BLOCK)
    blocks *= E4M3_LUT[scales][..., None]
    blocks *= s2
    return blocks.reshape(n, 2 * half)


def encode(w, global_scale=None, name: str = "tensor") -> np.ndarray:
    """Container bytes: 16-byte header (f32 LE s2 + 12 zero bytes), codes [N, K/2], scales [N, K/16]."""
    codes, scales, s2 = quantize(w, global_scale, name=name)
    return join(codes, scales, s2)


def join(codes: np.ndarray, scales: np.ndarray, s2) -> np.ndarray:
    out = np.zeros(NVFP4_HEADER + codes.size + scales.size, dtype=np.uint8)
    out[:4] = np.array([s2], dtype="<f4").view(np.uint8)
    out[NVFP4_HEADER:NVFP4_HEADER + codes.size] = codes.reshape(-1)
    out[NVFP4_HEADER + codes.size:] = scales.reshape(-1)
    return out


def split(data, shape, name: str = "tensor") -> tuple[np.ndarray, np.ndarray, np.float32]:
    """(codes [N, K/2], scales [N, K/16], s2) -- the arrays are views into the container bytes."""
    flat, (n, k) = encoded_bytes("nvfp4", data, shape, name)
    s2 = flat[:4].view("<f4")[0]
    if not np.isfinite(s2) or s2 < 0:
        raise FormatError(f"{name}: nvfp4 header global scale {s2!r} is not a finite float >= 0")
    if flat[4:NVFP4_HEADER].any():
        raise FormatError(f"{name}: nvfp4 header bytes 4..15 must be zero")
    end = NVFP4_HEADER + n * k // 2
    return flat[NVFP4_HEADER:end].reshape(n, k // 2), flat[end:].reshape(n, k // NVFP4_BLOCK), np.float32(s2)


def decode(data, shape, name: str = "tensor") -> np.ndarray:
    return dequantize(*split(data, shape, name))
