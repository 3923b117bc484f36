"""The server's prefix cache (on by default, vLLM's --enable-prefix-caching): a repeated prompt resumes from the
cached state and answers as the first time; usage reports the cached tokens (OpenAI's prompt_tokens_details,
the Responses API's input_tokens_details), /metrics counts queries and hits; the flags reach the runtime."""
from __future__ import annotations

import pytest
from test_serve_cli import parsed
from test_server import MODEL_ID, _post, metric, real_srv  # noqa: F401

PROMPT = "The quick brown fox jumps over the lazy dog; " * 3


def test_a_repeated_prompt_resumes_and_answers_alike(real_srv):  # noqa: F811
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    hits0 = metric(real_srv, "ninfer_prefix_cache_hits_total")
    first = _post(real_srv, "/v1/completions", body).json()
    again = _post(real_srv, "/v1/completions", body).json()
    n = first["usage"]["prompt_tokens"]
    cut = (n - 1) // 16 * 16                                  # the last page boundary before the final token
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": cut} and cut > 0
    assert metric(real_srv, "ninfer_prefix_cache_hits_total") - hits0 >= cut
    assert metric(real_srv, "ninfer_prefix_cache_queries_total") >= 2 * n


def test_responses_usage_counts_cached_tokens(real_srv):  # noqa: F811
    body = {"model": MODEL_ID, "input": PROMPT + "Why?", "max_output_tokens": 16, "temperature": 0,
            "reasoning": {"effort": "none"}}
    _post(real_srv, "/v1/responses", body)
    use = _post(real_srv, "/v1/responses", body).json()["usage"]
    assert use["input_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize("flags,entries", [([], 16), (["--prefix-cache-entries", "3"], 3),
                                           (["--no-enable-prefix-caching"], 0)], ids=["default", "entries", "off"])
def test_prefix_cache_flags(monkeypatch, flags, entries):
    assert parsed(monkeypatch, ["art", *flags]).runtime.prefix_cache == entries


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "stream"])
def test_messages_usage_counts_cache_reads(real_srv, stream):  # noqa: F811
    """Anthropic's usage: input_tokens are the prompt tokens not read from the cache, cache_read_input_tokens the
    rest; a stream's message_start (sent once the prompt is admitted) and message_delta both carry them."""
    import anthropic
    client = anthropic.Anthropic(base_url=real_srv.url, api_key="none")
    kw = dict(model=MODEL_ID, max_tokens=6, messages=[{"role": "user", "content": PROMPT + "Messages?"}])
    client.messages.create(**kw)
    if stream:
        with client.messages.stream(**kw) as s:
            start = next(e for e in s if e.type == "message_start").message.usage
            use = s.get_final_message().usage
        assert (start.input_tokens, start.cache_read_input_tokens) == (use.input_tokens, use.cache_read_input_tokens)
    else:
        use = client.messages.create(**kw).usage
    assert use.cache_read_input_tokens > 0 and use.input_tokens > 0
    n = client.messages.count_tokens(model=MODEL_ID, messages=kw["messages"]).input_tokens
    assert use.input_tokens + use.cache_read_input_tokens == n


def test_reset_prefix_cache_endpoint(real_srv):  # noqa: F811
    body = {"model": MODEL_ID, "prompt": PROMPT + "reset", "max_tokens": 2, "temperature": 0}
    _post(real_srv, "/v1/completions", body)
    r = _post(real_srv, "/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {}
    assert "prompt_tokens_details" not in _post(real_srv, "/v1/completions", body).json()["usage"]


def test_reset_without_a_prefix_cache_is_a_400():
    from test_server import fake_server
    srv, _, _ = fake_server()
    try:
        r = _post(srv, "/reset_prefix_cache")
        assert r.status_code == 400 and "prefix cache is off" in r.json()["error"]["message"]
    finally:
        srv.close()


def test_auto_kv_size_leaves_room_for_the_cached_states(monkeypatch):
    """Each entry's GDN state copy is one sequence slot's bytes: `--kv-capacity auto` takes them off the pool."""
    import dataclasses
    import sys
    from pathlib import Path

    import torch
    sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))     # last: bench/ must not shadow anything
    import synth_artifact as synth

    from ninfer_rt.server.runtime import RuntimeOptions, auto_kv_tokens, gdn_bytes_per_slot, kv_bytes_per_token
    cfg = synth.TINY.config()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 << 30, 16 << 30))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    opts = RuntimeOptions(artifact="x", device="cuda", dtype="bfloat16", prefix_cache=0)
    off = auto_kv_tokens(cfg, opts, torch.device("cuda"))
    on = auto_kv_tokens(cfg, dataclasses.replace(opts, prefix_cache=16), torch.device("cuda"))
    per = kv_bytes_per_token(cfg, 1, torch.bfloat16)
    assert off - on in (16 * gdn_bytes_per_slot(cfg, 1) // per, 16 * gdn_bytes_per_slot(cfg, 1) // per + 1)

