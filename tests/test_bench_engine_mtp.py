"""bench/engine_mtp.py on CPU: the tiny synthetic artifact through the real Engine with rigged verdicts (acceptance
0 and 1 at their exact token counts, every run emits --new-tokens), its records, and one-line argument errors."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))     # last: bench/ must not shadow anything
import engine_mtp  # noqa: E402

KEYS = {"kind", "recipe", "tp", "gpu", "draft_head", "draft_tokens", "acceptance", "tok_s", "tokens_per_round",
        "rounds", "ms_round", "accepted", "drafted", "prompt_tokens", "new_tokens", "emitted", "backend", "graphs",
        "draft_chain", "batch", "round_graphs", "temperature", "top_k", "top_p", "presence_penalty",
        "topk_kernel"}

pytestmark = pytest.mark.usefixtures("one_thread")


def keys(r: dict) -> set:
    """The fields of a record: K > 0 runs also count their round graphs and hash their tokens."""
    return KEYS | {"graph_rounds", "sampled_rounds", "tokens_digest"} if r["draft_tokens"] else KEYS


@pytest.mark.parametrize("chain", ["1", "0"], ids=["chained", "read-back"])
def test_cpu_dry_run(tmp_path, capsys, monkeypatch, chain):
    monkeypatch.delenv("NINFER_DRAFT_HEAD", raising=False)
    monkeypatch.setenv("NINFER_DRAFT_CHAIN", chain)
    out = tmp_path / "r.json"
    rc = engine_mtp.main(["--tiny", "--device", "cpu", "--prompt-len", "9", "--new-tokens", "13", "--ks", "2",
                          "--acceptance", "0,1", "--draft-heads", "lm_head,nvfp4:512", "--dir", str(tmp_path / "a"),
                          "--out", str(out)])
    assert rc == 0
    recs = json.loads(out.read_text())
    assert [(r["draft_head"], r["draft_tokens"], r["acceptance"]) for r in recs] == [
        ("lm_head", 0, None), ("lm_head", 2, 0.0), ("lm_head", 2, 1.0),
        ("nvfp4:512", 0, None), ("nvfp4:512", 2, 0.0), ("nvfp4:512", 2, 1.0)]
    for r in recs:
        assert set(r) == keys(r)
        assert r["kind"] == "engine_mtp" and r["emitted"] == 13 and r["tok_s"] > 0
        assert r["backend"] == "torch" and not r["graphs"] and r["draft_chain"] == (chain == "1") and r["batch"] == 1
        assert r["topk_kernel"] is False
    for r in recs[1::3]:                         # every draft wrong: one token per round
        assert r["accepted"] == 0 and r["tokens_per_round"] == 1.0 and r["rounds"] <= r["drafted"] <= 2 * r["rounds"]
    for r in recs[2::3]:                         # every draft right: 12 tokens after the first in rounds of 3
        assert r["accepted"] == r["drafted"] == 8 and r["rounds"] == 4 and r["tokens_per_round"] == 3.0
    assert "emitted" in capsys.readouterr().out
    assert "NINFER_DRAFT_HEAD" not in __import__("os").environ


def test_round_graphs_values_run_each_k_once_per_value(tmp_path, monkeypatch):
    """--round-graphs 0,1: each K once per NINFER_ROUND_GRAPHS value, the variable restored after; on the CPU there
    are no graphs, so no record claims round graphs."""
    monkeypatch.setenv("NINFER_ROUND_GRAPHS", "1")
    seen = []
    real = engine_mtp._rounds

    def spy(loaded, args, k, prompt, base, save):
        seen.append((k, __import__("os").environ["NINFER_ROUND_GRAPHS"]))
        return real(loaded, args, k, prompt, base, save)
    monkeypatch.setattr(engine_mtp, "_rounds", spy)
    out = tmp_path / "r.json"
    rc = engine_mtp.main(["--tiny", "--device", "cpu", "--prompt-len", "9", "--new-tokens", "5", "--ks", "1,2",
                          "--acceptance", "1", "--draft-heads", "lm_head", "--round-graphs", "0,1",
                          "--dir", str(tmp_path / "a"), "--out", str(out)])
    assert rc == 0 and seen == [(1, "0"), (1, "1"), (2, "0"), (2, "1")]
    recs = json.loads(out.read_text())
    assert [r["draft_tokens"] for r in recs] == [0, 1, 1, 2, 2] and not any(r["round_graphs"] for r in recs)
    assert __import__("os").environ["NINFER_ROUND_GRAPHS"] == "1"
    monkeypatch.setenv("NINFER_ROUND_GRAPHS", "0")
    assert engine_mtp.round_graphs_on() is False
    monkeypatch.delenv("NINFER_ROUND_GRAPHS")
    assert engine_mtp.round_graphs_on() is True                    # the runtime's default


def test_sampled_requests(tmp_path):
    """--temperature: every request sampled (seeded), drafts chained on the device (TP1); the rig still sets the
    accepted count, and every request emits --new-tokens."""
    out = tmp_path / "r.json"
    rc = engine_mtp.main(["--tiny", "--device", "cpu", "--prompt-len", "9", "--new-tokens", "13", "--ks", "2",
                          "--acceptance", "0.5,1", "--draft-heads", "lm_head", "--temperature", "0.8", "--batch", "2",
                          "--dir", str(tmp_path / "a"), "--out", str(out)])
    assert rc == 0
    recs = json.loads(out.read_text())
    assert all(r["temperature"] == 0.8 and r["emitted"] == 13 for r in recs)
    assert recs[2]["accepted"] == recs[2]["drafted"] > 0 and 0 < recs[1]["accepted"] < recs[1]["drafted"]
    with pytest.raises(SystemExit):
        engine_mtp.parse_args(["--temperature", "-1"])


def test_sampled_requests_with_truncation(tmp_path, capsys):
    """--top-k / --top-p / --presence-penalty: the sampled requests truncate and penalize (the chat defaults of
    Qwen's generation_config, NInfer's presets); they need --temperature."""
    from ninfer_rt.sampling import SamplingParams
    out = tmp_path / "r.json"
    seen = []
    real = engine_mtp.request_params
    engine_mtp.request_params = lambda eng, n, b: seen.append(real(eng, n, b)) or seen[-1]
    try:
        rc = engine_mtp.main(["--tiny", "--device", "cpu", "--prompt-len", "9", "--new-tokens", "9", "--ks", "2",
                              "--acceptance", "1", "--draft-heads", "lm_head", "--temperature", "0.6", "--top-k",
                              "20", "--top-p", "0.95", "--presence-penalty", "1.5", "--dir", str(tmp_path / "a"),
                              "--out", str(out)])
    finally:
        engine_mtp.request_params = real
    assert rc == 0
    assert all((r["top_k"], r["top_p"], r["presence_penalty"]) == (20, 0.95, 1.5) for r in json.loads(out.read_text()))
    assert seen and all(isinstance(p, SamplingParams) and (p.top_k, p.top_p, p.presence_penalty) == (20, 0.95, 1.5)
                        for p in seen)
    for argv in (["--top-k", "5"], ["--temperature", "1", "--top-p", "0"], ["--temperature", "1", "--top-k", "-2"],
                 ["--presence-penalty", "1"], ["--temperature", "1", "--presence-penalty", "3"]):
        with pytest.raises(SystemExit):
            engine_mtp.parse_args(argv)
    assert "--top-k / --top-p" in capsys.readouterr().err


def test_plain_decoding_alone(tmp_path):
    """--ks 0: only the K = 0 record (plain decoding), e.g. a sampled batch's decode step without MTP rounds."""
    out = tmp_path / "r.json"
    rc = engine_mtp.main(["--tiny", "--device", "cpu", "--prompt-len", "9", "--new-tokens", "7", "--ks", "0",
                          "--draft-heads", "lm_head", "--temperature", "0.8", "--batch", "2",
                          "--dir", str(tmp_path / "a"), "--out", str(out)])
    assert rc == 0
    recs = json.loads(out.read_text())
    assert [(r["draft_tokens"], r["batch"], r["temperature"]) for r in recs] == [(0, 2, 0.8)]
    assert set(recs[0]) == KEYS and recs[0]["emitted"] == 7


def test_batch_runs_requests_together(tmp_path):
    """--batch 3: three requests of one prompt, each with its own acceptance draws; every one emits --new-tokens,
    tok_s counts all three, and at acceptance 1 each step is one round per request (3 tokens each)."""
    out = tmp_path / "r.json"
    rc = engine_mtp.main(["--tiny", "--device", "cpu", "--prompt-len", "9", "--new-tokens", "13", "--ks", "2",
                          "--acceptance", "0.5,1", "--draft-heads", "lm_head", "--batch", "3",
                          "--dir", str(tmp_path / "a"), "--out", str(out)])
    assert rc == 0
    recs = json.loads(out.read_text())
    assert [(r["draft_tokens"], r["acceptance"]) for r in recs] == [(0, None), (2, 0.5), (2, 1.0)]
    for r in recs:
        assert set(r) == keys(r) and r["batch"] == 3 and r["emitted"] == 13 and r["tok_s"] > 0
    assert 0 < recs[1]["accepted"] < recs[1]["drafted"]
    assert recs[2]["rounds"] == 3 * 4 and recs[2]["accepted"] == recs[2]["drafted"] == 3 * 8


def test_profiled_run_writes_a_trace(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NINFER_DRAFT_HEAD", "lm_head")
    out = tmp_path / "r.json"
    rc = engine_mtp.main(["--tiny", "--device", "cpu", "--prompt-len", "9", "--new-tokens", "6", "--ks", "2",
                          "--acceptance", "0.5", "--draft-heads", "nvfp4:512", "--profile-tokens", "5",
                          "--dir", str(tmp_path / "a"), "--out", str(out)])
    assert rc == 0
    trace = tmp_path / "r_trace_nvfp4-512_K2.json.gz"
    recs = json.loads(out.read_text())
    assert trace.stat().st_size > 0 and len(recs) == 2 and "profile" not in recs[0]
    prof = recs[1]["profile"]                  # the prompt step left out; no CUDA kernels on the CPU
    assert prof["rounds"] >= 1 and prof["ms_round_wall"] > 0 and prof["busy_us_round"] == 0 and prof["idle_top"] == []
    err = capsys.readouterr().err
    assert "profile nvfp4:512: K=2 a=0.5: 5 tokens" in err and "Self CPU" in err and f"trace: {trace}" in err


def test_sync_audit_adds_its_fields(tmp_path, monkeypatch):
    """--sync-audit: the K's first-acceptance record gains syncs_per_step and sync_sites (on CPU there is nothing to
    audit: None and {}; tests/test_engine_graphs.py counts them on a GPU)."""
    monkeypatch.setenv("NINFER_DRAFT_HEAD", "lm_head")
    out = tmp_path / "r.json"
    rc = engine_mtp.main(["--tiny", "--device", "cpu", "--prompt-len", "9", "--new-tokens", "6", "--ks", "2",
                          "--acceptance", "0.5,1", "--draft-heads", "lm_head", "--sync-audit",
                          "--dir", str(tmp_path / "a"), "--out", str(out)])
    assert rc == 0
    recs = json.loads(out.read_text())
    assert set(recs[0]) == KEYS and set(recs[2]) == keys(recs[2])     # K = 0 and the second acceptance: no audit
    assert set(recs[1]) == keys(recs[1]) | {"syncs_per_step", "sync_sites"}
    assert recs[1]["syncs_per_step"] is None and recs[1]["sync_sites"] == {}


@pytest.mark.parametrize("args,message", [
    (["--ks", "0,2"], "--ks: expected 0 (plain decoding alone) or comma-separated integers in 1..7"),
    (["--ks", "8"], "--ks: expected 0 (plain decoding alone) or comma-separated integers in 1..7"),
    (["--acceptance", "1.5"], "--acceptance: expected comma-separated numbers in [0, 1]"),
    (["--acceptance", "x"], "--acceptance: expected comma-separated numbers in [0, 1]"),
    (["--draft-heads", "q4"], "--draft-heads='q4': expected auto, lm_head, nvfp4 or nvfp4:N"),
    (["--profile-tokens", "-1"], "--profile-tokens: expected 0 (off) or a number of tokens, got -1"),
    (["--batch", "0"], "argument --batch: expected a positive integer, got '0'"),
    (["--round-graphs", "0,2"], "--round-graphs: expected comma-separated 0 / 1 values, got '0,2'"),
], ids=["k0-with-others", "k8", "acceptance-range", "acceptance-text", "draft-head", "profile-tokens", "batch", "round-graphs"])
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        rc = engine_mtp.main(["--tiny", "--device", "cpu", "--dir", str(tmp_path), *args])
        raise SystemExit(rc)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error: ") and message in err and "\n" not in err
    assert not (tmp_path / "nvfp4-tp1").exists()                          # refused before any build


def test_timed_records_are_written_before_the_profile(tmp_path, monkeypatch):
    """A call killed during the (slow) profile keeps every K it timed: the records are on disk before it starts."""
    monkeypatch.setenv("NINFER_DRAFT_HEAD", "lm_head")
    out = tmp_path / "r.json"

    def killed(*a, **kw):
        raise KeyboardInterrupt                 # what the call's timeout does to the profile
    monkeypatch.setattr(engine_mtp, "profile_run", killed)
    with pytest.raises(KeyboardInterrupt):
        engine_mtp.main(["--tiny", "--device", "cpu", "--prompt-len", "9", "--new-tokens", "6", "--ks", "2",
                         "--acceptance", "0.5,1", "--draft-heads", "lm_head,nvfp4:512", "--profile-tokens", "5",
                         "--dir", str(tmp_path / "a"), "--out", str(out)])
    recs = json.loads(out.read_text())
    assert [(r["draft_head"], r["draft_tokens"], r["acceptance"]) for r in recs] == [
        ("lm_head", 0, None), ("lm_head", 2, 0.5), ("lm_head", 2, 1.0)]
