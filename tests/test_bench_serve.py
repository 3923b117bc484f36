"""bench/serve.py on CPU: the shipped tiny model served in-process at concurrency 1 and 2; records carry the
fields other tools read, the server-side token counts agree with the number of tokens asked for, the ratio to
the in-process ceiling is the ratio of the two rates, and the client-side numbers are kept beside them. Bad
arguments are one-line errors; the scheduler's request log is waited for when it lags the client."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time

import pytest
from tiny_util import pack_tiny

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
BENCH = os.path.join(BENCH_DIR, "serve.py")
sys.path.append(BENCH_DIR)
import serve as serve_bench

FIELDS = ("concurrency", "agg_tok_s", "ttft_ms_p50", "itl_ms_p50", "gpu")
MAX_TOKENS = 6
REL_TOL = 1e-9          # a field derived from two others of the same record: equal up to float rounding


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return pack_tiny(tmp_path_factory.mktemp("serve-bench") / "tiny", tp=1)


def test_serve_bench_records(tiny, tmp_path):
    out = tmp_path / "serve.json"
    r = subprocess.run([sys.executable, BENCH, "--artifact", tiny, "--concurrency", "1,2", "--max-tokens",
                        str(MAX_TOKENS), "--prompt-tokens", "12", "--device", "cpu", "--waves", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    recs = json.loads(out.read_text())
    assert [x["concurrency"] for x in recs] == [1, 2]
    for rec in recs:
        c = rec["concurrency"]
        assert all(rec[f] is not None for f in FIELDS) and rec["gpu"].startswith("cpu")
        assert rec["agg_tok_s"] > 0 and rec["direct_agg_tok_s"] > 0 and rec["client_agg_tok_s"] > 0
        assert rec["ttft_ms_p50"] > 0 and rec["itl_ms_p50"] > 0
        # this level's own requests from the log (the warm-up asks for 8 tokens), each ignore_eos to the end
        assert rec["requests"] == rec["client_requests"] == c
        assert rec["completion_tokens"] == rec["client_completion_tokens"] == c * MAX_TOKENS
        assert math.isclose(rec["ratio_to_direct"], rec["agg_tok_s"] / rec["direct_agg_tok_s"], rel_tol=REL_TOL)
        assert rec["waves"] == 2 and rec["prefix_cache"] == 0 and len(rec["agg_tok_s_waves"]) == 2
        assert rec["agg_tok_s"] in rec["agg_tok_s_waves"]
        assert rec["itl_ms_p50"] in rec["itl_ms_p50_waves"] and len(rec["first_spread_ms_waves"]) == 2
        # every token after a request's first is one decode row, in-process (requests added at once); over HTTP a
        # row can also ride in a step that prefills a later arrival (counted as a prefill step)
        rows = {k: sum(int(b) * n for b, n in rec[k]["decode_batches"].items()) for k in ("engine", "direct_engine")}
        assert rows["direct_engine"] == c * (MAX_TOKENS - 1) and 0 < rows["engine"] <= c * (MAX_TOKENS - 1), rows
        assert len(rec["engine_waves"]) == 2 and rec["engine"] in rec["engine_waves"]
    assert "wrote" in r.stderr and "conc" in r.stdout


def test_serve_bench_bad_artifact(tmp_path):
    r = subprocess.run([sys.executable, BENCH, "--artifact", str(tmp_path / "missing"), "--device", "cpu",
                        "--out", str(tmp_path / "s.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and r.stderr.strip().startswith("error:") and "Traceback" not in r.stderr
    assert not (tmp_path / "s.json").exists()


@pytest.mark.parametrize("argv,needle", [
    (["--concurrency", "1,x"], "argument --concurrency: expected comma-separated integers"),
    (["--concurrency", "0"], "argument --concurrency: expected positive integers"),
    (["--max-tokens", "1"], "--max-tokens 1: at least 2"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice"),
    ([], "--artifact is required"),
], ids=["concurrency-not-int", "concurrency-zero", "one-token", "bad-dtype", "no-artifact"])
def test_bad_arguments_are_one_line_errors(argv, needle, tmp_path, capsys):
    base = [] if not argv else ["--artifact", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        serve_bench.main(base + argv + ["--out", str(tmp_path / "s.json")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "s.json").exists()


def _done(rid: int, t: float, tokens: int) -> str:
    timings = {"queued": 0.0, "ttft": 0.25, "decode": 0.5, "total": 1.0}
    return json.dumps({"event": "request_done", "time": t, "id": rid, "completion_tokens": tokens,
                       "timings_seconds": timings}) + "\n"


def test_server_side_waits_for_a_lagging_log(tmp_path):
    """The scheduler writes request_done after queuing the last chunk: the client can finish first."""
    log = tmp_path / "requests.jsonl"
    log.write_text(_done(0, 100.0, 8) + _done(1, 200.0, 6))

    def append():
        with log.open("a") as f:
            f.write(_done(2, 200.5, 6))
    late = threading.Timer(0.3, append)
    late.start()
    try:
        s = serve_bench.server_side(str(log), 1, 2, wait_s=10.0)
    finally:
        late.join()
    assert s["requests"] == 2 and s["completion_tokens"] == 12                  # not the first event's 8
    # starts 199.0 / 199.5, first tokens 199.25 / 199.75, last 199.75 / 200.25: 10 tokens after the firsts
    assert math.isclose(s["agg_tok_s"], 10 / 1.0, rel_tol=REL_TOL)
    assert math.isclose(s["ttft_ms_p50"], 250.0, rel_tol=1e-6) and math.isclose(s["itl_ms_p50"], 100.0, rel_tol=1e-6)
    assert math.isclose(s["first_spread_ms"], 500.0, rel_tol=1e-6)


def test_server_side_gives_up_on_a_missing_event(tmp_path):
    log = tmp_path / "requests.jsonl"
    log.write_text(_done(0, 100.0, 6))
    t = time.monotonic()
    with pytest.raises(serve_bench.RunFailed, match="logged 1 of 2 finished requests"):
        serve_bench.server_side(str(log), 0, 2, wait_s=0.3)
    assert time.monotonic() - t < 5
