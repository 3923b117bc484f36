"""GGML IQ3_S (type 21) codec: 256-weight super-blocks of 110 bytes, vectorized numpy.

Block layout (quant-formats.md §6.1): fp16 d | qs[64] low index bytes | qh[8] index bit 8 | signs[32] |
scales[4] (4-bit, even sub-block in the low nibble). Weight e of sub-block ib, group k, lane j decodes to
`(f32(d) * (1 + 2 s4[ib])) * grid[idx][j] * sign`.

The decoder is bit-identical to `gguf.quants.dequantize` (and ggml's `dequantize_row_iq3_s`). The encoder is
not ggml's: see `iq3_s_search.py` for the search; it writes valid blocks for all-zero sub-blocks (ggml
shifts the rest of the block there, quant-formats.md §6.6).
"""
from __future__ import annotations

import numpy as np

from ..constants import IQ3_S_BLOCK_BYTES, QK_K
from ..errors import FormatError
from . import iq3_s_tables as tables

SUB = 32                  # weights per sub-block (one 4-bit scale)
N_SUB = QK_K // SUB       # 8 sub-blocks per super-block
GROUP = 4                 # weights per grid point
N_GROUP = QK_K // GROUP   # 64 grid indices per super-block

# byte offsets inside a block
_D, _QS, _QH, _SIGNS, _SCALES = 0, 2, 66, 74, 106
_BIT = np.arange(8, dtype=np.uint8)


def _check_shape(shape, what: str) -> tuple[int, int]:
    if len(shape) != 2:
        raise FormatError(f"iq3_s: {what} must be 2-D [rows, K], got shape {tuple(shape)}")
    rows, k = (int(s) for s in shape)
    if k % QK_K or k <= 0 or rows < 0:
        raise FormatError(f"iq3_s: {what} K={k} must be a positive multiple of {QK_K} (shape {tuple(shape)})")
    return rows, k


def _blocks_view(data: np.ndarray, rows: int, k: int) -> np.ndarray:
    data = np.asarray(data)
    if data.dtype != np.uint8:
        raise FormatError(f"iq3_s: encoded data must be uint8, got {data.dtype}")
    want = rows * (k // QK_K) * IQ3_S_BLOCK_BYTES
    if data.size != want:
        raise FormatError(f"iq3_s: encoded data has {data.size} bytes, shape ({rows}, {k}) needs {want}")
    if data.ndim not in (1, 2) or (data.ndim == 2 and data.shape[0] != rows):
        raise FormatError(f"iq3_s: encoded data must be 1-D or [{rows}, {want // max(rows, 1)}], "
                          f"got shape {data.shape}")
    return np.ascontiguousarray(data).reshape(-1, IQ3_S_BLOCK_BYTES)


def unpack_blocks(blocks: np.ndarray):
    """[nb, 110] u8 -> (d f32 [nb], s4 u8 [nb, 8], idx i32 [nb, 64], neg bool [nb, 256])."""
    d = blocks[:, _D:_QS].copy().view(np.float16)[:, 0].astype(np.float32)
    hi = (blocks[:, _QH:_SIGNS, None] >> _BIT) & 1                            # [nb, 8 sub, 8 groups]
    idx = blocks[:, _QS:_QH].astype(np.int32) | hi.reshape(-1, N_GROUP).astype(np.int32) << 8
    neg = np.unpackbits(blocks[:, _SIGNS:_SCALES], axis=1, bitorder="little").astype(bool)
    sc = blocks[:, _SCALES:]
    s4 = np.stack([sc & 0xF, sc >> 4], axis=-1).reshape(-1, N_SUB)
    return d, s4, idx, neg


def pack_blocks(d16: np.ndarray, s4: np.ndarray, idx: np.ndarray, neg: np.ndarray) -> np.ndarray:
    """Inverse of `unpack_blocks` (d given as float16) -> [nb, 110] u8."""
    nb = d16.shape[0]
    out = np.empty((nb, IQ3_S_BLOCK_BYTES), dtype=np.uint8)
    out[:, _D:_QS] = d16.astype(np.float16).reshape(nb, 1).view(np.uint8)
    idx = idx.astype(np.int32)
    out[:, _QS:_QH] = (idx & 0xFF).astype(np.uint8)
    hi = ((idx >> 8) & 1).astype(np.uint8).reshape(nb, N_SUB, 8)
    out[:, _QH:_SIGNS] = (hi << _BIT).sum(axis=-1, dtype=np.uint8)
    out[:, _SIGNS:_SCALES] = np.packbits(neg.astype(np.uint8), axis=1, bitorder="little")
    s4 = s4.astype(np.uint8).reshape(nb, N_SUB // 2, 2)
    out[:, _SCALES:] = s4[..., 0] | s4[..., 1] << 4
    return out


def dequantize_blocks(blocks: np.ndarray) -> np.ndarray:
    """[nb, 110] u8 -> [nb, 256] f32, bit-identical to ggml `dequantize_row_iq3_s`."""
    d, s4, idx, neg = unpack_blocks(blocks)
    db = d[:, None] * (1 + 2 * s4).astype(np.float32)                         # [nb, 8]
    vals = tables.grid_values()[idx].reshape(-1, N_SUB, SUB)                  # [nb, 8, 32]
    y = (db[:, :, None] * vals).reshape(-1, QK_K)
    # the sign is applied after the rounding product; negation is exact, so this equals `* (-1)`
    np.negative(y, out=y, where=neg)
    return y


def dequantize_rows(data: np.ndarray, shape) -> np.ndarray:
    """Encoded bytes ([rows, K/256*110] or 1-D) -> float32 [rows, K]."""
    rows, k = _check_shape(shape, "shape")
    blocks = _blocks_view(data, rows, k)
    return dequantize_blocks(blocks).reshape(rows, k)
