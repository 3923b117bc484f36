#!/usr/bin/env python3
"""Regenerate formats/testdata/tiny.tp1-rank0.ninfer, the golden .ninfer file (< 64 KiB).

Contents are computed from closed-form integer formulas (no RNG, no libm), so the bytes depend only on the
format, this script and zstd. tests/test_container.py::test_golden_* read the file and regenerate it.
Usage: python tools/make_testdata.py [OUT_DIR]   (default: formats/testdata)
"""
from __future__ import annotations

import os
import struct
import sys
import tempfile

import numpy as np

from ninfer_formats.constants import FORMATS
from ninfer_formats.container import rank_file_name, write_artifact
from ninfer_formats.model_config import ModelConfig

STEM = "tiny"
CONFIG = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2,
              linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "full_attention"], eos_token_ids=[2], bos_token_id=1,
              extra={"model_type": "qwen3_5_text", "note": "golden test file"})
META = {"source": "ninfer/testdata@golden", "recipe": {"default": "mixed", "note": "closed-form bytes"},
        "producer": "ninfer testdata"}
CHAT_TEMPLATE = b"{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
RESOURCES = {"chat_template.jinja": CHAT_TEMPLATE,
             "generation_config.json": b'{"temperature": 0.6, "top_p": 0.95, "top_k": 20}',
             "tokenizer.json": b'{"version": "1.0", "vocab": {' + b", ".join(
                 b'"t%d": %d' % (i, i) for i in range(32)) + b"}}"}


def pattern(n: int, salt: int) -> np.ndarray:
    """n pseudo-random bytes from an integer hash (stable everywhere)."""
    i = np.arange(n, dtype=np.uint64) + np.uint64(salt * 1000003)
    return ((i * np.uint64(2654435761) + np.uint64(salt)) >> np.uint64(13)).astype(np.uint8)


def f32_values(n: int, salt: int) -> np.ndarray:
    """Exactly representable values k/8, k in [-16, 16)."""
    return ((np.arange(n) * 7 + salt) % 32 - 16).astype(np.float32) / np.float32(8)


def tensors() -> dict:
    out = {}
    emb = f32_values(32 * 16, 1)
    out["embed_tokens.weight"] = ("bf16", (32, 16), (emb.view(np.uint32) >> 16).astype("<u2"))   # exact in bf16
    out["norm.weight"] = ("f32", (16,), f32_values(16, 2).astype("<f4"))
    out["layers.0.linear_attn.A_log"] = ("f16", (2,), np.array([0.5, -1.25], "<f2"))
    out["layers.0.linear_attn.conv1d.weight"] = ("i32", (3, 4), np.arange(-6, 6, dtype="<i4").reshape(3, 4))
    s2 = struct.pack("<f", 0.25) + bytes(12)
    codes, scales = pattern(32 * 16, 3), 0x30 + pattern(32 * 2, 4) % 16        # E4M3 0x30..0x3f: finite, > 0
    out["layers.0.mlp.up_proj.weight"] = ("nvfp4", (32, 32), np.frombuffer(s2 + codes.tobytes() + scales.tobytes(),
                                                                             np.uint8))
    out["layers.1.mlp.down_proj.weight"] = ("q6_k", (2, 256), _blocks(2, 210, 208, 5))
    out["layers.1.self_attn.q_proj.weight"] = ("iq3_s", (1, 256), _blocks(1, 110, 0, 6))
    rows = np.array([0.5, 2.0, 0.125], "<f4").tobytes() + bytes(4)
    out["layers.1.self_attn.o_proj.weight"] = ("f8_e4m3_row", (3, 20),
                                               np.frombuffer(rows + (pattern(60, 7) % 0x7f).tobytes(), np.uint8))
    for name, (fmt, shape, data) in out.items():
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        assert data.size == FORMATS[fmt].encoded_size(shape), name
        out[name] = (fmt, shape, data)
    return out


def _blocks(n: int, size: int, d_at: int, salt: int) -> np.ndarray:
    """n GGML blocks of pattern bytes with a finite fp16 super-scale d = 2^-4 at byte d_at."""
    b = pattern(n * size, salt).reshape(n, size).copy()
    b[:, d_at:d_at + 2] = np.frombuffer(np.array([0.0625], "<f2").tobytes(), np.uint8)
    return b.reshape(-1)


def generate(out_dir: str) -> str:
    cfg = ModelConfig(**CONFIG)
    return write_artifact(out_dir, STEM, cfg, [tensors()], RESOURCES, META)[0]


def main(argv: list[str]) -> int:
    out_dir = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "formats", "testdata")
    with tempfile.TemporaryDirectory() as tmp:        # build aside, then move: never a half-written golden
        path = generate(tmp)
        final = os.path.join(out_dir, rank_file_name(STEM, 1, 0))
        os.makedirs(out_dir, exist_ok=True)
        os.replace(path, final) if os.stat(tmp).st_dev == os.stat(out_dir).st_dev else _copy(path, final)
    print(f"{final} ({os.path.getsize(final)} bytes)", file=sys.stderr)
    return 0


def _copy(src: str, dst: str) -> None:
    with open(src, "rb") as f, open(dst + ".partial", "wb") as g:
        g.write(f.read())
    os.replace(dst + ".partial", dst)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
