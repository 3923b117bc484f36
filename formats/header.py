"""The fixed 64-byte `.ninfer` header (FORMAT.md §1): packing and the ordered framing checks."""
from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from .constants import (HEADER_HASHED, HEADER_SIZE, HEADER_STRUCT, MAGIC, MAX_DIRECTORY_BYTES,
                        PAYLOAD_ALIGN, VERSION)
from .errors import FormatError

_HEADER = struct.Struct(HEADER_STRUCT)
assert _HEADER.size == HEADER_SIZE


def align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def payload_offset_for(dir_len: int) -> int:
    return align_up(HEADER_SIZE + dir_len, PAYLOAD_ALIGN)


@dataclass(frozen=True)
class Header:
    dir_len: int
    payload_offset: int
    payload_length: int
    dir_xxh3: int                      # u128 value; its 32-digit hex is the directory checksum
    version: int = VERSION
    flags: int = 0

    @property
    def file_size(self) -> int:
        return self.payload_offset + self.payload_length

    def pack(self) -> bytes:
        lo, hi = self.dir_xxh3 & ((1 << 64) - 1), self.dir_xxh3 >> 64
        body = _HEADER.pack(MAGIC, self.version, self.flags, self.dir_len, self.payload_offset,
                            self.payload_length, struct.pack("<QQ", lo, hi), 0)[:HEADER_HASHED]
        return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def make_header(directory: bytes, payload_length: int) -> bytes:
    """The header for `directory` (its final, padded bytes) and a payload of `payload_length` bytes."""
    return Header(len(directory), payload_offset_for(len(directory)), payload_length,
                  xxhash.xxh3_128_intdigest(directory)).pack()


def parse_header(buf: bytes, file_size: int, where: str) -> Header:
    """Check framing in FORMAT.md §1 order; `buf` is the first (up to) 64 bytes of a `file_size`-byte file."""
    if file_size < HEADER_SIZE or len(buf) < HEADER_SIZE:
        raise FormatError(f"{where}: truncated: {file_size} bytes, the header alone is {HEADER_SIZE}")
    magic, version, flags, dir_len, p_off, p_len, dx, hx = _HEADER.unpack(buf[:HEADER_SIZE])
    if magic != MAGIC:
        raise FormatError(f"{where}: not a .ninfer file (magic {magic.hex()}, expected {MAGIC.hex()})")
    if version != VERSION:
        raise FormatError(f"{where}: version {version} is not supported; this reader reads version {VERSION}")
    if xxhash.xxh3_64_intdigest(buf[:HEADER_HASHED]) != hx:
        raise FormatError(f"{where}: header checksum mismatch (header bytes are corrupt)")
    if flags != 0:
        raise FormatError(f"{where}: header flags {flags:#x} are not zero (unknown features)")
    if dir_len > MAX_DIRECTORY_BYTES:
        raise FormatError(f"{where}: directory of {dir_len} bytes exceeds the limit of {MAX_DIRECTORY_BYTES}")
    if dir_len < 2:
        raise FormatError(f"{where}: directory length {dir_len} is too small")
    if p_off != payload_offset_for(dir_len):
        raise FormatError(f"{where}: payload offset {p_off} != align_up(64 + {dir_len}, {PAYLOAD_ALIGN})")
    if file_size < p_off + p_len:
        raise FormatError(f"{where}: truncated: {file_size} bytes, header says {p_off + p_len}")
    if file_size > p_off + p_len:
        raise FormatError(f"{where}: {file_size - p_off - p_len} trailing bytes after the payload")
    lo, hi = struct.unpack("<QQ", dx)
    return Header(dir_len, p_off, p_len, lo | hi << 64, version, flags)
