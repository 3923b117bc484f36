"""The `.ninfer` directory (FORMAT.md §2-§4): strict JSON, the closed schema, geometry and digests."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import xxhash

from .constants import (CHECKSUM_HEX_LEN, FORMATS, MAX_DIM, MAX_JSON_INT, MAX_NAME_BYTES,
                        MAX_RESOURCE_BYTES, MAX_SOURCE_BYTES, MAX_TP_SIZE, RESOURCE_ENCODINGS, SUFFIX,
                        TENSOR_ALIGN)
from .errors import FormatError
from .model_config import ModelConfig
from .model_schema import check_model

_HEX = re.compile(r"[0-9a-f]{%d}" % CHECKSUM_HEX_LEN)
_PRINTABLE = re.compile(r"[\x20-\x7e]+")


class _Bad(Exception):
    """A schema violation at `field`; converted to FormatError with the file name at the top level."""

    def __init__(self, field: str, msg: str):
        super().__init__(f"{field}: {msg}")


# ---- canonical forms and digests (§4) --------------------------------------------------------
def canon(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def xxh3_hex(data) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def shard_digest(tensors: list[dict], resources: list[dict]) -> str:
    return xxh3_hex(canon({"resources": resources, "tensors": tensors}))


def artifact_id(shard_digests: list[str]) -> str:
    return xxh3_hex(canon({"shard_digests": list(shard_digests), "tp_size": len(shard_digests)}))


def rank_file_name(stem: str, tp_size: int, rank: int) -> str:
    return f"{stem}.tp{tp_size}-rank{rank}{SUFFIX}"


_RANK_NAME = re.compile(r"(?P<stem>[^/\\]+)\.tp(?P<n>[1-9][0-9]*)-rank(?P<r>0|[1-9][0-9]*)" + re.escape(SUFFIX))


def split_rank_file_name(name: str):
    """(stem, tp_size, rank) of a conforming rank file name, else None."""
    m = _RANK_NAME.fullmatch(name)
    return (m["stem"], int(m["n"]), int(m["r"])) if m else None


# ---- entries ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    fmt: str
    offset: int
    length: int
    xxh3: str

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "format": self.fmt, "offset": self.offset,
                "length": self.length, "xxh3": self.xxh3}

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ResourceEntry:
    name: str
    encoding: str
    offset: int
    length: int
    raw_length: int
    xxh3: str

    def to_json(self) -> dict:
        return {"name": self.name, "encoding": self.encoding, "offset": self.offset, "length": self.length,
                "raw_length": self.raw_length, "xxh3": self.xxh3}


@dataclass(frozen=True)
class Directory:
    config: ModelConfig
    model: dict
    identity: dict
    tp: dict
    tensors: tuple[TensorEntry, ...]
    resources: tuple[ResourceEntry, ...]


def dump_directory(model: dict, identity: dict, tp: dict, tensors, resources) -> bytes:
    """Compact canonical JSON of a directory (writers pad it with spaces afterwards)."""
    try:
        return canon({"model": model, "identity": identity, "tp": tp,
                      "tensors": [t.to_json() for t in tensors],
                      "resources": [r.to_json() for r in resources]})
    except (TypeError, ValueError) as e:
        raise FormatError(f"directory: not serialisable as JSON: {e}") from None


# ---- strict JSON -----------------------------------------------------------------------------
def _pairs(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise _Bad("directory", f"duplicate member {k!r}")
        d[k] = v
    return d


def _no_constant(name):
    raise _Bad("directory", f"{name} is not allowed")


def _finite_float(s: str) -> float:
    f = float(s)
    if not math.isfinite(f):
        raise _Bad("directory", f"number {s[:40]} is out of range")
    return f


def parse_json(data: bytes, where: str) -> dict:
    try:
        text = data.decode("utf-8")
        if text.startswith("\ufeff"):
            raise _Bad("directory", "starts with a byte order mark")
        obj = json.loads(text, object_pairs_hook=_pairs, parse_constant=_no_constant,
                         parse_float=_finite_float)
    except _Bad as e:
        raise FormatError(f"{where}: {e}") from None
    except UnicodeDecodeError as e:
        raise FormatError(f"{where}: directory: invalid UTF-8 at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise FormatError(f"{where}: directory: invalid JSON: {e}") from None
    except (ValueError, RecursionError, MemoryError) as e:
        raise FormatError(f"{where}: directory: unreadable JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise FormatError(f"{where}: directory: not a JSON object")
    return obj


# ---- typed field checks ------------------------------------------------------------------------
def members(v, field: str, required: tuple[str, ...]) -> dict:
    if not isinstance(v, dict):
        raise _Bad(field, "not an object")
    for k in v:
        if k not in required:
            raise _Bad(f"{field}.{k}" if field else k, "unknown member")
    for k in required:
        if k not in v:
            raise _Bad(f"{field}.{k}" if field else k, "missing member")
    return v


def integer(v, field: str, lo: int = 0, hi: int = MAX_JSON_INT) -> int:
    if type(v) is not int:
        raise _Bad(field, f"expected an integer, got {_show(v)}")
    if not lo <= v < hi:
        shown = str(v) if abs(v) < 10 ** 30 else f"{str(v)[:12]}...({len(str(v))} digits)"
        raise _Bad(field, f"{shown} is out of range [{lo}, {hi})")
    return v


def string(v, field: str, max_bytes: int, min_bytes: int = 0) -> str:
    if not isinstance(v, str):
        raise _Bad(field, f"expected a string, got {_show(v)}")
    n = len(v.encode("utf-8", "surrogatepass"))
    if not min_bytes <= n <= max_bytes:
        raise _Bad(field, f"string of {n} bytes, allowed {min_bytes}..{max_bytes}")
    return v


def name(v, field: str) -> str:
    string(v, field, MAX_NAME_BYTES, 1)
    if not _PRINTABLE.fullmatch(v):
        raise _Bad(field, f"{v[:60]!r}: names must be printable ASCII")
    return v


def hex_digest(v, field: str) -> str:
    if not isinstance(v, str) or not _HEX.fullmatch(v):
        raise _Bad(field, f"expected {CHECKSUM_HEX_LEN} lowercase hex digits, got {_show(v)}")
    return v


def _show(v) -> str:
    r = repr(v)
    return type(v).__name__ if len(r) > 40 else f"{type(v).__name__} {r}"


# ---- schema ------------------------------------------------------------------------------------
def _tensor(v, i: int) -> TensorEntry:
    f = f"tensors[{i}]"
    members(v, f, ("name", "shape", "format", "offset", "length", "xxh3"))
    nm = name(v["name"], f + ".name")
    f = f"tensor {nm}"
    shape = v["shape"]
    if not isinstance(shape, list):
        raise _Bad(f + ".shape", f"expected an array, got {_show(shape)}")
    shape = tuple(integer(d, f"{f}.shape[{j}]", 1, MAX_DIM) for j, d in enumerate(shape))
    fmt = v["format"]
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise _Bad(f + ".format", f"unknown format {fmt[:40]!r} (known: {', '.join(FORMATS)})"
                   if isinstance(fmt, str) else f"expected a format name, got {_show(fmt)}")
    check_shape(FORMATS[fmt], shape, f)
    off = integer(v["offset"], f + ".offset")
    length = integer(v["length"], f + ".length", 1)
    want = FORMATS[fmt].encoded_size(shape)
    if length != want:
        raise _Bad(f + ".length", f"{length} bytes, but {fmt} {list(shape)} encodes to {want}")
    return TensorEntry(nm, shape, fmt, off, length, hex_digest(v["xxh3"], f + ".xxh3"))


def check_shape(num, shape: tuple[int, ...], field: str) -> None:
    if len(shape) not in num.ndim:
        raise _Bad(field + ".shape", f"{list(shape)}: {num.name} needs rank {' or '.join(map(str, num.ndim))}")
    if shape and shape[-1] % num.k_multiple:
        raise _Bad(field + ".shape", f"{list(shape)}: {num.name} needs the last dim a multiple of {num.k_multiple}")


def _resource(v, i: int) -> ResourceEntry:
    f = f"resources[{i}]"
    members(v, f, ("name", "encoding", "offset", "length", "raw_length", "xxh3"))
    nm = name(v["name"], f + ".name")
    f = f"resource {nm}"
    enc = v["encoding"]
    if not isinstance(enc, str) or enc not in RESOURCE_ENCODINGS:
        raise _Bad(f + ".encoding", f"expected one of {list(RESOURCE_ENCODINGS)}, got {_show(enc)}")
    off = integer(v["offset"], f + ".offset")
    length = integer(v["length"], f + ".length", 1)
    raw_length = integer(v["raw_length"], f + ".raw_length", 1, MAX_RESOURCE_BYTES + 1)
    if enc == "raw" and raw_length != length:
        raise _Bad(f + ".raw_length", f"{raw_length} != length {length} for a raw resource")
    return ResourceEntry(nm, enc, off, length, raw_length, hex_digest(v["xxh3"], f + ".xxh3"))


def _entries(v, field: str, parse) -> tuple:
    if not isinstance(v, list):
        raise _Bad(field, f"expected an array, got {_show(v)}")
    out, seen = [], set()
    for i, e in enumerate(v):
        entry = parse(e, i)
        if entry.name in seen:
            raise _Bad(f"{field}[{i}].name", f"duplicate name {entry.name!r}")
        if out and entry.offset <= out[-1].offset:
            raise _Bad(f"{field}[{i}].offset", f"{entry.name}: entries are not sorted by increasing offset")
        seen.add(entry.name)
        out.append(entry)
    return tuple(out)


def _identity(v) -> dict:
    members(v, "identity", ("artifact_id", "source", "recipe", "producer"))
    hex_digest(v["artifact_id"], "identity.artifact_id")
    string(v["source"], "identity.source", MAX_SOURCE_BYTES)
    string(v["producer"], "identity.producer", MAX_NAME_BYTES, 1)
    if not isinstance(v["recipe"], dict):
        raise _Bad("identity.recipe", f"expected an object, got {_show(v['recipe'])}")
    return v


def _tp(v) -> dict:
    members(v, "tp", ("size", "rank", "files"))
    size = integer(v["size"], "tp.size", 1, MAX_TP_SIZE + 1)
    integer(v["rank"], "tp.rank", 0, size)
    files = v["files"]
    if not isinstance(files, list) or len(files) != size:
        raise _Bad("tp.files", f"expected an array of tp.size={size} entries, got {_show(files)}")
    stems = set()
    for i, e in enumerate(files):
        f = f"tp.files[{i}]"
        members(e, f, ("name", "payload_length", "shard_digest"))
        parts = split_rank_file_name(name(e["name"], f + ".name"))
        if parts is None or parts[1:] != (size, i):
            raise _Bad(f + ".name", f"{e['name']!r} is not '<stem>.tp{size}-rank{i}{SUFFIX}'")
        stems.add(parts[0])
        integer(e["payload_length"], f + ".payload_length")
        hex_digest(e["shard_digest"], f + ".shard_digest")
    if len(stems) > 1:
        raise _Bad("tp.files", f"rank files have different stems {sorted(stems)}")
    return v


def validate_directory(obj: dict, payload_length: int, where: str) -> Directory:
    """The closed schema, geometry and self-consistency of a parsed directory (FORMAT.md §2-§4)."""
    try:
        members(obj, "", ("model", "identity", "tp", "tensors", "resources"))
        config = check_model(obj["model"])
        identity, tp = _identity(obj["identity"]), _tp(obj["tp"])
        tensors = _entries(obj["tensors"], "tensors", _tensor)
        resources = _entries(obj["resources"], "resources", _resource)
        check_geometry(tensors, resources, payload_length)
        _check_self(tp, identity, tensors, resources, payload_length)
    except _Bad as e:
        raise FormatError(f"{where}: {e}") from None
    except FormatError as e:           # ConfigError from the model member
        raise FormatError(f"{where}: {e}") from None
    return Directory(config, obj["model"], identity, tp, tensors, resources)


def check_geometry(tensors, resources, payload_length: int) -> None:
    end, prev = 0, None
    for e in sorted(tensors + resources, key=lambda e: e.offset):
        kind = "tensor" if isinstance(e, TensorEntry) else "resource"
        if e.offset % TENSOR_ALIGN:
            raise _Bad(f"{kind} {e.name}.offset", f"{e.offset} is not a multiple of {TENSOR_ALIGN}")
        if e.offset < end:
            raise _Bad(f"{kind} {e.name}.offset", f"[{e.offset}, {e.offset + e.length}) overlaps {prev}")
        if e.offset + e.length > payload_length:
            raise _Bad(f"{kind} {e.name}", f"[{e.offset}, {e.offset + e.length}) is outside the payload "
                       f"of {payload_length} bytes")
        end, prev = e.offset + e.length, e.name
    if end != payload_length:
        raise _Bad("payload_length", f"{payload_length}, but the last entry ends at {end}")


def _check_self(tp, identity, tensors, resources, payload_length: int) -> None:
    mine = tp["files"][tp["rank"]]
    if mine["payload_length"] != payload_length:
        raise _Bad(f"tp.files[{tp['rank']}].payload_length",
                   f"{mine['payload_length']} != this file's payload length {payload_length}")
    digest = shard_digest([t.to_json() for t in tensors], [r.to_json() for r in resources])
    if mine["shard_digest"] != digest:
        raise _Bad(f"tp.files[{tp['rank']}].shard_digest", f"{mine['shard_digest']} != computed {digest} "
                   "(the tensor or resource tables were altered)")
    aid = artifact_id([f["shard_digest"] for f in tp["files"]])
    if identity["artifact_id"] != aid:
        raise _Bad("identity.artifact_id", f"{identity['artifact_id']} != computed {aid}")
