"""bench/graph_launch.py without a GPU: its argument errors, the CPU refusal as one line, and the records it builds
from an engine's captured graphs (the timing itself needs CUDA events: run on the device)."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))     # last: bench/ must not shadow anything
import graph_launch as bench  # noqa: E402

KEYS = {"kind", "recipe", "gpu", "pdl", "draft_tokens", "graph", "batch", "tokens", "kv_bucket", "nodes",
        "host_us", "idle_us", "steady_us", "exposed_us"}


@pytest.mark.parametrize("argv,why", [(["--ks", "9"], "--ks: expected comma-separated integers in 0..7, got '9'"),
                                      (["--ks", "a"], "--ks: expected comma-separated integers in 0..7, got 'a'"),
                                      (["--reps", "0"], "--reps")])
def test_bad_arguments_are_one_line(argv, why, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and why in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["--device", "cpu", "--tiny"], ["--eager", "--tiny"]], ids=["cpu", "eager"])
def test_needs_cuda_graphs(argv, capsys):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: graph_launch: CUDA graphs need --device cuda without --eager"


def test_node_count_without_a_raw_graph_is_none():
    assert bench.node_count(object()) is None


def test_records_per_captured_graph(monkeypatch):
    calls, filled = [], []

    class Runner:
        graphs = {("target", 1, 4, 64): SimpleNamespace(graph="g4"), ("mtp", 1, 1, 64): SimpleNamespace(graph="m1"),
                  ("target", 1, 1, 64): SimpleNamespace(graph="g1")}

        def _fill_padding(self, key):
            filled.append(key)

    eng = SimpleNamespace(graphs=Runner(), device="cuda", shutdown=lambda: calls.append("shutdown"))
    monkeypatch.setattr(bench, "_engine", lambda loaded, args, k: eng)
    monkeypatch.setattr(bench, "generate", lambda e, prompt, n, b: calls.append(("generate", len(prompt), n, b)))
    monkeypatch.setattr(bench, "time_graph", lambda g, reps, device: {"host_us": 30.0, "idle_us": 7030.0,
                                                                      "steady_us": 7000.0, "exposed_us": 30.0})
    args = bench.parse_args(["--ks", "3", "--prompt-len", "8", "--new-tokens", "4"])
    loaded = SimpleNamespace(config=SimpleNamespace(vocab_size=100))
    recs = bench.measure_engine(loaded, args, 3, {"kind": "graph_launch", "recipe": "nvfp4", "gpu": "X", "pdl": "1"})
    assert [(r["graph"], r["tokens"]) for r in recs] == [("mtp", 1), ("target", 1), ("target", 4)]
    assert filled == [("mtp", 1, 1, 64), ("target", 1, 1, 64), ("target", 1, 4, 64)]   # replays on scratch rows
    assert all(set(r) == KEYS and r["draft_tokens"] == 3 and r["nodes"] is None for r in recs)
    assert calls == [("generate", 8, 4, 1), "shutdown"]


def test_an_engine_without_graphs_is_an_error(monkeypatch):
    eng = SimpleNamespace(graphs=None, device="cuda", shutdown=lambda: None)
    monkeypatch.setattr(bench, "_engine", lambda loaded, args, k: eng)
    monkeypatch.setattr(bench, "generate", lambda *a: None)
    args = bench.parse_args([])
    loaded = SimpleNamespace(config=SimpleNamespace(vocab_size=100))
    with pytest.raises(bench.NinferError, match="K=0: the engine captured no CUDA graphs"):
        bench.measure_engine(loaded, args, 0, {})
