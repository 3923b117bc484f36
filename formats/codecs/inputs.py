"""Input checks shared by every codec: one place that turns "what the caller handed us" into a clean array.

Accepted weights: numpy float32 / float16 arrays, or torch tensors (converted with `.float().numpy()`, so a
bf16 tensor arrives exactly). Anything else -- float64, ints, NaN/Inf, wrong rank, a K that is not a whole
number of blocks -- raises `FormatError` with a one-line message that names the tensor and the problem.
"""
from __future__ import annotations

import numpy as np

from ..constants import FORMATS, QUANTIZED
from ..errors import FormatError

_FLOATS = (np.float32, np.float16)


def to_numpy(w, name: str) -> np.ndarray:
    """numpy view of `w`; torch tensors are detached, moved to CPU and (if floating) widened to float32."""
    if isinstance(w, np.ndarray):
        return w
    if type(w).__module__.split(".")[0] == "torch":
        t = w.detach().cpu()
        return (t.float() if t.is_floating_point() else t).numpy()
    raise FormatError(f"{name}: expected a numpy array or torch tensor, got {type(w).__name__}")


def first_bad_index(a: np.ndarray) -> tuple[int, ...] | None:
    """Index of the first non-finite element (row-major), or None. Cheap when everything is finite."""
    if np.isfinite(a).all():
        return None
    return tuple(int(i) for i in np.argwhere(~np.isfinite(a))[0])


def check_finite(a: np.ndarray, fmt: str, name: str) -> None:
    idx = first_bad_index(a)
    if idx is None:
        return
    what = "NaN" if np.isnan(a[idx]) else "Inf"
    where = f"row {idx[0]}, col {idx[1]}" if len(idx) == 2 else f"index {idx}"
    raise FormatError(f"{name}: {fmt} input has {what} at {where}")


def check_shape(fmt: str, shape, name: str) -> tuple[int, ...]:
    """Validate a logical shape against the registry entry of `fmt` (rank, K multiple)."""
    spec = FORMATS.get(fmt)
    if spec is None:
        raise FormatError(f"{name}: unknown numeric format {fmt!r} (known: {', '.join(FORMATS)})")
    shape = tuple(int(d) for d in shape)
    if len(shape) not in spec.ndim:
        raise FormatError(f"{name}: {fmt} needs rank {' or '.join(map(str, spec.ndim))}, got shape {shape}")
    if any(d < 0 for d in shape):
        raise FormatError(f"{name}: negative dimension in shape {shape}")
    if fmt in QUANTIZED and 0 in shape:
        raise FormatError(f"{name}: {fmt} tensors cannot be empty, got shape {shape}")
    if shape and shape[-1] % spec.k_multiple:
        raise FormatError(f"{name}: {fmt} needs the last dim to be a multiple of {spec.k_multiple}, "
                          f"got K={shape[-1]} (shape {shape})")
    return shape


def float_weights(w, fmt: str, name: str) -> np.ndarray:
    """Finite float32 array (any rank allowed by `fmt`) from float32/float16 input."""
    a = to_numpy(w, name)
    if a.dtype not in _FLOATS:
        raise FormatError(f"{name}: {fmt} input must be float32 or float16, got {a.dtype}")
    check_shape(fmt, a.shape, name)
    a = np.ascontiguousarray(a, dtype=np.float32)
    check_finite(a, fmt, name)
    return a


def encoded_bytes(fmt: str, data, shape, name: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """Flat uint8 view of encoded `data`, checked against the registry size of `shape`."""
    shape = check_shape(fmt, shape, name)
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = np.frombuffer(data, dtype=np.uint8)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
        got = data.dtype if isinstance(data, np.ndarray) else type(data).__name__
        raise FormatError(f"{name}: encoded {fmt} data must be uint8 bytes, got {got}")
    flat = data.reshape(-1)
    want = FORMATS[fmt].encoded_size(shape)
    if flat.size != want:
        raise FormatError(f"{name}: {fmt} shape {shape} needs {want} bytes, got {flat.size}")
    return flat, shape
