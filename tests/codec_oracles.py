"""Independent oracles for the codec tests and the golden-vector generator.

- NVFP4: a straightforward transcription of ModelOpt's weight path using ml_dtypes casts (no shared code with
  ninfer_formats.codecs.nvfp4).
- Q6_K encode: ggml's own quantizer through ggml-python (`ggml_quantize_chunk`, no imatrix ->
  `quantize_row_q6_K_ref`); decode: `gguf.quants.dequantize`.
"""
from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np

F8 = ml_dtypes.float8_e4m3fn
F4 = ml_dtypes.float4_e2m1fn


def nvfp4_reference(w: np.ndarray, s2=None):
    """ModelOpt NVFP4 with ml_dtypes casts -> (codes [N, K/2], scale bits [N, K/16], s2)."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    if s2 is None:
        s2 = np.float32(np.abs(w).max()) / np.float32(6.0 * 448.0)
    s2 = np.float32(s2)
    blocks = w.reshape(n, k // 16, 16)
    sb = (np.abs(blocks).max(axis=-1) / (np.float32(6.0) * s2)).astype(np.float32)
    sb[sb == 0] = 1.0
    sb8 = np.clip(sb, np.float32(2.0 ** -9), np.float32(448.0)).astype(F8)
    q = (blocks / (sb8.astype(np.float32) * s2)[..., None]).astype(np.float32)
    codes = np.clip(q, -6, 6).astype(F4).view(np.uint8) & 0xF
    codes[(q == 0) & np.signbit(q)] = 0          # ModelOpt's sign is `q < 0`: exact -0.0 stays 0x0
    codes = codes.reshape(n, k)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), sb8.view(np.uint8), s2


def nvfp4_reference_decode(codes, scales, s2) -> np.ndarray:
    n = codes.shape[0]
    nib = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(n, -1)
    vals = nib.astype(np.uint8).view(F4).astype(np.float32)
    blk = vals.reshape(n, -1, 16) * scales.view(F8).astype(np.float32)[..., None]
    return (blk * np.float32(s2)).reshape(n, -1)


def ggml_quantize(qtype: int, w: np.ndarray) -> np.ndarray:
    """ggml's reference quantizer (no imatrix) -> u8 [rows, row_bytes]."""
    import ggml

    w = np.ascontiguousarray(w, dtype=np.float32)
    rows, k = w.shape
    out = np.zeros((rows, ggml.ggml_row_size(qtype, k)), dtype=np.uint8)
    ggml.ggml_quantize_chunk(qtype, w.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                             out.ctypes.data_as(ctypes.c_void_p), 0, rows, k, None)
    return out


def gguf_dequantize(fmt: str, blocks: np.ndarray) -> np.ndarray:
    import gguf

    qtype = {"q6_k": gguf.GGMLQuantizationType.Q6_K, "iq3_s": gguf.GGMLQuantizationType.IQ3_S}[fmt]
    return gguf.quants.dequantize(np.ascontiguousarray(blocks), qtype)


def rel_rmse(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / max(np.mean(b ** 2), 1e-300)))


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))
