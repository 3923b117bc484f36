"""bench/engine_host.py: the Engine's host time per MTP round on the CPU (graph bodies that compute nothing), its
records and windows, and the window split of a synthetic mark sequence."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))     # last: bench/ must not shadow anything
import engine_host  # noqa: E402

KEYS = {"kind", "draft_tokens", "acceptance", "rounds", "emitted", "tokens_per_round", "us_round", "windows_us",
        "torch_op_us", "round_in_ops", "cpu", "vocab", "hidden", "tag", "round_graphs", "sampled_rounds", "temperature",
        "batch"}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("rounds", ["0", "1"], ids=["separate-steps", "round-graphs"])
def test_records_and_windows(tmp_path, capsys, rounds):
    from ninfer_rt.graphs import GraphRunner
    real = (GraphRunner._body, GraphRunner._run)
    out = tmp_path / "h.json"
    rc = engine_host.main(["--ks", "1,3", "--acceptance", "0,1", "--new-tokens", "17", "--tag", "t",
                           "--dir", str(tmp_path / "a"), "--out", str(out), "--round-graphs", rounds])
    assert rc == 0
    recs = json.loads(out.read_text())
    assert [(r["draft_tokens"], r["acceptance"]) for r in recs] == [(1, 0.0), (1, 1.0), (3, 0.0), (3, 1.0)]
    for r in recs:
        assert set(r) == KEYS and r["emitted"] == 17 and r["us_round"] > 0 and r["round_in_ops"] > 0
        assert set(r["windows_us"]) == set(engine_host.WINDOWS) and r["tag"] == "t"
        assert r["round_graphs"] is (rounds == "1") and r["temperature"] == 0
        assert r["tokens_per_round"] == (1.0 if r["acceptance"] == 0 else r["draft_tokens"] + 1)
    assert recs[0]["windows_us"]["next->verify"] == 0.0           # K = 1: the alignment's next step is the verify
    if rounds == "1":                                             # ... and with round graphs at every K
        assert all(r["windows_us"]["next->verify"] == 0.0 for r in recs)
    assert "verdict->align" in capsys.readouterr().out
    assert (GraphRunner._body, GraphRunner._run) == real          # the null bodies are gone again


def test_window_split():
    marks = [("target", 0.0), ("verdict", 1.0), ("mtp", 1.5), ("mtp", 3.0), ("mtp", 4.0), ("target", 6.0),
             ("verdict", 10.0), ("mtp", 10.25), ("target", 11.0)]          # the last round has no verdict
    got = engine_host.windows(marks)
    assert got == {"verdict->align": 0.5e6, "align->next": 1.5e6, "next->verify": 3.0e6, "verify->verdict": 4.0e6}


@pytest.mark.parametrize("sampled", ["0", "1"], ids=["separate-steps", "sampled-round-graphs"])
def test_sampled_rounds(tmp_path, monkeypatch, sampled):
    """--temperature: every request sampled (seeded), so the drafts are drawn and the verdict is rejection
    sampling: in the sampled round graph (NINFER_SAMPLED_ROUNDS=1, no next->verify window), else as separate steps
    (the draft steps get their own window again)."""
    monkeypatch.setenv("NINFER_SAMPLED_ROUNDS", sampled)
    out = tmp_path / "h.json"
    assert engine_host.main(["--ks", "3", "--acceptance", "1", "--new-tokens", "17", "--dir", str(tmp_path / "a"),
                             "--out", str(out), "--round-graphs", "1", "--temperature", "0.8"]) == 0
    (r,) = json.loads(out.read_text())
    assert r["temperature"] == 0.8 and r["emitted"] == 17 and r["tokens_per_round"] == 4.0 and r["batch"] == 1
    assert r["sampled_rounds"] is (sampled == "1")
    assert (r["windows_us"]["next->verify"] > 0) is (sampled == "0")


def test_batched_rounds(tmp_path):
    """--batch B: B requests decoded together; a record's round is one engine step of all of them."""
    out = tmp_path / "h.json"
    assert engine_host.main(["--ks", "2", "--acceptance", "1", "--new-tokens", "10", "--dir", str(tmp_path / "a"),
                             "--out", str(out), "--batch", "3", "--temperature", "0.8"]) == 0
    (r,) = json.loads(out.read_text())
    assert r["batch"] == 3 and r["emitted"] == 10 and r["tokens_per_round"] == 3.0 and r["us_round"] > 0
    assert set(r["windows_us"]) == set(engine_host.WINDOWS)


@pytest.mark.parametrize("argv,flag", [(["--ks", "9"], "--ks"), (["--temperature", "-1"], "--temperature")],
                         ids=["ks", "temperature"])
def test_bad_arguments_are_one_line_errors(capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        engine_host.main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.startswith(f"error: {flag}")
