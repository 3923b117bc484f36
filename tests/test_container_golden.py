"""The golden file formats/testdata/tiny.tp1-rank0.ninfer: known values, and regenerating it is byte-exact."""
from __future__ import annotations

import os
import struct

from ninfer_formats.container import open_artifact


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


GOLDEN = os.path.join(os.path.dirname(__file__), "..", "formats", "testdata", "tiny.tp1-rank0.ninfer")
GOLDEN_ID = "152685b512c12521927f37b181adc00b"


def _make_testdata():
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "tools", "make_testdata.py")
    spec = importlib.util.spec_from_file_location("make_testdata", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_golden_known_values():
    assert os.path.getsize(GOLDEN) == 8321 < 64 * 1024
    with open_artifact(GOLDEN, verify=True) as a:
        assert a.artifact_id == GOLDEN_ID and a.identity["producer"] == "ninfer testdata"
        assert (a.header.payload_offset, a.header.payload_length) == (4096, 4225)
        assert a.config.layer_types == ("linear_attention", "full_attention") and a.config.eos_token_ids == (2,)
        assert {n: e.fmt for n, e in a.tensors.items()}["layers.1.self_attn.q_proj.weight"] == "iq3_s"
        assert a.array("norm.weight")[:5].tolist() == [-1.75, -0.875, 0.0, 0.875, 1.75]
        assert a.array("layers.0.linear_attn.conv1d.weight").tolist() == [[-6, -5, -4, -3], [-2, -1, 0, 1], [2, 3, 4, 5]]
        assert a.array("layers.0.linear_attn.A_log").tolist() == [0.5, -1.25]
        assert a.array("embed_tokens.weight")[0, :4].tolist() == [49136, 49024, 48640, 16192]   # bf16 bits
        assert a.tensors["layers.1.mlp.down_proj.weight"].xxh3 == "015fd6ee18d602c5123fe49070497f44"
        assert struct.unpack("<f", a.raw("layers.0.mlp.up_proj.weight")[:4].tobytes())[0] == 0.25
        assert a.resource("chat_template.jinja").startswith(b"{% for m in messages %}")
        assert a.resources["tokenizer.json"].encoding == "zstd"


def test_golden_regenerates_identically(tmp_path):
    path = _make_testdata().generate(str(tmp_path))
    assert _read(path) == _read(GOLDEN)
