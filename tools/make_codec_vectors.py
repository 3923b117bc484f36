"""Regenerate formats/testdata/codec_vectors.json: a few blocks per codec with their exact bytes and decoded
values. Every vector is produced by ninfer_formats.codecs AND cross-checked against the independent oracles
(ggml-python / gguf for q6_k, the ml_dtypes ModelOpt transcription for nvfp4, ml_dtypes for f8_e4m3_row,
torch for bf16); the file is only written when all agree.

    python tools/make_codec_vectors.py [--out formats/testdata/codec_vectors.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from codec_oracles import ggml_quantize, gguf_dequantize, nvfp4_reference, same_bits  # noqa: E402

from ninfer_formats import codecs  # noqa: E402

Q6_K_TYPE = 14


def _inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20261129)
    nv = rng.standard_normal((3, 32)).astype(np.float32)
    nv[0, :16] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.0, 0.0, -1e-3, 7.0, -6.0, 0.5, 1.0, -2.5]
    nv[1, 16:] = 0.0
    nv[2] *= 1e-4
    q6 = rng.standard_normal((2, 256)).astype(np.float32)
    q6[1, :16] = 0.0
    q6[1, 100] = 25.0
    q6[1, 200:216] = 1e-3
    f8 = rng.standard_normal((3, 8)).astype(np.float32)
    f8[1] = 0.0
    f8[2, 3] = -1e-9
    bf = np.array([[1.0, 1.00390625, 1.01171875, -3.1415927, 65504.0, 1e-40, -0.0, 3.3895e38]], np.float32)
    return {"nvfp4": nv, "q6_k": q6, "f8_e4m3_row": f8, "bf16": bf}


def _oracle_bytes(fmt: str, w: np.ndarray) -> np.ndarray:
    if fmt == "nvfp4":
        codes, scales, s2 = nvfp4_reference(w)
        return np.concatenate([np.array([s2], "<f4").view(np.uint8), np.zeros(12, np.uint8),
                               codes.ravel(), scales.ravel()])
    if fmt == "q6_k":
        return ggml_quantize(Q6_K_TYPE, w).ravel()
    if fmt == "f8_e4m3_row":
        amax = np.abs(w).max(axis=1) / np.float32(448)
        scale = np.where(amax == 0, np.float32(1), amax).astype(np.float32)
        codes = np.clip(w / scale[:, None], -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        head = np.zeros(-(-4 * len(scale) // 16) * 16, np.uint8)
        head[: 4 * len(scale)] = scale.astype("<f4").view(np.uint8)
        return np.concatenate([head, codes.ravel()])
    return torch.from_numpy(w).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8).ravel()


def build() -> list[dict]:
    cases = []
    for fmt, w in _inputs().items():
        enc = codecs.encode(fmt, w)
        if not np.array_equal(enc, _oracle_bytes(fmt, w)):
            raise SystemExit(f"error: {fmt}: codec bytes disagree with the oracle; not writing vectors")
        dec = codecs.decode(fmt, enc, w.shape)
        if fmt == "q6_k" and not same_bits(dec, gguf_dequantize("q6_k", enc.reshape(w.shape[0], -1))):
            raise SystemExit("error: q6_k: decode disagrees with gguf; not writing vectors")
        cases.append({"format": fmt, "shape": list(w.shape), "input": w.ravel().tolist(),
                      "encoded_hex": enc.tobytes().hex(), "decoded": dec.ravel().tolist()})
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "formats" / "testdata" / "codec_vectors.json"))
    args = ap.parse_args(argv)
    doc = {"about": "codec golden vectors; regenerate with tools/make_codec_vectors.py", "cases": build()}
    tmp = args.out + ".partial"
    with open(tmp, "w") as f:   # one case per line: diffable without a line per number
        f.write('{"about": %s,\n "cases": [\n  ' % json.dumps(doc["about"]))
        f.write(",\n  ".join(json.dumps(c) for c in doc["cases"]) + "\n]}\n")
    os.replace(tmp, args.out)
    print(f"wrote {len(doc['cases'])} cases to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
