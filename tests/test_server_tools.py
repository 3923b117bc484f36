"""Tool calling over the API: the request's tools reach the chat template, the answer's Qwen3-Coder XML calls
come back as OpenAI `tool_calls` (blocking and streamed, through the openai client), earlier calls in the
conversation are rendered with their arguments as mappings, and what cannot be honoured is a 400 by name.

The engine is scripted: it answers with fixed text, so the parse is what is tested; the tokenizer marks
`<tool_call>` / `</tool_call>` special (as a tokenizer may), which a plain detokenization would drop."""
from __future__ import annotations

import json

import pytest
from test_server import FakeEngine, _post, fake_server

import hf_tiny
from ninfer_rt.tokenizer import Tokenizer

TOOL_IDS = {"<tool_call>": 256, "</tool_call>": 257}
TEMPLATE = (
    "{%- if tools -%}{{- '<|im_start|>system\\n<tools>' -}}{%- for t in tools -%}"
    "{{- t['function']['name'] + '=' + (t['function']['parameters'] | tojson) + ';' -}}{%- endfor -%}"
    "{{- '</tools><|im_end|>\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + (m['content'] if m['content'] is string else '') -}}"
    "{%- if m.tool_calls is defined -%}{%- for c in m.tool_calls -%}"
    "{{- '<tool_call>\\n<function=' + c['function']['name'] + '>\\n' -}}"
    "{%- for k, v in c['function']['arguments'] | items -%}"
    "{{- '<parameter=' + k + '>\\n' + (v if v is string else v | tojson) + '\\n</parameter>\\n' -}}{%- endfor -%}"
    "{{- '</function>\\n</tool_call>' -}}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                          "required": ["city"]}}}
ANSWER = ("I'll check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
          "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
          "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>")
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Rome"})]
ASK = [{"role": "user", "content": "Weather in Paris and Rome?"}]


def tool_tokenizer() -> Tokenizer:
    tj = json.loads(hf_tiny.tokenizer_json())
    tj["added_tokens"] += [dict(id=i, content=s, single_word=False, lstrip=False, rstrip=False, normalized=False,
                                special=True) for s, i in TOOL_IDS.items()]
    res = {"tokenizer.json": json.dumps(tj), "chat_template.jinja": TEMPLATE,
           "tokenizer_config.json": json.dumps({"eos_token": "<|im_end|>"})}
    return Tokenizer.from_resources(res, eos_token_ids=[hf_tiny.EOS_ID])


class ScriptEngine(FakeEngine):
    """Answers every request with `script` (token ids, ending with <|im_end|>); keeps the prompts it got."""

    def __init__(self, pool, **kw):
        super().__init__(pool, **kw)
        self.script: list[int] = []
        self.prompts: list[list[int]] = []

    def add_request(self, rid, prompt_ids, params) -> None:
        super().add_request(rid, prompt_ids, params)
        self.prompts.append(list(prompt_ids))

    def emit(self, s, n: int):
        done, left = len(s["out"]), s["params"].max_tokens - len(s["out"])
        new = self.script[done:done + min(n, left)]
        stop = next((i for i, t in enumerate(new) if t in s["params"].stop_token_ids), None)
        if stop is not None:                  # as the engine: a stop token ends the output (and is emitted)
            return new[:stop + 1], "stop"
        if done + len(new) >= len(self.script):
            return new, "stop"
        return new, ("length" if len(new) >= left else None)


def script_server(thinking: str | None = None):
    """(server, ScriptEngine, tokenizer) answering every request with ANSWER, after a think block if given."""
    tok = tool_tokenizer()
    srv, engine, _ = fake_server(pages=4096, max_context=4096, engine_cls=ScriptEngine, tok=tok, per_step=3)
    think = [] if thinking is None else \
        [hf_tiny.SPECIALS["<think>"]] + tok.encode(thinking) + [hf_tiny.SPECIALS["</think>"]]
    engine.script = think + tok.encode(ANSWER) + [hf_tiny.IM_END_ID]
    return srv, engine, tok


@pytest.fixture(scope="module", name="srv")
def thinking_srv():
    """A think block ("Two cities."), then ANSWER: the Messages and Responses API tests' server."""
    s = script_server("Two cities.")
    yield s
    s[0].close()


@pytest.fixture(scope="module")
def tools_srv():
    srv, engine, tok = script_server()
    assert TOOL_IDS["<tool_call>"] in engine.script       # the tags are single special tokens here
    yield srv, engine, tok
    srv.close()


def _calls(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


def test_blocking_reply_has_the_calls_and_the_prompt_the_tools(tools_srv):
    srv, engine, tok = tools_srv
    r = srv.client().chat.completions.create(model=srv.state.model_id, messages=ASK, tools=[WEATHER])
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "I'll check."
    assert _calls(c.message.tool_calls) == CALLS
    assert all(t.type == "function" and t.id.startswith("call_") for t in c.message.tool_calls)
    prompt = tok.decode(engine.prompts[-1], skip_special_tokens=False)
    assert "<tools>get_weather=" + json.dumps(WEATHER["function"]["parameters"]) + ";</tools>" in prompt
    assert r.usage.completion_tokens == len(engine.script)


def test_stream_carries_the_same_content_and_calls(tools_srv):
    srv, _, _ = tools_srv
    content, calls, finish = "", {}, None
    for ch in srv.client().chat.completions.create(model=srv.state.model_id, messages=ASK, tools=[WEATHER],
                                                   stream=True):
        d = ch.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or ():
            assert t.index not in calls           # each call arrives whole, once
            calls[t.index] = t
        finish = ch.choices[0].finish_reason or finish
    assert content == "I'll check." and finish == "tool_calls"
    assert _calls([calls[i] for i in sorted(calls)]) == CALLS


def test_parallel_tool_calls_false_and_n_choices(tools_srv):
    srv, _, _ = tools_srv
    r = srv.client().chat.completions.create(model=srv.state.model_id, messages=ASK, tools=[WEATHER], n=2,
                                             parallel_tool_calls=False)
    assert [_calls(c.message.tool_calls) for c in r.choices] == [CALLS[:1]] * 2


def test_tool_choice_none_renders_tools_but_parses_nothing(tools_srv):
    srv, engine, tok = tools_srv
    r = srv.client().chat.completions.create(model=srv.state.model_id, messages=ASK, tools=[WEATHER],
                                             tool_choice="none")
    c = r.choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls
    assert c.message.content == tok.decode(engine.script[:-1])      # the tags are special: dropped as usual
    assert "<tools>get_weather=" in tok.decode(engine.prompts[-1], skip_special_tokens=False)


def test_without_tools_the_answer_is_plain_text(tools_srv):
    srv, engine, tok = tools_srv
    c = srv.client().chat.completions.create(model=srv.state.model_id, messages=ASK).choices[0]
    assert c.finish_reason == "stop" and c.message.tool_calls is None and "<tools>" not in tok.decode(
        engine.prompts[-1], skip_special_tokens=False)


def test_earlier_calls_and_results_are_rendered(tools_srv):
    srv, engine, tok = tools_srv
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    srv.client().chat.completions.create(model=srv.state.model_id, messages=history, tools=[WEATHER])
    prompt = tok.decode(engine.prompts[-1], skip_special_tokens=False)
    assert ("<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
            "</function>\n</tool_call><|im_end|>\n<|im_start|>tool\nsunny<|im_end|>") in prompt


def test_tokenize_renders_tools(tools_srv):
    srv, engine, tok = tools_srv
    r = _post(srv, "/tokenize", {"messages": ASK, "tools": [WEATHER]})
    assert r.status_code == 200 and "<tools>get_weather=" in tok.decode(r.json()["tokens"], skip_special_tokens=False)


BAD = {
    "unknown-choice": ({"tool_choice": "sometimes"}, "tool_choice"),
    "named-unknown": ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
                      "tool_choice.function.name"),
    "required-no-tools": ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    "forced-needs-grammars": ({"tool_choice": "required"}, "tool_choice"),       # this fake engine has none
    "bad-name": ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools.0.function.name"),
    "twice": ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    "not-function": ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools.0.type"),
    "bad-properties": ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": ["a"]}}}]}, "tools.0.function.parameters.properties"),
    "arguments-not-json": ({"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
        "messages.1.tool_calls.0.function.arguments"),
    "user-calls": ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_what_cannot_be_honoured_is_a_400_by_name(tools_srv, case):
    srv, _, _ = tools_srv
    body = {"messages": ASK, "tools": [WEATHER], **BAD[case][0]}
    r = _post(srv, "/v1/chat/completions", body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == BAD[case][1], err
    assert err["message"].startswith(BAD[case][1]) and "\n" not in err["message"]


PREFILL = ASK + [{"role": "assistant", "content": "The answer is"}]


@pytest.mark.parametrize("final", ["The answer is", "", "m_end|>", "\n"], ids=["text", "empty", "tag-like", "newline"])
def test_continue_final_message_ends_the_prompt_inside_it(tools_srv, final):
    srv, engine, tok = tools_srv
    msgs = ASK + [{"role": "assistant", "content": final}]
    r = _post(srv, "/v1/chat/completions", {"messages": msgs, "continue_final_message": True,
                                            "add_generation_prompt": False})
    assert r.status_code == 200, r.json()
    assert tok.decode(engine.prompts[-1], skip_special_tokens=False).endswith("<|im_start|>assistant\n" + final)
    r = _post(srv, "/tokenize", {"messages": msgs, "continue_final_message": True})
    assert r.json()["tokens"] == engine.prompts[-1]


IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": PREFILL, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message"),
    ("/tokenize", {"messages": PREFILL, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message"),
    ("/v1/chat/completions", {"messages": ASK + [{"role": "assistant", "content": [
        {"type": "text", "text": "a"}, IMAGE_PART]}], "continue_final_message": True}, "messages.1.content"),
], ids=["both", "both-tokenize", "final-with-image"])
def test_continue_final_message_errors(tools_srv, path, body, param):
    srv, _, _ = tools_srv
    r = _post(srv, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()
