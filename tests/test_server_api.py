"""The OpenAI API surface as a vLLM / llama-server client sees it, byte for byte over raw HTTP.

Runs on the deterministic `FakeEngine` server of tests/test_server.py: these tests check the shape of
bodies, chunks and error replies, not the model's tokens.
"""
from __future__ import annotations

import json

import httpx
import pytest

from test_server import CHAT, MODEL_ID, _post, fake  # noqa: F401  (fake: the fixture)

COMPLETION = {"model": MODEL_ID, "prompt": "hello", "max_tokens": 4}
ROUTES = [("chat", "/v1/chat/completions", CHAT, "chat.completion", "chatcmpl-"),
          ("completion", "/v1/completions", COMPLETION, "text_completion", "cmpl-")]


def _sse(r: httpx.Response) -> list:
    """The `data:` payloads of an SSE reply; the last one must be the literal [DONE]."""
    lines = [ln[len("data: "):] for ln in r.text.split("\n\n") if ln.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", r.text
    return [json.loads(x) for x in lines[:-1]]


def _check_head(body: dict, obj: str, prefix: str) -> None:
    assert body["object"] == obj and body["id"].startswith(prefix) and body["model"] == MODEL_ID
    assert isinstance(body["created"], int) and body["created"] > 1_600_000_000
    assert body["system_fingerprint"].startswith("fp_")


@pytest.mark.parametrize("path,body,obj,prefix", [r[1:] for r in ROUTES], ids=[r[0] for r in ROUTES])
def test_blocking_reply_fields(fake, path, body, obj, prefix):
    srv, _, _ = fake
    r = _post(srv, path, body)
    assert r.status_code == 200, r.text
    b = r.json()
    _check_head(b, obj, prefix)
    (choice,) = b["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    u = b["usage"]
    assert u["completion_tokens"] == 4 and u["total_tokens"] == u["prompt_tokens"] + 4 and u["prompt_tokens"] > 0
    fp = _post(srv, path, body).json()["system_fingerprint"]
    assert fp == b["system_fingerprint"]                   # one server, one fingerprint


@pytest.mark.parametrize("usage", [False, True], ids=["no-usage", "include-usage"])
@pytest.mark.parametrize("path,body,obj,prefix", [r[1:] for r in ROUTES], ids=[r[0] for r in ROUTES])
def test_stream_chunk_fields_and_usage_only_when_asked(fake, path, body, obj, prefix, usage):
    srv, _, _ = fake
    req = {**body, "stream": True, **({"stream_options": {"include_usage": True}} if usage else {})}
    chunks = _sse(_post(srv, path, req))
    obj = obj + ".chunk" if obj == "chat.completion" else obj
    assert len({(c["id"], c["created"], c["system_fingerprint"]) for c in chunks}) == 1
    for c in chunks:
        _check_head(c, obj, prefix)
    if usage:        # OpenAI: every chunk has "usage": null but the extra last one (empty choices)
        *rest, last = chunks
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
        assert all("usage" in c and c["usage"] is None for c in rest)
    else:
        rest = chunks
        assert not any("usage" in c for c in chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in rest]
    assert finishes[-1] == "length" and not any(finishes[:-1])


def test_stream_options_without_stream_is_400(fake):
    srv, _, _ = fake
    r = _post(srv, "/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "stream_options: only allowed when stream is true",
                                 "type": "invalid_request_error", "param": "stream_options", "code": None}


def test_models_list_and_card(fake):
    srv, _, _ = fake
    listing = httpx.get(srv.url + "/v1/models").json()
    assert listing["object"] == "list"
    (card,) = listing["data"]
    assert card["id"] == MODEL_ID and card["object"] == "model" and card["owned_by"] == "ninfer"
    assert isinstance(card["created"], int) and card["max_model_len"] == 96
    assert httpx.get(srv.url + f"/v1/models/{MODEL_ID}").json() == card
    r = httpx.get(srv.url + "/v1/models/gpt-9")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_served_model_aliases(fake):
    """vLLM's several --served-model-name values: each is listed and accepted on every endpoint; replies carry the
    first; any other name is a 404 naming them all."""
    srv, _, _ = fake
    srv.state.aliases = ("alias",)
    assert [c["id"] for c in httpx.get(srv.url + "/v1/models").json()["data"]] == [MODEL_ID, "alias"]
    assert httpx.get(srv.url + "/v1/models/alias").json()["id"] == "alias"
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 16})):
        r = _post(srv, path, {**body, "model": "alias"})
        assert r.status_code == 200 and r.json()["model"] == MODEL_ID, (path, r.text)
    r = _post(srv, "/v1/chat/completions", {**CHAT, "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["message"] == (
        f"model 'other' does not exist (this server serves '{MODEL_ID}', 'alias')")


def test_version_is_the_installed_package(fake):
    import importlib.metadata
    srv, _, _ = fake
    assert httpx.get(srv.url + "/version").json() == {"version": importlib.metadata.version("ninfer")}


@pytest.mark.parametrize("method,path,status,code,allow", [
    ("GET", "/nowhere", 404, "not_found", None),
    ("POST", "/v1/chat", 404, "not_found", None),
    ("GET", "/v1/chat/completions", 405, "method_not_allowed", "POST"),
    ("DELETE", "/v1/completions", 405, "method_not_allowed", "POST"),
    ("POST", "/v1/models", 405, "method_not_allowed", "GET"),
], ids=["get-unknown", "post-unknown", "get-chat", "delete-completions", "post-models"])
def test_unknown_routes_and_wrong_methods_are_json(fake, method, path, status, code, allow):
    srv, _, _ = fake
    r = httpx.request(method, srv.url + path)
    assert r.status_code == status and r.headers["content-type"] == "application/json"
    assert r.json()["error"] == {"message": f"{method} {path}: {'Not Found' if status == 404 else 'Method Not Allowed'}",
                                 "type": "invalid_request_error", "param": None, "code": code}
    assert r.headers.get("allow") == allow


@pytest.mark.parametrize("origins", [("*",), ("https://ui.example",), ()], ids=["any", "one", "none"])
def test_cors_preflight_passes_before_the_api_key(origins):
    from fastapi.testclient import TestClient

    from ninfer_rt.server.app import ServerState, create_app
    client = TestClient(create_app(ServerState(model_id=MODEL_ID, api_key="k", allowed_origins=origins)))
    pre = client.options("/v1/chat/completions", headers={"Origin": "https://ui.example",
                                                          "Access-Control-Request-Method": "POST",
                                                          "Access-Control-Request-Headers": "authorization"})
    got = client.get("/v1/models", headers={"Origin": "https://ui.example", "Authorization": "Bearer k"})
    assert got.status_code == 200
    if origins:
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] in ("*", "https://ui.example")
        assert got.headers["access-control-allow-origin"] in ("*", "https://ui.example")
        other = client.options("/v1/models", headers={"Origin": "https://evil.example",
                                                      "Access-Control-Request-Method": "GET"})
        assert (other.status_code == 200) == (origins == ("*",))
    else:
        assert pre.status_code == 401 and "access-control-allow-origin" not in got.headers
    assert client.get("/v1/models", headers={"Origin": "https://ui.example"}).status_code == 401   # still guarded


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_continuous_usage_stats_count_each_choice_so_far(fake, chat):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk of a choice carries its
    counts so far; the last chunk the totals of all choices."""
    srv, _, _ = fake
    path, body = ("/v1/chat/completions", {**CHAT, "max_tokens": 5}) if chat else \
        ("/v1/completions", {"model": MODEL_ID, "prompt": "hello", "max_tokens": 5})
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _sse(_post(srv, path, {**body, "n": 2, "stream": True, "stream_options": opts}))
    *rest, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    prompt = last["usage"]["prompt_tokens"]
    for i in (0, 1):
        mine = [c for c in rest if c["choices"][0]["index"] == i]
        counts = [c["usage"]["completion_tokens"] for c in mine]
        assert all(c["usage"]["prompt_tokens"] == prompt for c in mine)
        assert all(c["usage"]["total_tokens"] == prompt + n for c, n in zip(mine, counts))
        assert counts == sorted(counts) and counts[-1] == 5 and mine[-1]["choices"][0]["finish_reason"] == "length"
    plain = _sse(_post(srv, path, {**body, "stream": True, "stream_options": {"continuous_usage_stats": True}}))
    assert not any("usage" in c for c in plain)          # without include_usage: nothing, as in vLLM
