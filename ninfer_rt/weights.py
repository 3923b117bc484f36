"""`QWeight`: one linear weight [N, K] in its stored numeric format, as device tensors.

Layouts (`data` keys) per format, all row-major with rows = output features:
  plain f32/f16/bf16  `w` [N, K] in the activation dtype
  nvfp4               `codes` u8 [N, K/2] (even element in the low nibble), `scales` u8 E4M3 [N, K/16],
                      `gscale` python float (the per-tensor second-level scale)
  q6_k / iq3_s        `blocks` u8 [N, K/256 * block bytes] (GGML rows of blocks)
  f8_e4m3_row         `codes` u8 E4M3 [N, K], `row_scale` f32 [N]
Backends may attach derived forms (a dequantized copy, a swizzled layout) to `cache`, keyed by their name. A
backend that keeps an nvfp4 / q6_k / iq3_s weight's bytes re-laid out may release the stored tensors (`release`):
the weight then costs its size once on the device, and `tensors()` / `blocks()` / `full_data()` rebuild them for
the paths that read the stored layout.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from ninfer_formats.constants import FORMATS, QUANTIZED
from ninfer_formats.errors import LoadError

PLAIN_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
_RELEASED = "backend.released"   # cache key: (kept tensors, rebuild(rows), device) of a released weight
_RELEASABLE = ("nvfp4", "q6_k", "iq3_s")
_TENSOR_KEYS = {"nvfp4": ("codes", "scales"), "q6_k": ("blocks",), "iq3_s": ("blocks",),
                "f8_e4m3_row": ("codes", "row_scale")}


@dataclass(eq=False)
class QWeight:
    fmt: str
    shape: tuple[int, int]
    data: dict
    name: str = ""
    cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.shape = tuple(int(s) for s in self.shape)
        keys = _TENSOR_KEYS.get(self.fmt, ("w",))
        if self.fmt not in FORMATS or self.fmt == "i32":
            raise LoadError(f"{self.name or 'weight'}: {self.fmt!r} is not a linear-weight format")
        missing = [k for k in keys if k not in self.data]
        if missing or (self.fmt == "nvfp4" and "gscale" not in self.data):
            raise LoadError(f"{self.name or 'weight'}: {self.fmt} weight lacks {(missing or ['gscale'])[0]!r}")

    @property
    def quantized(self) -> bool:
        return self.fmt in QUANTIZED

    @property
    def device(self) -> torch.device:
        t = next((v for v in self.data.values() if isinstance(v, torch.Tensor)), None)
        return t.device if t is not None else self.cache[_RELEASED][2]

    @property
    def released(self) -> bool:
        return self.data.get(_TENSOR_KEYS.get(self.fmt, ("w",))[0], 0) is None

    def release(self, kept: list, rebuild) -> None:
        """Drop the stored tensors (nvfp4 codes and scales, q6_k / iq3_s blocks) of a weight whose backend holds
        the same bytes as `kept` tensors; rebuild(rows) returns them, {key: tensor}, for all rows (None) or the
        int64 `rows`, when a path needs the stored layout."""
        if self.fmt in _RELEASABLE and not self.released:
            keys = _TENSOR_KEYS[self.fmt]
            self.cache[_RELEASED] = (list(kept), rebuild, self.data[keys[0]].device)
            for k in keys:
                self.data[k] = None

    def tensors(self, rows: torch.Tensor | None = None) -> dict:
        """{key: tensor} of the stored layout (all rows, or `rows`), rebuilt if released."""
        if self.released:
            return self.cache[_RELEASED][1](rows)
        keys = _TENSOR_KEYS.get(self.fmt, ("w",))
        return {k: (self.data[k] if rows is None else self.data[k].index_select(0, rows)) for k in keys}

    def blocks(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """GGML blocks u8 [N or len(rows), bytes per row] of a q6_k / iq3_s weight, released or not."""
        return self.tensors(rows)["blocks"]

    def stored_tensors(self) -> list:
        """The tensors that hold this weight now (the backend's kept form once released)."""
        if self.released:
            return self.cache[_RELEASED][0]
        return [v for v in self.data.values() if isinstance(v, torch.Tensor)]

    def full_data(self) -> dict:
        """`data`, with released tensors rebuilt (for code that reads the stored layout, e.g. the references)."""
        return {**self.data, **self.tensors()} if self.released else self.data

    def _meta(self) -> dict:
        return {k: v for k, v in self.data.items() if k not in _TENSOR_KEYS.get(self.fmt, ("w",))}

    def to(self, device) -> "QWeight":
        data = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.full_data().items()}
        return QWeight(self.fmt, self.shape, data, self.name)

    def rows(self, start: int, stop: int) -> "QWeight":
        """Rows [start, stop) as views (every stored layout is row-major; a released weight's are rebuilt)."""
        if self.released:
            return QWeight(self.fmt, (stop - start, self.shape[1]), {**self._meta(), **self.tensors(
                torch.arange(start, stop, device=self.device))}, self.name)
        data = {k: (v[start:stop] if isinstance(v, torch.Tensor) else v) for k, v in self.data.items()}
        return QWeight(self.fmt, (stop - start, self.shape[1]), data, self.name)

    def select_rows(self, idx: torch.Tensor) -> "QWeight":
        """Rows `idx` (int64 [M]) gathered into a new QWeight (e.g. the embedding rows of a batch)."""
        return QWeight(self.fmt, (int(idx.numel()), self.shape[1]), {**self._meta(), **self.tensors(idx)},
                       self.name)

    @staticmethod
    def plain(w: torch.Tensor, name: str = "") -> "QWeight":
        fmt = {v: k for k, v in PLAIN_DTYPES.items()}.get(w.dtype)
        if fmt is None or w.dim() != 2:
            raise LoadError(f"{name or 'weight'}: a plain linear weight must be 2-D f32/f16/bf16, "
                            f"got {tuple(w.shape)} {w.dtype}")
        return QWeight(fmt, tuple(w.shape), {"w": w}, name)

    @staticmethod
    def concat_rows(parts: list["QWeight"], name: str = "") -> "QWeight":
        """Row-wise fusion (q/k/v, gate/up, GDN qkv+z); same format and K required, nvfp4 equal gscale."""
        name = name or "+".join(p.name for p in parts)
        first = parts[0]
        for p in parts[1:]:
            if p.fmt != first.fmt or p.shape[1] != first.shape[1]:
                raise LoadError(f"{name}: cannot fuse {p.name} ({p.fmt} {p.shape}) with "
                                f"{first.name} ({first.fmt} {first.shape})")
            if p.fmt == "nvfp4" and p.data["gscale"] != first.data["gscale"]:
                raise LoadError(f"{name}: nvfp4 global scales differ ({p.name} {p.data['gscale']!r} vs "
                                f"{first.name} {first.data['gscale']!r}); the packer must share them")
        full = [p.full_data() for p in parts]
        data = {k: (torch.cat([f[k] for f in full]) if isinstance(v, torch.Tensor) else v) for k, v in full[0].items()}
        return QWeight(first.fmt, (sum(p.shape[0] for p in parts), first.shape[1]), data, name)


def as_qweight(x, name: str = "") -> QWeight:
    return x if isinstance(x, QWeight) else QWeight.plain(x, name)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy()


def dequantize(qw: QWeight) -> torch.Tensor:
    """float32 [N, K] on the weight's device (numpy reference codecs for the quantized formats)."""
    from ninfer_formats import codecs
    if not qw.quantized:
        return qw.data["w"].float()
    if qw.fmt == "nvfp4":
        d = qw.full_data()
        out = codecs.nvfp4.dequantize(_np(d["codes"]), _np(d["scales"]), d["gscale"])
    elif qw.fmt == "f8_e4m3_row":
        out = codecs.fp8.e4m3_decode(_np(qw.data["codes"])) * _np(qw.data["row_scale"]).astype(np.float32)[:, None]
    else:
        out = codecs.dequantize(qw.fmt, _np(qw.blocks()), qw.shape, name=qw.name)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).to(qw.device)


def _tensor(a: np.ndarray, device) -> torch.Tensor:
    """Zero-copy torch view of a (read-only, mmap-backed) array, then one move to `device`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)     # read-only buffer: we never write weights
        t = torch.frombuffer(a, dtype=torch.uint8) if a.size else torch.empty(0, dtype=torch.uint8)
    return t.to(device)


def from_encoded(fmt: str, shape, raw: np.ndarray, *, device="cpu", dtype=torch.float32, name: str = "") -> QWeight:
    """QWeight over container bytes `raw` (flat u8, e.g. an mmap view) without a full copy in host memory."""
    from ninfer_formats import codecs
    n, k = (int(s) for s in shape)
    if fmt in PLAIN_DTYPES:
        return QWeight(fmt, (n, k), {"w": plain_tensor(fmt, (n, k), raw, device=device, dtype=dtype)}, name)
    if fmt == "nvfp4":
        codes, scales, s2 = codecs.split_nvfp4(raw, (n, k), name=name)
        data = {"codes": _tensor(codes, device).view(n, k // 2),
                "scales": _tensor(scales, device).view(n, -1), "gscale": float(s2)}
    elif fmt == "f8_e4m3_row":
        scale, codes = codecs.fp8.split(raw, (n, k), name=name)
        data = {"codes": _tensor(codes, device).view(n, k),
                "row_scale": _tensor(scale.view(np.uint8), device).view(torch.float32)}
    elif fmt in ("q6_k", "iq3_s"):
        data = {"blocks": _tensor(raw, device).view(n, -1)}
    else:
        raise LoadError(f"{name}: format {fmt!r} cannot hold a linear weight")
    return QWeight(fmt, (n, k), data, name)


def plain_tensor(fmt: str, shape, raw: np.ndarray, *, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """A plain-format tensor from its little-endian bytes, moved to `device` and cast to `dtype`."""
    src = {"i32": torch.int32, **PLAIN_DTYPES}[fmt]
    t = _tensor(raw, "cpu").view(src).view(*shape) if len(shape) else _tensor(raw, "cpu").view(src)[0]
    t = t.to(device)
    return t if fmt == "i32" else t.to(dtype)
