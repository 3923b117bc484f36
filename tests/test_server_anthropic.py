"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the `anthropic` client against a
scripted engine: content blocks (thinking, text, tool_use) blocking and streamed, stop reasons, usage, the
conversation's mapping onto the chat template, and errors in Anthropic's shape."""
from __future__ import annotations

import base64
import json

import pytest
from test_server import _post
from test_server_tools import ANSWER, CALLS, WEATHER, thinking_srv  # noqa: F401  (the `srv` fixture)

import hf_tiny

THINK, UNTHINK = hf_tiny.SPECIALS["<think>"], hf_tiny.SPECIALS["</think>"]
TOOL = {"name": WEATHER["function"]["name"], "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}
ASK = [{"role": "user", "content": "Weather in Paris and Rome?"}]


def client(srv):
    import anthropic
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)


def _blocks(msg) -> list[dict]:
    """Content blocks without their random ids."""
    return [{k: v for k, v in b.model_dump().items() if k != "id"} for b in msg.content]


WANT = [{"type": "thinking", "thinking": "Two cities.", "signature": ""}, {"type": "text", "text": "I'll check.",
        "citations": None}] + [{"type": "tool_use", "name": n, "input": a, "caller": None} for n, a in CALLS]


def _norm(blocks: list[dict]) -> list[dict]:
    # client versions differ in the optional keys they add (citations, caller): compare the ones the API defines
    keys = {"type", "thinking", "signature", "text", "name", "input"}
    return [{k: v for k, v in b.items() if k in keys} for b in blocks]


def test_blocking_message_with_thinking_text_and_tool_use(srv):
    s, engine, _ = srv
    m = client(s).messages.create(model=s.state.model_id, max_tokens=512, messages=ASK, tools=[TOOL])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert _norm(_blocks(m)) == _norm(WANT) and m.stop_reason == "tool_use" and m.stop_sequence is None
    assert all(b.id.startswith("toolu_") for b in m.content if b.type == "tool_use")
    assert m.usage.input_tokens == len(engine.prompts[-1]) and m.usage.output_tokens == len(engine.script)


def test_stream_builds_the_same_message(srv):
    s, _, _ = srv
    with client(s).messages.stream(model=s.state.model_id, max_tokens=512, messages=ASK, tools=[TOOL]) as st:
        kinds = [e.type for e in st]
        m = st.get_final_message()
    assert _norm(_blocks(m)) == _norm(WANT) and m.stop_reason == "tool_use"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == len(WANT)


def test_without_tools_the_calls_are_text_and_the_turn_ends(srv):
    s, engine, tok = srv
    m = client(s).messages.create(model=s.state.model_id, max_tokens=512, messages=ASK)
    assert m.stop_reason == "end_turn" and [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[1].text == tok.decode(tok.encode(ANSWER))       # the tags are special: dropped as usual


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "stream"])
def test_stop_sequence_and_max_tokens(srv, stream):
    s, _, _ = srv
    c = client(s)

    def run(**kw):
        if not stream:
            return c.messages.create(model=s.state.model_id, messages=ASK, **kw)
        with c.messages.stream(model=s.state.model_id, messages=ASK, **kw) as st:
            return st.get_final_message()
    m = run(max_tokens=512, stop_sequences=["zzz", "check"])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "check") and m.content[-1].text == "I'll "
    m = run(max_tokens=5)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 5 and m.content[0].type == "thinking"


def test_conversation_maps_onto_the_chat_template(srv):
    s, engine, tok = srv
    convo = ASK + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "x"},
                                          {"type": "text", "text": "Let me see."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oslo", "days": 2}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "sunny"}]},
                                     {"type": "text", "text": "And tomorrow?"}]}]
    client(s).messages.create(model=s.state.model_id, max_tokens=64, system=[{"type": "text", "text": "Be brief."}],
                              messages=convo, tools=[TOOL])
    prompt = tok.decode(engine.prompts[-1], skip_special_tokens=False)
    assert prompt.startswith("<|im_start|>system\n<tools>get_weather=")
    assert ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
            "<|im_start|>assistant\nLet me see.<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
            "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
            "<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>user\nAnd tomorrow?<|im_end|>\n"
            "<|im_start|>assistant\n") in prompt


def test_count_tokens_is_the_prompt_length(srv):
    s, _, tok = srv
    n = client(s).messages.count_tokens(model=s.state.model_id, messages=ASK, tools=[TOOL]).input_tokens
    r = _post(s, "/tokenize", {"messages": ASK, "tools": [WEATHER]})
    assert n == r.json()["count"] > 0


PNG = base64.b64encode(b"\x89PNG not really").decode()
BAD = {
    "no-max-tokens": ({"messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    "tool-choice-unknown": ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, 400,
                            "invalid_request_error", "tool_choice.name"),
    "tool-choice-any-no-tools": ({"tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tool_choice.type"),
    "tool-use-from-user": ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, 400, "invalid_request_error",
        "messages.0.content.0"),
    "image-needs-vision": ({"system": "s", "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "r"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]}]}, 400,
        "invalid_request_error", "messages.0.content.1.source"),      # its block's name, not the chat message's
    "base64-without-type": ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "data": PNG}}]}]}, 400, "invalid_request_error", "messages.0.content.0.source.media_type"),
    "wrong-model": ({"model": "claude-opus"}, 404, "not_found_error", "model"),
    "bad-input-schema": ({"tools": [TOOL, {"name": "f", "input_schema": {"type": "object", "properties": {"x": 1}}}]},
                         400, "invalid_request_error", "tools.1.input_schema.properties"),
    "bad-tool-name": ({"tools": [{"name": "a b", "input_schema": {"type": "object"}}]}, 400, "invalid_request_error",
                      "tools.0.name"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_errors_have_anthropics_shape(srv, case):
    s, _, _ = srv
    body, status, kind, where = BAD[case]
    r = _post(s, "/v1/messages", {"max_tokens": 16, "messages": ASK, **body}
              if case != "no-max-tokens" else body)
    j = r.json()
    assert r.status_code == status and j["type"] == "error" and j["error"]["type"] == kind, j
    assert j["error"]["message"].startswith(where) and "\n" not in j["error"]["message"]


def test_unknown_messages_route_is_an_anthropic_404(srv):
    s, _, _ = srv
    r = _post(s, "/v1/messages/nope", {})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert json.loads(_post(s, "/v1/nope", {}).content)["error"]["code"] == "not_found"    # OpenAI's elsewhere


@pytest.mark.parametrize("thinking,on", [(None, False), ({"type": "disabled"}, False),
                                         ({"type": "enabled", "budget_tokens": 1024}, True),
                                         ({"type": "adaptive"}, True)], ids=["absent", "disabled", "enabled", "adaptive"])
def test_thinking_maps_onto_the_template_switch(thinking, on):
    from ninfer_rt.server import anthropic_api as A
    body = {"max_tokens": 8, "messages": ASK, **({"thinking": thinking} if thinking else {})}
    assert A.to_chat(A.parse(body)).chat_template_kwargs == {"enable_thinking": on}


def test_a_final_assistant_message_is_a_prefill(srv):
    s, engine, tok = srv
    client(s).messages.create(model=s.state.model_id, max_tokens=8, messages=ASK + [
        {"role": "assistant", "content": "Sunny in"}])
    assert tok.decode(engine.prompts[-1], skip_special_tokens=False).endswith("<|im_start|>assistant\nSunny in")
