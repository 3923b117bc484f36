"""bench/serve.py on CPU: the shipped tiny model served in-process at concurrency 1 and 2; records carry the
fields other tools read, the server-side token times agree with the number of tokens asked for, and the
client-side numbers are kept beside them."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "serve.py")
FIELDS = ("concurrency", "agg_tok_s", "ttft_ms_p50", "itl_ms_p50", "gpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from ninfer_pack.convert import convert
    from ninfer_pack.demo import tiny_checkpoint
    out = tmp_path_factory.mktemp("serve-bench") / "tiny"
    convert(str(tiny_checkpoint()), out, recipe="bf16", jobs=1, progress=False, vision=False, tp=1)
    return str(out)


def test_serve_bench_records(tiny, tmp_path):
    out = tmp_path / "serve.json"
    r = subprocess.run([sys.executable, BENCH, "--artifact", tiny, "--concurrency", "1,2", "--max-tokens", "6",
                        "--prompt-tokens", "12", "--device", "cpu", "--out", str(out)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    recs = json.loads(out.read_text())
    assert [x["concurrency"] for x in recs] == [1, 2]
    for rec in recs:
        assert all(rec[f] is not None for f in FIELDS) and rec["gpu"] == "cpu"
        assert rec["agg_tok_s"] > 0 and rec["direct_agg_tok_s"] > 0 and rec["client_agg_tok_s"] > 0
        assert rec["ttft_ms_p50"] > 0 and rec["itl_ms_p50"] > 0
    assert "wrote" in r.stderr and "conc" in r.stdout


def test_serve_bench_bad_artifact(tmp_path):
    r = subprocess.run([sys.executable, BENCH, "--artifact", str(tmp_path / "missing"), "--device", "cpu",
                        "--out", str(tmp_path / "s.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and r.stderr.strip().startswith("error:") and "Traceback" not in r.stderr
    assert not (tmp_path / "s.json").exists()
