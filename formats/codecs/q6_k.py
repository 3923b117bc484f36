"""GGML Q6_K: 256-weight blocks of 210 bytes (ql[128], qh[64], int8 scales[16], fp16 d).

`quantize_rows` is a byte-exact numpy port of ggml's `quantize_row_q6_K_ref` (no imatrix), following the
porting rules of quant-formats.md §5.4: every product in float32 in C's left-to-right order, the 16-term
sums accumulated sequentially (a reduction over axis 0 of a [16, B] array, i.e. vectorized across
sub-blocks), `np.rint` on float32 for ggml's `nearest_int`, fp16 by numpy's RNE cast.
`dequantize_rows` computes (d·scale)·(L−32) in float32, bit-identical to `gguf.quants.dequantize`.
Weights beyond ±(65504·128·32) cannot be represented (d would overflow fp16) and are refused.
"""
from __future__ import annotations

import numpy as np

from ..constants import GGML_GROUP_MAX_EPS, Q6_K_BLOCK_BYTES, Q6_K_SUBBLOCK, QK_K
from ..errors import FormatError

_NMAX = 32                                    # L ranges over [-32, 31] before the +32 offset
_EPS = np.float32(GGML_GROUP_MAX_EPS)
_STEPS = [np.float32(-(np.float32(_NMAX) + np.float32(0.1) * np.float32(i)))
          for i in range(-9, 10) if i != 0]   # the 18 extra numerators -(nmax + 0.1f·is) of make_qx_quants
MAX_ABS = float(np.finfo(np.float16).max) * 128 * _NMAX
_CHUNK_BLOCKS = 256                           # blocks per vectorized pass (~256 KB per temporary)
_SUB = QK_K // Q6_K_SUBBLOCK                  # sub-blocks per block


def _candidate(xT, w, wx, iscale):
    """One iscale trial of make_qx_quants: (l [16, B] float32, sumlx [B], suml2 [B])."""
    l = np.rint(iscale * xT)
    np.clip(l, -_NMAX, _NMAX - 1, out=l)
    return l, (wx * l).sum(axis=0), ((w * l) * l).sum(axis=0)


def _search(xT: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants(16, 32, rmse_type=1) for every column of xT [16, B] -> (scale [B], L u8 [16, B])."""
    cols = np.arange(xT.shape[1])
    mx = xT[np.abs(xT).argmax(axis=0), cols]          # signed value of the first largest |x|
    zero = np.abs(mx) < _EPS
    mx = np.where(zero, np.float32(1), mx)
    w = xT * xT
    wx = w * xT
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # IEEE inf/nan as in C
        best_l, sumlx, suml2 = _candidate(xT, w, wx, np.float32(-_NMAX) / mx)
        scale = np.where(suml2 != 0, sumlx / suml2, np.float32(0))
        best = scale * sumlx
        for num in _STEPS:
            l, sumlx, suml2 = _candidate(xT, w, wx, num / mx)
            take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            scale = np.where(take, sumlx / suml2, scale)
            best = np.where(take, scale * sumlx, best)
            np.copyto(best_l, l, where=take)
    L = (best_l + _NMAX).astype(np.uint8)
    L[:, zero] = 0     # ggml leaves L = 0 (not 32) for an all-zero sub-block
    scale[zero] = 0
    return scale, L


def _pack(L: np.ndarray, sc: np.ndarray, d16: np.ndarray) -> np.ndarray:
    """L u8 [nb, 256] (0..63), int8 scales [nb, 16], fp16 d [nb] -> blocks u8 [nb, 210]."""
    nb = L.shape[0]
    q = L.reshape(nb, 2, 4, 32)                       # (half h, quarter q, lane l)
    out = np.empty((nb, Q6_K_BLOCK_BYTES), dtype=np.uint8)
    ql = out[:, :128].reshape(nb, 2, 2, 32)
    ql[:] = (q[:, :, 0:2] & 0xF) | ((q[:, :, 2:4] & 0xF) << 4)
    out[:, 128:192].reshape(nb, 2, 32)[:] = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2)
                                            | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6))
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d16.astype("<f2").reshape(nb, 1).view(np.uint8)
    return out


def _quantize_blocks(x: np.ndarray) -> np.ndarray:
    """x float32 [nb, 256] -> Q6_K blocks u8 [nb, 210]."""
    nb = x.shape[0]
    subs = x.reshape(nb * _SUB, Q6_K_SUBBLOCK)
    scales, L = _search(np.ascontiguousarray(subs.T))
    scales = scales.reshape(nb, _SUB)
    L = np.ascontiguousarray(L.T).reshape(nb, _SUB, Q6_K_SUBBLOCK)
    ib = np.abs(scales).argmax(axis=1)
    max_scale = scales[np.arange(nb), ib]
    zero = np.abs(max_scale) < _EPS
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = np.float32(-128) / np.where(zero, np.float32(1), max_scale)
        d16 = (np.float32(1) / iscale).astype(np.float16)
        sc = np.minimum(127, np.rint(iscale[:, None] * scales)).astype(np.int8)
        dj = d16.astype(np.float32)[:, None] * sc.astype(np.float32)
        l = np.rint(x.reshape(nb, _SUB, Q6_K_SUBBLOCK) / dj[..., None])
    keep = (dj == 0)[..., None]          # ggml skips sub-blocks whose stored scale is 0
    l[np.broadcast_to(keep, l.shape)] = 0
    np.clip(l, -_NMAX, _NMAX - 1, out=l)
    L = np.where(keep, L, (l + _NMAX).astype(np.uint8))
    out = _pack(L.reshape(nb, QK_K), sc, d16)
    out[zero] = 0
    return out


def quantize_rows(w: np.ndarray) -> np.ndarray:
    """Finite float32 [rows, K] (K % 256 == 0, checked by the caller) -> u8 [rows, K/256*210]."""
    rows, k = w.shape
    amax = max(float(w.max(initial=0)), -float(w.min(initial=0)))
    if amax > MAX_ABS:
        raise FormatError(f"q6_k: |w| = {amax:g} exceeds the largest representable magnitude {MAX_ABS:g}")
    x = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, QK_K)
    out = np.empty((x.shape[0], Q6_K_BLOCK_BYTES), dtype=np.uint8)
    for b in range(0, x.shape[0], _CHUNK_BLOCKS):
        out[b:b + _CHUNK_BLOCKS] = _quantize_blocks(x[b:b + _CHUNK_BLOCKS])
    return out.reshape(rows, -1)


def dequantize_rows(data: np.ndarray, shape) -> np.ndarray:
    """u8 [rows, K/256*210] -> float32 [rows, K]; refuses blocks whose fp16 d is not finite."""
    rows, k = shape
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, Q6_K_BLOCK_BYTES)
    nb = blocks.shape[0]
    d = blocks[:, 208:210].view("<f2").astype(np.float32).reshape(nb)
    if not np.isfinite(d).all():
        i = int(np.argwhere(~np.isfinite(d))[0][0])
        raise FormatError(f"q6_k: block {i % (k // QK_K)} of row {i // (k // QK_K)} has a non-finite d")
    ds = d[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)       # (d · scale) [nb, 16]
    ql = blocks[:, :128].reshape(nb, 2, 1, 2, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1, 1)
    qh = blocks[:, 128:192].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = (ql & 0xF).reshape(nb, 2, 4, 32) | ((qh & 0x3) << 4)
    vals = (q.astype(np.int8) - np.int8(_NMAX)).astype(np.float32).reshape(nb, _SUB, Q6_K_SUBBLOCK)
    return (ds[..., None] * vals).reshape(rows, k)
