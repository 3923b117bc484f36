"""Write the IQ3_S golden vectors (formats/testdata/codec_iq3_s_golden.json).

Decoded values come from `gguf.quants.dequantize` (an oracle independent of ninfer's decoder). Encoded cases
also store the input weights and the relative RMSE ninfer's encoder reached when the file was written, so
the test can pin the encoder's quality without depending on float summation order across CPUs.

    python tools/make_iq3s_vectors.py [--out PATH] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "formats" / "testdata" / "codec_iq3_s_golden.json"
SEED = 20260829


def _encoded_inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    zero_sub = rng.standard_normal((1, 256))
    zero_sub[0, 96:128] = 0.0                   # sub-block 3 all zero (ggml shifts the rest of the block here)
    mixed = np.stack([np.full(256, 0.37), np.zeros(256)])
    return {
        "gauss": rng.standard_normal((1, 256)),
        "student_t3": rng.standard_t(3, (1, 256)),
        "zero_subblock": zero_sub,
        "constant_then_zero_row": mixed,
        "two_blocks_far_apart": rng.standard_normal((1, 512)) * np.repeat(10.0 ** rng.uniform(-4, 2, 2), 256),
    }


def _block(d_bits: int, s4, idx, sign_bytes) -> np.ndarray:
    from ninfer_formats.codecs.iq3_s import pack_blocks, unpack_blocks

    d16 = np.array([d_bits], dtype=np.uint16).view(np.float16)
    neg = np.unpackbits(np.asarray(sign_bytes, np.uint8)[None], axis=1, bitorder="little").astype(bool)
    out = pack_blocks(d16, np.asarray(s4, np.uint8)[None], np.asarray(idx, np.int32)[None], neg)
    assert unpack_blocks(out)[2].tolist() == [list(idx)]
    return out


def _handmade_blocks() -> dict[str, np.ndarray]:
    """Decode-only adversarial blocks: byte patterns an encoder never writes."""
    ramp = np.arange(64) * 8 % 512                                        # covers both qh bit values
    return {
        "subnormal_d_max_scales": _block(0x0001, [15] * 8, ramp, [0xA5] * 32),
        "max_d_max_index": _block(0x7BFF, [15] * 8, [511] * 64, [0xFF] * 32),
        "negative_d_mixed_scales": _block(0xBC00, range(0, 16, 2), (ramp + 3) % 512, range(0, 256, 8)),
        "zero_d_nonzero_payload": _block(0x0000, [7] * 8, ramp[::-1], [0x0F] * 32),
        "negative_zero_d": _block(0x8000, [1] * 8, ramp, [0x3C] * 32),
    }


def build_cases() -> list[dict]:
    import gguf

    from ninfer_formats.codecs import iq3_s

    qtype = gguf.GGMLQuantizationType.IQ3_S
    cases = []
    for name, w in _encoded_inputs(np.random.default_rng(SEED)).items():
        w = w.astype(np.float32)
        blocks = iq3_s.quantize_rows(w)
        dec = gguf.quants.dequantize(blocks, qtype)
        rel = float(np.sqrt(((dec.astype(np.float64) - w) ** 2).sum() / max((w.astype(np.float64) ** 2).sum(), 1e-300)))
        cases.append({"name": name, "shape": list(w.shape), "input": w.ravel().tolist(),
                      "blocks_hex": blocks.tobytes().hex(), "decoded": dec.ravel().tolist(), "rel_rmse": rel})
    for name, blocks in _handmade_blocks().items():
        dec = gguf.quants.dequantize(blocks, qtype)
        cases.append({"name": name, "shape": [1, 256], "input": None, "blocks_hex": blocks.tobytes().hex(),
                      "decoded": dec.ravel().tolist(), "rel_rmse": None})
    return cases


def write(out: Path) -> dict:
    from importlib.metadata import version

    doc = {"format": "iq3_s", "generator": "tools/make_iq3s_vectors.py", "seed": SEED,
           "decoded_by": f"gguf {version('gguf')} quants.dequantize",
           "cases": build_cases()}
    tmp = out.with_name(out.name + ".partial")
    head = {k: v for k, v in doc.items() if k != "cases"}
    text = json.dumps(head, indent=1)[:-2] + ',\n "cases": [\n  '          # one case per line keeps diffs readable
    text += ",\n  ".join(json.dumps(c) for c in doc["cases"]) + "\n ]\n}\n"
    tmp.write_text(text)
    os.replace(tmp, out)
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    args = ap.parse_args(argv)
    from ninfer_formats.errors import NinferError

    try:
        doc = write(args.out)
    except (OSError, ImportError, NinferError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = {"path": str(args.out), "cases": [c["name"] for c in doc["cases"]]}
    print(json.dumps(summary) if args.json else f"wrote {len(summary['cases'])} cases to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
