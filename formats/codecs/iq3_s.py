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
from . import iq3_s_search as search
from . import iq3_s_tables as tables

SUB = 32                  # weights per sub-block (one 4-bit scale)
N_SUB = QK_K // SUB       # 8 sub-blocks per super-block
GROUP = 4                 # weights per grid point
N_GROUP = QK_K // GROUP   # 64 grid indices per super-block

# Encoder search parameters, tuned on N(0,1), Student-t(3), uniform and small-integer matrices (the tests
# compare the error with ggml's quantizer). Sub-block scale steps c: groups are snapped at 1/scale =
# c / max|x|; 13.2..16.8 spans ggml's steps, the odd steps 1..11 catch blocks that fit low grid levels
# (constant or few-valued blocks). Super-block d candidates: d = max(sub-block scale) / 31 * f. s4
# candidates: floor(level of scale/d) + offset.
_STEPS = np.concatenate([np.arange(1, 13, 2), np.linspace(13.2, 16.8, 7)]).astype(np.float32)
_D_FACTORS = (1.0, 0.96, 0.98, 1.02, 1.04)
_S4_OFFSETS = (0, 1)
_D_MIN = np.float32(2.0 ** -24)        # smallest fp16 subnormal
_D_MAX = np.float32(65504.0)           # largest finite fp16
MAX_ABS = float(_D_MAX) * 31 * 15      # largest representable |weight|
_CHUNK_BLOCKS = 256                    # blocks per vectorized pass (keeps temporaries cache-sized)

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
    """Encoded bytes ([rows, K/256*110] or 1-D) -> float32 [rows, K]; refuses blocks with a non-finite d."""
    rows, k = _check_shape(shape, "shape")
    blocks = _blocks_view(data, rows, k)
    d = blocks[:, _D:_QS].copy().view(np.float16)[:, 0]
    if not np.isfinite(d).all():
        i, per_row = int(np.argmax(~np.isfinite(d))), k // QK_K
        raise FormatError(f"iq3_s: block {i % per_row} of row {i // per_row} has a non-finite d ({d[i]})")
    return dequantize_blocks(blocks).reshape(rows, k)


def quantize_rows(w: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K a multiple of 256) -> uint8 [rows, K/256*110] IQ3_S blocks."""
    w = np.asarray(w)
    rows, k = _check_shape(w.shape, "weight")
    w = np.ascontiguousarray(w, dtype=np.float32)
    if not np.isfinite(w).all():
        bad = np.argwhere(~np.isfinite(w))[0]
        raise FormatError(f"iq3_s: weight has a non-finite value {w[tuple(bad)]} at {tuple(int(i) for i in bad)}")
    amax = float(np.abs(w).max()) if w.size else 0.0
    if amax > MAX_ABS:
        raise FormatError(f"iq3_s: weight max |w| = {amax:g} exceeds the largest IQ3_S magnitude {MAX_ABS:g}")
    x = w.reshape(-1, QK_K)
    out = np.empty((x.shape[0], IQ3_S_BLOCK_BYTES), dtype=np.uint8)
    for s in range(0, x.shape[0], _CHUNK_BLOCKS):
        out[s:s + _CHUNK_BLOCKS] = _quantize_blocks(x[s:s + _CHUNK_BLOCKS])
    return out.reshape(rows, (k // QK_K) * IQ3_S_BLOCK_BYTES)


def _quantize_blocks(x: np.ndarray) -> np.ndarray:
    """[nb, 256] finite float32 -> [nb, 110] u8."""
    nb = x.shape[0]
    a = np.abs(x).reshape(-1, SUB)
    scale = search.subblock_scales(a, _STEPS).reshape(nb, N_SUB)
    d16, s4, idx = _super_scales(a, scale)
    neg = (x < 0) & (d16 != 0)[:, None]          # -0.0 is positive; an all-zero block is all zero bytes
    return pack_blocks(d16, s4, idx.reshape(nb, N_GROUP), neg)


def _super_scales(a: np.ndarray, scale: np.ndarray):
    """Pick d (fp16) per block, then s4 and grid points per sub-block, by the exact decode error.

    Returns (d16 [nb], s4 [nb, 8], idx [nb, 8, 8]). The all-zero block (d = 0) is a candidate too, so a
    block too small for the smallest fp16 d decodes to zeros instead of to a larger wrong value.
    """
    nb = scale.shape[0]
    best = (a * a).sum(axis=1).reshape(nb, N_SUB).sum(axis=1)        # error of the all-zero block
    d16 = np.zeros(nb, dtype=np.float16)
    s4 = np.zeros((nb, N_SUB), dtype=np.uint8)
    idx = np.zeros((nb, N_SUB, 8), dtype=np.int32)
    smax = scale.max(axis=1)
    for f in _D_FACTORS:
        cand = np.clip(smax / np.float32(31) * np.float32(f), _D_MIN, _D_MAX).astype(np.float16)
        err, c_s4, c_idx = _subblock_codes(a, scale, cand.astype(np.float32))
        total = err.sum(axis=1)
        better = (smax > 0) & (total < best)
        best[better] = total[better]
        d16[better], s4[better], idx[better] = cand[better], c_s4[better], c_idx[better]
    return d16, s4, idx


def _subblock_codes(a: np.ndarray, scale: np.ndarray, d: np.ndarray):
    """For d [nb] (> 0): each sub-block takes the better of the two s4 around scale/d -> (err, s4, idx)."""
    nb = scale.shape[0]
    u = (scale / d[:, None] - 1) * np.float32(0.5)
    best_err = best_s4 = best_idx = None
    for s4 in (np.clip(np.floor(u) + o, 0, 15) for o in _S4_OFFSETS):
        sub_scale = d[:, None] * (1 + 2 * s4.astype(np.uint8)).astype(np.float32)   # as the decoder does
        idx, err = search.snap_error(a, sub_scale.reshape(-1))
        err, idx = err.reshape(nb, N_SUB), idx.reshape(nb, N_SUB, 8)
        if best_err is None:
            best_err, best_s4, best_idx = err, s4.astype(np.uint8), idx
            continue
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_s4 = np.where(better, s4.astype(np.uint8), best_s4)
        best_idx = np.where(better[..., None], idx, best_idx)
    return best_err, best_s4, best_idx
