"""What a rank file will contain: validated tensor specs, resources and metadata, and its planned layout."""
from __future__ import annotations

import functools
import json
import math
import operator
from dataclasses import dataclass, field

import zstandard

from .constants import (FORMATS, MAX_DIM, MAX_NAME_BYTES, MAX_RESOURCE_BYTES, MAX_SOURCE_BYTES,
                        MAX_TP_SIZE, TENSOR_ALIGN, ZSTD_LEVEL)
from .directory import (ResourceEntry, TensorEntry, _Bad, check_shape, name as check_name, xxh3_hex)
from .errors import FormatError
from .header import align_up
from .model_config import ModelConfig

PLACEHOLDER = "0" * 32                 # same width as every checksum, so the planned directory length is exact
META_KEYS = ("source", "recipe", "producer")


def default_producer() -> str:
    """`ninfer x.y.z` of the installed distribution; a bare source tree (not pip-installed) says so instead of
    inventing a version."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return f"ninfer {version('ninfer')}"
    except PackageNotFoundError:
        return "ninfer (source tree, not installed)"


def _int(v) -> int:
    """Python int from any integer type (numpy dims included); bools and floats are refused."""
    if isinstance(v, bool):
        raise TypeError("bool")
    return operator.index(v)


def _dims(shape, name: str) -> tuple[int, ...]:
    try:
        dims = tuple(_int(d) for d in shape)
    except TypeError:
        dims = None
    if dims is None or not all(1 <= d < MAX_DIM for d in dims):
        raise _Bad(f"tensor {name}.shape", f"{shape!r}: dims must be integers in [1, 2^31)")
    return dims


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    fmt: str

    def __post_init__(self):
        try:
            check_name(self.name, "tensor name")
            object.__setattr__(self, "shape", _dims(self.shape, self.name))
            if self.fmt not in FORMATS:
                raise _Bad(f"tensor {self.name}", f"unknown format {self.fmt!r} (known: {', '.join(FORMATS)})")
            check_shape(FORMATS[self.fmt], self.shape, f"tensor {self.name}")
        except _Bad as e:
            raise FormatError(str(e)) from None

    @property
    def nbytes(self) -> int:
        return FORMATS[self.fmt].encoded_size(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ArtifactPlan:
    """One rank's content. `meta`: {"source": str, "recipe": dict, "producer": str (optional)}."""

    config: ModelConfig
    tp_size: int
    rank: int
    tensors: tuple[TensorSpec, ...]
    resources: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "tensors", tuple(self.tensors))
        if not isinstance(self.config, ModelConfig):
            raise FormatError("plan.config: expected a ModelConfig")
        try:
            object.__setattr__(self, "tp_size", _int(self.tp_size))
            object.__setattr__(self, "rank", _int(self.rank))
        except TypeError:
            raise FormatError(f"plan: tp_size {self.tp_size!r} and rank {self.rank!r} must be integers") from None
        if not 1 <= self.tp_size <= MAX_TP_SIZE:
            raise FormatError(f"plan.tp_size: {self.tp_size!r} is not in [1, {MAX_TP_SIZE}]")
        if not 0 <= self.rank < self.tp_size:
            raise FormatError(f"plan.rank: {self.rank!r} is not in [0, {self.tp_size})")
        seen = set()
        for t in self.tensors:
            if not isinstance(t, TensorSpec):
                raise FormatError(f"plan.tensors: expected TensorSpec, got {type(t).__name__}")
            if t.name in seen:
                raise FormatError(f"plan.tensors: duplicate tensor name {t.name!r}")
            seen.add(t.name)
        for nm, data in self.resources.items():
            try:
                check_name(nm, "resource name")
            except _Bad as e:
                raise FormatError(str(e)) from None
            if not isinstance(data, (bytes, bytearray, memoryview)) or not 1 <= len(data) <= MAX_RESOURCE_BYTES:
                raise FormatError(f"resource {nm}: expected 1..{MAX_RESOURCE_BYTES} bytes")
        self.identity_fields()        # validates meta

    def identity_fields(self) -> dict:
        """identity without artifact_id."""
        meta = self.meta
        unknown = sorted(set(meta) - set(META_KEYS))
        if unknown:
            raise FormatError(f"plan.meta.{unknown[0]}: unknown member (allowed: {', '.join(META_KEYS)})")
        source, recipe = meta.get("source", ""), meta.get("recipe", {})
        producer = meta.get("producer") or default_producer()
        if not isinstance(source, str) or len(source.encode()) > MAX_SOURCE_BYTES:
            raise FormatError(f"plan.meta.source: expected a string of at most {MAX_SOURCE_BYTES} bytes")
        if not isinstance(recipe, dict):
            raise FormatError("plan.meta.recipe: expected a dict")
        if not isinstance(producer, str) or not 1 <= len(producer.encode()) <= MAX_NAME_BYTES:
            raise FormatError("plan.meta.producer: expected a non-empty string")
        try:
            json.dumps(recipe, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise FormatError(f"plan.meta.recipe: not JSON-serialisable: {e}") from None
        return {"source": source, "recipe": recipe, "producer": producer}


@functools.lru_cache(maxsize=32)
def _zstd(raw: bytes) -> bytes:
    # single-threaded, fixed level, no dictionary: the same bytes always compress to the same frame
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True, write_checksum=False).compress(raw)


def encode_resource(raw: bytes) -> tuple[str, bytes]:
    """("zstd", frame) when that is smaller, else ("raw", raw)."""
    packed = _zstd(bytes(raw))
    return ("zstd", packed) if len(packed) < len(raw) else ("raw", bytes(raw))


@dataclass(frozen=True)
class Layout:
    tensors: tuple[TensorEntry, ...]          # xxh3 = PLACEHOLDER
    resources: tuple[ResourceEntry, ...]
    stored: tuple[bytes, ...]                 # stored resource bytes, same order as `resources`
    payload_length: int


def plan_layout(plan: ArtifactPlan) -> Layout:
    """Tensors in the plan's order, then resources sorted by name, each at the next multiple of 256."""
    cursor, tensors, resources, stored = 0, [], [], []
    for t in plan.tensors:
        tensors.append(TensorEntry(t.name, t.shape, t.fmt, cursor, t.nbytes, PLACEHOLDER))
        cursor = align_up(cursor + t.nbytes, TENSOR_ALIGN)
    end = tensors[-1].offset + tensors[-1].length if tensors else 0
    for nm in sorted(plan.resources):
        raw = plan.resources[nm]
        enc, data = encode_resource(raw)
        resources.append(ResourceEntry(nm, enc, cursor, len(data), len(raw), xxh3_hex(data)))
        stored.append(data)
        end = cursor + len(data)
        cursor = align_up(end, TENSOR_ALIGN)
    return Layout(tuple(tensors), tuple(resources), tuple(stored), end)
