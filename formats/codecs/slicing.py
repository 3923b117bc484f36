"""Tensor-parallel cuts of already-encoded tensors, on block boundaries only.

Quantized tensors ([N, K]) are cut along rows (dim 0, any row range) or columns (dim 1: a whole number of
blocks -- 16 for nvfp4, 256 for q6_k/iq3_s, any column for f8_e4m3_row). An nvfp4 slice keeps the tensor's
global scale; an f8_e4m3_row column slice keeps the row scales. Plain formats cut along any dim.
For every format: decode(slice(encode(w))) == decode(encode(w))[slice], bit for bit.
"""
from __future__ import annotations

import numpy as np

from ..constants import FORMATS, IQ3_S_BLOCK_BYTES, NVFP4_BLOCK, Q6_K_BLOCK_BYTES, QK_K
from ..errors import FormatError
from . import fp8, nvfp4
from .inputs import encoded_bytes
from .plain import PLAIN

_GGML_BLOCK_BYTES = {"q6_k": Q6_K_BLOCK_BYTES, "iq3_s": IQ3_S_BLOCK_BYTES}
_COL_BLOCK = {"nvfp4": NVFP4_BLOCK, "q6_k": QK_K, "iq3_s": QK_K, "f8_e4m3_row": 1}


def _check_range(fmt, shape, dim, start, stop, name) -> None:
    if not 0 <= dim < len(shape):
        raise FormatError(f"{name}: cannot slice dim {dim} of a rank-{len(shape)} {fmt} tensor")
    if fmt not in PLAIN and dim > 1:
        raise FormatError(f"{name}: {fmt} tensors are cut along dim 0 (rows) or 1 (columns) only")
    if not 0 <= start < stop <= shape[dim]:
        raise FormatError(f"{name}: slice [{start}:{stop}] of dim {dim} is empty or outside 0..{shape[dim]}")
    block = _COL_BLOCK.get(fmt, 1) if dim == 1 else 1
    if start % block or stop % block:
        raise FormatError(f"{name}: {fmt} column cut [{start}:{stop}] is not on a {block}-column block "
                          f"boundary (both ends must be multiples of {block})")


def _cut(a: np.ndarray, dim: int, start: int, stop: int) -> np.ndarray:
    idx = [slice(None)] * a.ndim
    idx[dim] = slice(start, stop)
    return a[tuple(idx)]


def slice_encoded(fmt: str, data, shape, dim: int, start: int, stop: int, *,
                  name: str = "tensor") -> tuple[np.ndarray, tuple[int, ...]]:
    """Encoded bytes of w[..., start:stop along dim, ...] and the new logical shape."""
    flat, shape = encoded_bytes(fmt, data, shape, name)
    dim, start, stop = int(dim), int(start), int(stop)
    _check_range(fmt, shape, dim, start, stop, name)
    new_shape = shape[:dim] + (stop - start,) + shape[dim + 1:]
    f = _COL_BLOCK.get(fmt, 1) if dim == 1 else 1
    lo, hi = start // f, stop // f  # in units of whole blocks (or rows)
    if fmt in PLAIN:
        item = FORMATS[fmt].encoded_size((1,))
        out = _cut(flat.reshape(shape + (item,)), dim, start, stop)
    elif fmt == "nvfp4":
        codes, scales, s2 = nvfp4.split(flat, shape, name)
        if dim == 0:
            return nvfp4.join(codes[lo:hi], scales[lo:hi], s2), new_shape
        half = NVFP4_BLOCK // 2
        return nvfp4.join(codes[:, lo * half:hi * half], scales[:, lo:hi], s2), new_shape
    elif fmt == "f8_e4m3_row":
        scale, codes = fp8.split(flat, shape, name)
        if dim == 0:
            return fp8.join(scale[lo:hi], codes[lo:hi]), new_shape
        return fp8.join(scale, codes[:, lo:hi]), new_shape
    else:
        bb = _GGML_BLOCK_BYTES[fmt]
        rows = flat.reshape(shape[0], -1)
        out = rows[lo:hi] if dim == 0 else rows[:, lo * bb:hi * bb]
    return np.ascontiguousarray(out).reshape(-1), new_shape
