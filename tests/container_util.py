"""Helpers for container tests: tiny configs, random tensors of exact encoded size, and file surgery
(rebuild a file from an edited directory with consistent header / digests, so a test reaches the check it
targets instead of tripping an earlier checksum)."""
from __future__ import annotations

import json
import struct

import numpy as np
import xxhash

from ninfer_formats.constants import FORMATS, HEADER_SIZE
from ninfer_formats.directory import artifact_id, canon, shard_digest
from ninfer_formats.header import make_header
from ninfer_formats.model_config import ModelConfig


def tiny_config(**kw) -> ModelConfig:
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                eos_token_ids=[1, 2])
    base.update(kw)
    return ModelConfig(**base)


# (format, shape) pairs with odd sizes; every registry format appears
MIXED = {
    "embed_tokens.weight": ("bf16", (37, 24)),
    "layers.0.input_layernorm.weight": ("f32", (24,)),
    "layers.0.linear_attn.A_log": ("f16", (3,)),
    "layers.0.mlp.gate_proj.weight": ("nvfp4", (5, 48)),
    "layers.0.mlp.down_proj.weight": ("q6_k", (3, 512)),
    "layers.0.self_attn.q_proj.weight": ("iq3_s", (7, 256)),
    "layers.0.self_attn.o_proj.weight": ("f8_e4m3_row", (5, 33)),
    "positions": ("i32", (2, 3, 5)),
    "scalar": ("f32", ()),
}
RESOURCES = {"tokenizer.json": b'{"model": {"vocab": ["a", "b", "c"]}}' * 40,   # compresses -> zstd
             "chat_template.jinja": b"{{ x }}"}                                  # tiny -> raw
META = {"source": "test/tiny@0", "recipe": {"default": "mixed"}, "producer": "ninfer test"}


def random_tensors(rng, spec: dict = MIXED) -> dict:
    return {n: (f, s, rng.integers(0, 256, FORMATS[f].encoded_size(s), dtype=np.uint8))
            for n, (f, s) in spec.items()}


# ---- file surgery ----------------------------------------------------------------------------
def split(data: bytes):
    """(directory object, payload bytes) of a well-formed file."""
    dir_len, p_off = struct.unpack_from("<QQ", data, 16)
    return json.loads(data[HEADER_SIZE:HEADER_SIZE + dir_len]), data[p_off:]


def fix_digests(d: dict) -> dict:
    """Recompute this rank's shard digest and the artifact id after editing the tables (best effort:
    a directory mangled beyond that is left as it is)."""
    try:
        rank = d["tp"]["rank"]
        d["tp"]["files"][rank]["shard_digest"] = shard_digest(d["tensors"], d["resources"])
        d["identity"]["artifact_id"] = artifact_id([f["shard_digest"] for f in d["tp"]["files"]])
    except (KeyError, TypeError, IndexError, ValueError, AttributeError):
        pass
    return d


def build(directory, payload: bytes, *, payload_length: int | None = None) -> bytes:
    """A file with a correct header for `directory` (object or raw bytes) and `payload`."""
    raw = directory if isinstance(directory, (bytes, bytearray)) else canon(directory)
    header = make_header(bytes(raw), len(payload) if payload_length is None else payload_length)
    p_off = struct.unpack_from("<Q", header, 24)[0]
    return header + raw + bytes(p_off - HEADER_SIZE - len(raw)) + payload


def rehash_header(data: bytearray) -> bytearray:
    """Fix header_xxh3 after editing header fields."""
    struct.pack_into("<Q", data, 56, xxhash.xxh3_64_intdigest(bytes(data[:56])))
    return data


def edited(data: bytes, fn, *, digests: bool = True) -> bytes:
    """Apply `fn(directory_obj, payload_bytearray)` and rebuild the file consistently."""
    d, payload = split(data)
    payload = bytearray(payload)
    fn(d, payload)
    if digests:
        fix_digests(d)
    return build(d, bytes(payload))


def flip_tensor_bit(path, tensor: str, *, byte: int = 3, mask: int = 0x40) -> None:
    """Corrupt one bit of `tensor`'s stored bytes in place (the checksum must catch it)."""
    from ninfer_formats.container import open_artifact
    with open_artifact(path) as a:
        off = a.header.payload_offset + a.tensors[tensor].offset + byte
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ mask]))
