"""bench/serve_tp_check.py on CPU: `ninfer-rt serve --tp 2` over gloo on the shipped tiny model (packed by the
real packer at TP2) answers a chat and a text completion with the OpenAI shape; a deadline that passes while
loading fails the check and leaves no server process behind; the reply checks on made-up bodies."""
from __future__ import annotations

import json
import os
import sys
import time

import pytest
from tiny_util import pack_tiny

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import serve_tp_check as stc

MAX_TOKENS = 16
FIELDS = ("tp", "ok", "http_status", "completion_tokens", "latency_s", "load_s", "gpu")


@pytest.fixture(scope="module")
def tiny_tp2(tmp_path_factory):
    return pack_tiny(tmp_path_factory.mktemp("serve-tp") / "tiny-tp2", tp=2)


def _group_gone(pgid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def started(monkeypatch):
    """The server processes the check starts, to see that their process groups are gone afterwards."""
    procs, real_start = [], stc.start
    monkeypatch.setattr(stc, "start", lambda *a: procs.append(real_start(*a)) or procs[-1])
    return procs


def test_tp2_server_answers(tiny_tp2, tmp_path, capsys, started):
    out = tmp_path / "check.json"
    rc = stc.main(["--artifact", tiny_tp2, "--tp", "2", "--device", "cpu", "--timeout-s", "120",
                   "--max-tokens", str(MAX_TOKENS), "--out", str(out), "--", "--max-concurrency", "2"])
    rec = json.loads(out.read_text())
    assert rc == 0, rec
    assert all(k in rec for k in FIELDS)
    assert rec["ok"] and rec["tp"] == 2 and rec["http_status"] == 200 and rec["problems"] == []
    assert 1 <= rec["completion_tokens"] <= MAX_TOKENS and rec["gpu"].startswith("cpu")
    assert 0 < rec["load_s"] < 120 and 0 < rec["latency_s"] < 120 and rec["server_exit_code"] == 0
    for kind in ("chat", "completion"):
        assert isinstance(rec[kind]["text"], str) and rec[kind]["finish_reason"] in stc.FINISH
    assert capsys.readouterr().out.startswith("serve --tp 2: OK")
    assert _group_gone(started[0].pid)


def test_deadline_while_loading_fails_and_cleans_up(tiny_tp2, tmp_path, started):
    out = tmp_path / "check.json"
    rc = stc.main(["--artifact", tiny_tp2, "--tp", "2", "--device", "cpu", "--timeout-s", "0.3", "--out", str(out)])
    rec = json.loads(out.read_text())
    assert rc == 1 and not rec["ok"] and rec["http_status"] is None
    assert any("deadline" in p for p in rec["problems"]), rec["problems"]
    assert _group_gone(started[0].pid)


@pytest.mark.parametrize("argv,needle", [
    (["--artifact", "/definitely/not/here"], "no such file or folder"),
    (["--artifact", ".", "--tp", "0"], "--tp 0"),
    (["--artifact", ".", "--max-tokens", "0"], "--max-tokens"),
    (["--artifact", ".", "--tp", "two"], "argument --tp: invalid int value"),
    (["--tp", "2"], "the following arguments are required: --artifact"),
], ids=["missing-artifact", "tp-zero", "no-tokens", "tp-not-int", "no-artifact"])
def test_bad_arguments_are_one_line_errors(argv, needle, capsys):
    try:
        rc = stc.main(argv)
    except SystemExit as e:             # argparse's own checks exit from parse_args
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and needle in err and err.count("\n") == 1, err


def test_gpu_name_without_cuda_is_a_value_not_a_traceback(monkeypatch):
    """--device cuda where the check sees no GPU: the server fails, the record still gets its gpu field."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert stc.gpu_name("cuda").startswith("cuda (no CUDA device")
    assert stc.gpu_name(None).startswith("cpu (") and stc.gpu_name("cpu").startswith("cpu (")


def _reply(kind, text="hi", finish="length", usage=(5, MAX_TOKENS, 5 + MAX_TOKENS)):
    c = {"index": 0, "finish_reason": finish}
    c.update({"message": {"role": "assistant", "content": text}} if kind == "chat" else {"text": text})
    u = dict(zip(("prompt_tokens", "completion_tokens", "total_tokens"), usage)) if usage else None
    return {"choices": [c], "usage": u}


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("reply,status,needle", [
    ({}, 200, None),
    ({"finish": "stop", "usage": (5, 3, 8)}, 200, None),
    ({"text": None}, 200, "not str"),
    ({"finish": "eos"}, 200, "finish_reason"),
    ({"usage": None}, 200, "usage"),
    ({"usage": (5, MAX_TOKENS, 99)}, 200, "add up"),
    ({"usage": (5, 3, 8)}, 200, "completion tokens"),
    ({"usage": (5, MAX_TOKENS + 1, 6 + MAX_TOKENS), "finish": "stop"}, 200, "completion tokens"),
    ({"body": {"error": {"message": "boom"}}}, 500, "HTTP 500"),
    ({"body": {"choices": []}}, 200, "no choices"),
], ids=["ok-length", "ok-stop", "text-none", "bad-finish", "no-usage", "usage-sum", "length-short",
        "over-max", "http-500", "no-choices"])
def test_check_reply(kind, reply, status, needle):
    body = reply["body"] if "body" in reply else _reply(kind, **reply)
    problems = stc.check_reply(kind, status, body, MAX_TOKENS)
    if needle is None:
        assert problems == []
    else:
        assert len(problems) == 1 and needle in problems[0] and problems[0].startswith(kind), problems
