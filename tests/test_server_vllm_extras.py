"""vLLM's extra request fields: include_stop_str_in_output, skip_special_tokens, truncate_prompt_tokens (served),
and the ones this server does not implement (a 400 naming the field unless they hold their no-op value)."""
from __future__ import annotations

import pytest
from test_server import _post
from test_server_tools import ANSWER, script_server


@pytest.fixture(scope="module")
def srv():
    s = script_server()
    yield s
    s[0].close()


def _text(srv, body: dict, stream: bool) -> str:
    r = _post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 200, "stream": stream, **body})
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["text"]
    import json
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "stream"])
def test_include_stop_str_in_output(srv, stream):
    s, _, _ = srv
    assert _text(s, {"stop": ["check"]}, stream) == "I'll "
    assert _text(s, {"stop": ["check"], "include_stop_str_in_output": True}, stream) == "I'll check"


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "stream"])
def test_skip_special_tokens_false_keeps_their_text(srv, stream):
    s, _, tok = srv
    ids = tok.encode(ANSWER)
    assert _text(s, {}, stream) == tok.decode(ids) != ANSWER           # the tool-call tags are special here
    assert _text(s, {"skip_special_tokens": False}, stream) == tok.decode(ids, skip_special_tokens=False) == ANSWER


def test_truncate_prompt_tokens_keeps_the_last_ones(srv):
    s, engine, _ = srv
    prompt = list(range(10, 30))
    r = _post(s, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "truncate_prompt_tokens": 5})
    assert r.json()["usage"]["prompt_tokens"] == 5 and engine.prompts[-1] == prompt[-5:]
    r = _post(s, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "truncate_prompt_tokens": -1})
    assert r.json()["usage"]["prompt_tokens"] == 20 and engine.prompts[-1] == prompt


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("field,value", [
    ("use_beam_search", True), ("prompt_logprobs", -1),
    ("spaces_between_special_tokens", False), ("length_penalty", 2.0),
    ("priority", 1), ("chat_template", "{{ messages }}"), ("truncate_prompt_tokens", 0)])
def test_unimplemented_vllm_fields_are_a_400(srv, field, value):
    s, _, _ = srv
    r = _post(s, "/v1/chat/completions", {**CHAT, field: value})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == field and err["message"].startswith(field), err


def test_their_no_op_values_are_accepted(srv):
    s, _, _ = srv
    noop = {"use_beam_search": False, "bad_words": [], "prompt_logprobs": None,
            "return_tokens_as_token_ids": False, "spaces_between_special_tokens": True, "length_penalty": 1.0,
            "priority": 0, "echo": False, "skip_special_tokens": True, "include_stop_str_in_output": False}
    assert _post(s, "/v1/chat/completions", {**CHAT, **noop}).status_code == 200
    assert _post(s, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "echo": True, **noop}).status_code == 200


def test_include_stop_str_in_output_keeps_a_stop_tokens_text(srv):
    s, _, tok = srv
    ids = tok.encode(ANSWER)
    at = next(i for i, t in enumerate(ids) if i and t not in ids[:i])       # a token's first occurrence
    assert _text(s, {"stop_token_ids": [ids[at]]}, False) == tok.decode(ids[:at])
    assert _text(s, {"stop_token_ids": [ids[at]], "include_stop_str_in_output": True}, False) == \
        tok.decode(ids[:at + 1])


def test_echo_of_a_truncated_prompt_is_its_kept_part(srv):
    s, _, tok = srv
    r = _post(s, "/v1/completions", {"prompt": "one two three four five", "max_tokens": 1, "echo": True,
                                     "truncate_prompt_tokens": 3})
    ids = tok.encode("one two three four five")[-3:]
    assert r.json()["choices"][0]["text"].startswith(tok.decode(ids)) and r.json()["usage"]["prompt_tokens"] == 3


def test_version_needs_no_api_key():
    import importlib.metadata

    from fastapi.testclient import TestClient

    from ninfer_rt.server.app import ServerState, create_app
    client = TestClient(create_app(ServerState(model_id="m", api_key="k")))
    assert client.get("/version").json() == {"version": importlib.metadata.version("ninfer")}
    assert client.get("/v1/models").status_code == 401


@pytest.mark.parametrize("value,want", [("*", ("*",)), ("https://a, https://b", ("https://a", "https://b")),
                                        ('["https://a", "https://b"]', ("https://a", "https://b")), ("", ()),
                                        ("[]", ())], ids=["any", "commas", "json", "none", "json-none"])
def test_allowed_origins_take_vllms_json_list(value, want):
    from ninfer_rt.cmd_serve import origins
    assert origins(value) == want


def test_chat_template_may_be_the_template_itself(tmp_path):
    from ninfer_rt.tokenizer import TokenizerError, read_template
    assert read_template("{{ messages[0].content }}") == ("--chat-template (inline)", "{{ messages[0].content }}")
    (tmp_path / "t.jinja").write_text("{{ x }}")
    assert read_template(str(tmp_path / "t.jinja")) == (f"--chat-template {tmp_path / 't.jinja'}", "{{ x }}")
    with pytest.raises(TokenizerError, match=r"^--chat-template \(inline\): "):
        read_template("{% for m in messages %}")


def test_skip_special_tokens_false_reaches_the_reasoning_text():
    s, _, tok = script_server("Look <tool_call> here")
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}
        default = _post(s, "/v1/chat/completions", body).json()["choices"][0]["message"]["reasoning_content"]
        kept = _post(s, "/v1/chat/completions", {**body, "skip_special_tokens": False}).json()
        assert default == tok.decode(tok.encode("Look <tool_call> here")) != "Look <tool_call> here"
        assert kept["choices"][0]["message"]["reasoning_content"] == "Look <tool_call> here"
    finally:
        s.close()


def _chat_content(srv, body: dict, stream: bool) -> str:
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": stream,
            "chat_template_kwargs": {"enable_thinking": False}}
    r = _post(srv, "/v1/chat/completions", {**base, **body})
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["message"]["content"]
    import json
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])


PREFILL = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure: "}]


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "stream"])
@pytest.mark.parametrize("body,head", [
    ({"messages": PREFILL, "continue_final_message": True, "add_generation_prompt": False}, "Sure: "),
    ({"add_generation_prompt": False}, "hi"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
      "add_generation_prompt": False}, "a\nb"),
    ({}, ""),
], ids=["assistant-prefill", "own-role", "text-parts", "other-role"])
def test_chat_echo_repeats_the_final_message_of_the_replys_role(srv, stream, body, head):
    """vLLM's chat echo: the reply's content starts with the final message when that message has the reply's
    role (the assistant; the final message's own role without a generation prompt)."""
    s, _, _ = srv
    plain = _chat_content(s, body, stream)
    assert _chat_content(s, {**body, "echo": True}, stream) == head + plain


def test_ignored_fields_are_said_once_on_stderr(capsys):
    """As vLLM logs them: fields this server does not read, once per name (a client may send them every time)."""
    from ninfer_rt.server import protocol as P
    body = {"messages": [{"role": "user", "content": "hi"}], "zz_unknown_a": 1, "zz_unknown_b": {}, "max_tokens": 2}
    P.parse(P.ChatRequest, body)
    P.parse(P.ChatRequest, body)
    err = capsys.readouterr().err
    assert err.count("request fields ignored") == 1 and "ChatRequest" in err
    assert "zz_unknown_a, zz_unknown_b" in err and "max_tokens" not in err and "messages" not in err
