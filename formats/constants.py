"""Every constant of the `.ninfer` v1 format, defined once (FORMAT.md refers to these names)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# ---- framing -------------------------------------------------------------------------------
MAGIC = b"NINFER\x00\x1a"          # 8 bytes; \x1a stops `type`/`cat` on some terminals
VERSION = 1                        # u32; a reader refuses any other major version
HEADER_SIZE = 64                   # fixed header, see FORMAT.md §2
PAYLOAD_ALIGN = 4096               # payload start (page) alignment
TENSOR_ALIGN = 256                 # every tensor and resource offset inside the payload
MAX_DIRECTORY_BYTES = 64 << 20     # a directory larger than this is refused before it is read
SUFFIX = ".ninfer"
PARTIAL_SUFFIX = ".partial"        # files under construction; never a complete artifact
CHECKSUM = "xxh3_128"              # algorithm of every checksum in the file, lowercase hex, 32 chars
CHECKSUM_HEX_LEN = 32

# ---- numeric block geometry ----------------------------------------------------------------
NVFP4_BLOCK = 16                   # elements per E4M3 scale, along K
NVFP4_HEADER = 16                  # f32 global scale + 12 zero bytes ahead of the codes
E4M3_MAX = 448.0
E2M1_MAX = 6.0
QK_K = 256                         # GGML super-block
Q6_K_BLOCK_BYTES = 210
IQ3_S_BLOCK_BYTES = 110
F8_ROW_HEADER_ALIGN = 16           # per-row f32 scales are padded to this before the codes
E4M3_MIN_SUBNORMAL = 2.0 ** -9      # smallest positive E4M3FN value; NVFP4 block-scale floor
Q6_K_SUBBLOCK = 16                 # weights per int8 sub-scale inside a Q6_K block
GGML_GROUP_MAX_EPS = 1e-15         # ggml: a (sub-)block with max |x| below this quantizes to zeros


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _pad(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class NumFormat:
    """One entry of the closed registry of numeric formats."""

    name: str
    code: int
    ndim: tuple[int, ...]              # allowed ranks of the logical shape
    k_multiple: int                    # the last dim must be a multiple of this
    encoded_size: Callable[[tuple[int, ...]], int]
    bits_per_weight: float             # nominal, for reports


def _plain(itemsize: int):
    return lambda shape: _prod(shape) * itemsize


def _nvfp4_size(shape) -> int:
    n, k = shape
    return NVFP4_HEADER + n * (k // 2) + n * (k // NVFP4_BLOCK)


def _gguf_size(block_bytes: int):
    return lambda shape: shape[0] * (shape[1] // QK_K) * block_bytes


def _f8_row_size(shape) -> int:
    n, k = shape
    return _pad(4 * n, F8_ROW_HEADER_ALIGN) + n * k


FORMATS: dict[str, NumFormat] = {f.name: f for f in (
    NumFormat("f32", 0, (0, 1, 2, 3, 4), 1, _plain(4), 32.0),
    NumFormat("f16", 1, (0, 1, 2, 3, 4), 1, _plain(2), 16.0),
    NumFormat("bf16", 2, (0, 1, 2, 3, 4), 1, _plain(2), 16.0),
    NumFormat("i32", 3, (0, 1, 2, 3, 4), 1, _plain(4), 32.0),
    NumFormat("f8_e4m3_row", 4, (2,), 1, _f8_row_size, 8.0),
    NumFormat("nvfp4", 5, (2,), NVFP4_BLOCK, _nvfp4_size, 4.5),
    NumFormat("q6_k", 6, (2,), QK_K, _gguf_size(Q6_K_BLOCK_BYTES), 6.5625),
    NumFormat("iq3_s", 7, (2,), QK_K, _gguf_size(IQ3_S_BLOCK_BYTES), 3.4375),
)}

QUANTIZED = frozenset({"f8_e4m3_row", "nvfp4", "q6_k", "iq3_s"})

# ---- container limits and header layout (FORMAT.md §1-§3) ----------------------------------
HEADER_STRUCT = "<8sIIQQQ16sQ"     # magic, version, flags, dir_len, payload_offset, payload_length, dir_xxh3, header_xxh3
HEADER_HASHED = 56                 # header_xxh3 covers bytes [0, 56)
MAX_TP_SIZE = 256
MAX_NAME_BYTES = 256               # tensor/resource/file names: printable ASCII 0x20..0x7e
MAX_SOURCE_BYTES = 4096            # identity.source
MAX_RESOURCE_BYTES = 1 << 30       # raw_length of a resource
MAX_JSON_INT = 1 << 53             # every directory integer is below this (safe in any JSON parser)
MAX_DIM = 1 << 31                  # every shape dimension is below this
RESOURCE_ENCODINGS = ("raw", "zstd")
ZSTD_LEVEL = 19
