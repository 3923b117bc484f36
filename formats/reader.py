"""Reading a `.ninfer` file: everything is validated before any data is handed out; views are zero-copy."""
from __future__ import annotations

import mmap
import os

import numpy as np
import xxhash
import zstandard

from .constants import HEADER_SIZE
from .directory import Directory, ResourceEntry, TensorEntry, parse_json, validate_directory
from .errors import ChecksumError, FormatError
from .header import Header, parse_header

_NP_DTYPES = {"f32": "<f4", "f16": "<f2", "bf16": "<u2", "i32": "<i4"}     # bf16 as its bit pattern


class Artifact:
    """An open rank file. `tensors`/`resources` map names to entries; data comes from a private mmap."""

    def __init__(self, path: str, header: Header, directory: Directory, mm: mmap.mmap):
        self.path, self.header, self._mm = path, header, mm
        self.directory = directory
        self.config = directory.config
        self.identity, self.tp, self.model = directory.identity, directory.tp, directory.model
        self.tensors: dict[str, TensorEntry] = {t.name: t for t in directory.tensors}
        self.resources: dict[str, ResourceEntry] = {r.name: r for r in directory.resources}

    @property
    def artifact_id(self) -> str:
        return self.identity["artifact_id"]

    # ---- data access ----
    def _mmap(self) -> mmap.mmap:
        if self._mm is None:
            raise FormatError(f"{self.path}: artifact is closed")
        return self._mm

    def _entry(self, name: str) -> TensorEntry:
        e = self.tensors.get(name)
        if e is None:
            raise FormatError(f"{self.path}: no tensor named {name!r}")
        return e

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor: a read-only uint8 view over the mapping (no copy)."""
        e = self._entry(name)
        a = np.frombuffer(self._mmap(), np.uint8, e.length, self.header.payload_offset + e.offset)
        a.flags.writeable = False
        return a

    def array(self, name: str) -> np.ndarray:
        """A typed read-only view of a plain-format tensor (bf16 as np.uint16 bit patterns)."""
        e = self._entry(name)
        if e.fmt not in _NP_DTYPES:
            raise FormatError(f"{self.path}: tensor {name} is {e.fmt}, not a plain format; use raw()")
        return self.raw(name).view(_NP_DTYPES[e.fmt]).reshape(e.shape)

    def torch(self, name: str):
        """A zero-copy torch tensor over the (copy-on-write) mapping: typed for plain formats, else uint8."""
        import torch
        dtypes = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "i32": torch.int32}
        e = self._entry(name)
        start = self.header.payload_offset + e.offset
        if e.fmt in dtypes:
            t = torch.frombuffer(self._mmap(), dtype=dtypes[e.fmt], count=e.numel, offset=start)
            return t.reshape(e.shape)
        return torch.frombuffer(self._mmap(), dtype=torch.uint8, count=e.length, offset=start)

    def resource(self, name: str) -> bytes:
        """A resource's decoded bytes; its checksum is always verified."""
        r = self.resources.get(name)
        if r is None:
            raise FormatError(f"{self.path}: no resource named {name!r}")
        start = self.header.payload_offset + r.offset
        stored = self._mmap()[start:start + r.length]
        if xxhash.xxh3_128_hexdigest(stored) != r.xxh3:
            raise ChecksumError(f"{self.path}: resource {name}: checksum mismatch (stored bytes are corrupt)")
        if r.encoding == "raw":
            return stored
        try:
            out = zstandard.ZstdDecompressor().decompress(stored, max_output_size=r.raw_length)
        except zstandard.ZstdError as e:
            raise FormatError(f"{self.path}: resource {name}: zstd: {e}") from None
        if len(out) != r.raw_length:
            raise FormatError(f"{self.path}: resource {name}: decodes to {len(out)} bytes, not {r.raw_length}")
        return out

    # ---- integrity ----
    def verify(self) -> None:
        """Hash every tensor and resource and check the zero gaps; raises naming the first bad one."""
        mm, base = self._mmap(), self.header.payload_offset
        entries = sorted([*self.tensors.values(), *self.resources.values()], key=lambda e: e.offset)
        mv = memoryview(mm)
        try:
            _advise_sequential(mm)
            end = 0
            for e in entries:
                if e.offset > end and np.frombuffer(mv[base + end:base + e.offset], np.uint8).any():
                    raise FormatError(f"{self.path}: non-zero bytes in the gap before {e.name} "
                                      f"(payload [{end}, {e.offset}))")
                if xxhash.xxh3_128_hexdigest(mv[base + e.offset:base + e.offset + e.length]) != e.xxh3:
                    kind = "tensor" if isinstance(e, TensorEntry) else "resource"
                    raise ChecksumError(f"{self.path}: {kind} {e.name}: checksum mismatch (data is corrupt)")
                end = e.offset + e.length
        finally:
            mv.release()
        for r in self.resources.values():
            self.resource(r.name)            # zstd frames must decode to raw_length

    def close(self) -> None:
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass        # views handed out still use it; the mapping goes away with the last of them

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"Artifact({self.path!r}, rank {self.tp['rank']}/{self.tp['size']}, "
                f"{len(self.tensors)} tensors, id {self.artifact_id[:12]})")


def _advise_sequential(mm: mmap.mmap) -> None:
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
        mm.madvise(mmap.MADV_SEQUENTIAL)


def read_directory(fd: int, size: int, where: str) -> tuple[Header, Directory]:
    header = parse_header(os.pread(fd, HEADER_SIZE, 0), size, where)
    data = os.pread(fd, header.payload_offset - HEADER_SIZE, HEADER_SIZE)
    if len(data) != header.payload_offset - HEADER_SIZE:
        raise FormatError(f"{where}: truncated while reading the directory")
    raw_dir, pad = data[:header.dir_len], data[header.dir_len:]
    if xxhash.xxh3_128_intdigest(raw_dir) != header.dir_xxh3:
        raise FormatError(f"{where}: directory checksum mismatch (directory bytes are corrupt)")
    if pad.count(0) != len(pad):
        raise FormatError(f"{where}: non-zero bytes between the directory and the payload")
    return header, validate_directory(parse_json(raw_dir, where), header.payload_length, where)


def open_artifact(path, verify: bool = False) -> Artifact:
    """Open and validate one rank file (FORMAT.md §1-§4); with verify=True also check every checksum."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header, directory = read_directory(f.fileno(), size, path)
        # copy-on-write: torch.frombuffer needs a writable buffer; writes never reach the file
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    art = Artifact(path, header, directory, mm)
    if verify:
        try:
            art.verify()
        except BaseException:
            art.close()
            raise
    return art

