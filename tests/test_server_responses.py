"""OpenAI's Responses API (`/v1/responses` and its stored responses) through the `openai` client against a scripted
engine: output items (reasoning, message, function calls) blocking and streamed, the event sequence, usage with
reasoning tokens, continuations by previous_response_id, the input's mapping onto the chat template, errors."""
from __future__ import annotations

import json

import httpx
import pytest
from test_server import MODEL_ID, _post, fake_server, real_srv  # noqa: F401
from test_server_tools import CALLS, WEATHER, thinking_srv  # noqa: F401  (the `srv` fixture)

import hf_tiny

THINK, UNTHINK = hf_tiny.SPECIALS["<think>"], hf_tiny.SPECIALS["</think>"]
TOOL = {"type": "function", **WEATHER["function"]}
ASK = "Weather in Paris and Rome?"


def client(srv):
    import openai
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _items(resp) -> list[dict]:
    """Output items without their random ids (call ids kept apart: they are checked to be set)."""
    out = []
    for item in resp.output:
        d = item.model_dump(exclude_none=True)
        out.append({k: v for k, v in d.items() if k not in ("id", "call_id")})
    return out


WANT = [{"type": "reasoning", "summary": [], "status": "completed",
         "content": [{"type": "reasoning_text", "text": "Two cities."}]},
        {"type": "message", "role": "assistant", "status": "completed", "content": [
            {"type": "output_text", "text": "I'll check.", "annotations": [], "logprobs": []}]}] + \
    [{"type": "function_call", "name": n, "arguments": json.dumps(a), "status": "completed"} for n, a in CALLS]


def test_blocking_response_with_reasoning_text_and_calls(srv):
    s, engine, _ = srv
    r = client(s).responses.create(model=s.state.model_id, input=ASK, tools=[TOOL])
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert _items(r) == WANT and r.output_text == "I'll check."
    assert all(i.call_id.startswith("call_") for i in r.output if i.type == "function_call")
    u = r.usage
    assert u.input_tokens == len(engine.prompts[-1]) and u.output_tokens == len(engine.script)
    # <think>, "Two cities.", </think>: the reasoning block's ids, its tags included
    assert u.output_tokens_details.reasoning_tokens == len(s.state.tokenizer.encode("Two cities.")) + 2
    assert u.total_tokens == u.input_tokens + u.output_tokens


def test_stream_events_build_the_same_response(srv):
    s, _, _ = srv
    events = list(client(s).responses.create(model=s.state.model_id, input=ASK, tools=[TOOL], stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    final = events[-1].response
    assert _items(final) == WANT
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == "I'll check." and reasoning == "Two cities."
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert added == ["reasoning", "message", "function_call", "function_call"]
    assert [d.model_dump(exclude_none=True) for d in done] == [i.model_dump(exclude_none=True) for i in final.output]
    args = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert args == [json.dumps(a) for _, a in CALLS]


def test_bodies_and_events_validate_against_the_sdk_types(srv):
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter
    s, _, _ = srv
    for extra in ({}, {"max_output_tokens": 4}):
        Response.model_validate(_post(s, "/v1/responses", {"input": ASK, "tools": [TOOL], **extra}).json())
        r = _post(s, "/v1/responses", {"input": ASK, "tools": [TOOL], "stream": True, **extra})
        events = [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: ")]
        kinds = [line[len("event: "):] for line in r.text.splitlines() if line.startswith("event: ")]
        assert kinds == [e["type"] for e in events]
        for e in events:
            TypeAdapter(ResponseStreamEvent).validate_python(e)


def test_reasoning_cut_by_max_output_tokens_is_incomplete(srv):
    s, _, _ = srv
    blocking = _post(s, "/v1/responses", {"input": ASK, "max_output_tokens": 3}).json()
    r = _post(s, "/v1/responses", {"input": ASK, "max_output_tokens": 3, "stream": True})
    streamed = json.loads(r.text.strip().splitlines()[-1][len("data: "):])["response"]
    for body in (blocking, streamed):
        assert body["status"] == "incomplete" and [i["type"] for i in body["output"]] == ["reasoning"]
        assert body["output"][0]["status"] == "incomplete"


def test_input_items_map_onto_the_chat_template(srv):
    s, engine, tok = srv
    convo = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Look it up."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]}]
    client(s).responses.create(model=s.state.model_id, input=convo, instructions="Be brief.", tools=[TOOL])
    prompt = tok.decode(engine.prompts[-1], skip_special_tokens=False)
    assert prompt.startswith("<|im_start|>system\n<tools>get_weather=")
    assert ("Be brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
            "Let me see.<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
            "</tool_call><|im_end|>\n<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>user\nAnd tomorrow?<|im_end|>\n"
            "<|im_start|>assistant\n") in prompt


def test_previous_response_id_continues_the_stored_conversation(srv):
    s, engine, tok = srv
    c = client(s)
    first = c.responses.create(model=s.state.model_id, input=ASK, tools=[TOOL])
    c.responses.create(model=s.state.model_id, previous_response_id=first.id, tools=[TOOL],
                       input=[{"type": "function_call_output", "call_id": first.output[2].call_id, "output": "rain"}])
    prompt = tok.decode(engine.prompts[-1], skip_special_tokens=False)
    assert "<|im_start|>user\n" + ASK + "<|im_end|>\n<|im_start|>assistant\n" in prompt
    assert "<parameter=city>\nRome\n</parameter>" in prompt and prompt.endswith(
        "<|im_start|>tool\nrain<|im_end|>\n<|im_start|>assistant\n")
    assert c.responses.retrieve(first.id).model_dump() == first.model_dump()
    items = c.responses.input_items.list(first.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == ASK


def test_input_tokens_is_the_prompt_length(srv):
    s, engine, _ = srv
    c = client(s)
    n = c.responses.input_tokens.count(model=s.state.model_id, input=ASK, tools=[TOOL]).input_tokens
    r = c.responses.create(model=s.state.model_id, input=ASK, tools=[TOOL])
    assert n == r.usage.input_tokens == len(engine.prompts[-1]) > 0


def test_input_items_pages_newest_first(srv):
    s, _, _ = srv
    items = [{"role": "user", "content": f"q{i}"} for i in range(5)]
    r = client(s).responses.create(model=s.state.model_id, input=items)
    url = f"{s.url}/v1/responses/{r.id}/input_items"
    page = httpx.get(url, params={"limit": 2}).json()
    assert [d["content"] for d in page["data"]] == ["q4", "q3"] and page["has_more"]
    rest = httpx.get(url, params={"limit": 10, "after": page["last_id"]}).json()
    assert [d["content"] for d in rest["data"]] == ["q2", "q1", "q0"] and not rest["has_more"]
    up = httpx.get(url, params={"order": "asc"}).json()
    assert [d["content"] for d in up["data"]] == [f"q{i}" for i in range(5)]
    for q, param in [({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "x"}, "after")]:
        bad = httpx.get(url, params=q)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param


def test_store_is_bounded_in_count_and_bytes():
    from ninfer_rt.server.responses_api import Store
    store = Store(size=3, max_bytes=1000)
    for i in range(5):
        store.put({"id": f"r{i}"}, [], [{"text": "x" * 100}])
    assert [k for k in store._items] == ["r2", "r3", "r4"]
    store.put({"id": "big"}, [], [{"text": "x" * 900}])           # pushes the older ones out by size
    assert list(store._items) == ["big"] and store.bytes < 1000
    store.put({"id": "huge"}, [], [{"text": "x" * 5000}])         # never kept
    assert list(store._items) == ["big"]
    store.delete("big")
    assert store.bytes == 0


def test_unstored_and_deleted_responses_are_404(srv):
    s, _, _ = srv
    c = client(s)
    r = c.responses.create(model=s.state.model_id, input=ASK, store=False)
    got = httpx.get(f"{s.url}/v1/responses/{r.id}")
    assert got.status_code == 404 and got.json()["error"]["param"] == "response_id"
    kept = c.responses.create(model=s.state.model_id, input=ASK)
    c.responses.delete(kept.id)
    again = _post(s, "/v1/responses", {"input": "x", "previous_response_id": kept.id})
    assert again.status_code == 404 and again.json()["error"]["param"] == "previous_response_id"


def test_max_output_tokens_is_an_incomplete_response(srv):
    s, _, _ = srv
    for stream in (False, True):
        r = _post(s, "/v1/responses", {"input": ASK, "max_output_tokens": 3, "stream": stream,
                                       "reasoning": {"effort": "none"}})
        body = r.json() if not stream else json.loads(r.text.strip().split("\n")[-1][len("data: "):])["response"]
        assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
        assert body["usage"]["output_tokens"] == 3 and body["output"][-1]["status"] == "incomplete"


@pytest.mark.parametrize("reasoning,kwargs", [(None, None), ({"effort": "none"}, {"enable_thinking": False}),
                                              ({"effort": "high"}, None)], ids=["absent", "none", "high"])
def test_reasoning_effort_none_turns_thinking_off(reasoning, kwargs):
    from ninfer_rt.server import responses_api as RA
    req = RA.parse({"input": ASK, **({"reasoning": reasoning} if reasoning else {})})
    assert RA.to_chat(req, [])[0].chat_template_kwargs == kwargs


BAD = {
    "no-input": ({}, "input"),
    "empty-input": ({"input": ""}, "input"),
    "web-search": ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    "background": ({"background": True}, "background"),
    "file": ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0"),
    "call-without-name": ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input.0.name"),
    "bad-arguments": ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
                      "input.0.arguments"),
    "bad-second-call": ({"input": [{"role": "user", "content": "q"}, {"type": "function_call", "call_id": "c",
                                                                      "name": "f", "arguments": "{}"},
                                   {"type": "function_call", "call_id": "d", "name": "f", "arguments": "1"}]},
                        "input.2.arguments"),
    "text-without-text": ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input.0.content.0.text"),
    "image-in-output": ({"input": [{"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]}, "input.0.output.0"),
    "hosted-tool-choice": ({"tools": [TOOL], "tool_choice": {"type": "web_search"}}, "tool_choice"),
    "unknown-tool-choice": ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
                            "tool_choice.name"),
    "bad-format": ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    "bad-schema": ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    "bad-tool-name": ({"tools": [{"type": "function", "name": "a b"}]}, "tools.0.name"),
    "bad-parameters": ({"tools": [{"type": "function", "name": "f", "parameters": {"properties": 1}}]},
                       "tools.0.parameters.properties"),
    "include": ({"include": ["file_search_call.results"]}, "include.0"),
    "tool-choice": ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice.name"),
    "too-long": ({"max_output_tokens": 10 ** 6}, "max_output_tokens"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_errors_name_the_responses_field(srv, case):
    s, _, _ = srv
    body, where = BAD[case]
    r = _post(s, "/v1/responses", {"input": ASK, **body} if case != "no-input" else body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == where, err
    assert where in err["message"].split(":")[0] and "\n" not in err["message"]


# ---- the real tiny engine: structured output, logprobs, forced calls ----

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "stream"])
def test_text_format_json_schema_on_the_real_engine(real_srv, stream):  # noqa: F811
    pytest.importorskip("xgrammar")
    kw = dict(model=MODEL_ID, input="hi", max_output_tokens=60, temperature=0, reasoning={"effort": "none"},
              text={"format": {"type": "json_schema", "name": "r", "schema": SCHEMA, "strict": True}})
    if stream:
        r = [e for e in client(real_srv).responses.create(stream=True, **kw)][-1].response
    else:
        r = client(real_srv).responses.create(**kw)
    v = json.loads(r.output_text)
    assert r.status == "completed" and set(v) == {"ok", "n"} and isinstance(v["n"], int), r.output_text
    assert r.text.format.type == "json_schema"


def test_logprobs_cover_the_answer_tokens(real_srv):  # noqa: F811
    kw = dict(model=MODEL_ID, input="hi", max_output_tokens=12, temperature=0, top_logprobs=2,
              include=["message.output_text.logprobs"], reasoning={"effort": "none"})
    blocking = client(real_srv).responses.create(**kw)
    events = list(client(real_srv).responses.create(stream=True, **kw))
    lps = blocking.output[-1].content[0].logprobs
    reasoning = blocking.usage.output_tokens_details.reasoning_tokens
    assert len(lps) == blocking.usage.output_tokens - reasoning and all(len(x.top_logprobs) == 2 for x in lps)
    streamed = [x for e in events if e.type == "response.output_text.delta" for x in e.logprobs]
    assert [x.model_dump() for x in streamed] == [x.model_dump() for x in lps]
    assert events[-1].response.output[-1].content[0].logprobs == lps


def test_forced_function_call_on_the_real_engine(real_srv):  # noqa: F811
    pytest.importorskip("xgrammar")
    pick = {"type": "function", "name": "pick", "parameters": {"type": "object", "properties": {
        "unit": {"enum": ["C", "F"]}}, "required": ["unit"]}}
    r = client(real_srv).responses.create(model=MODEL_ID, input="hi", max_output_tokens=120, temperature=0,
                                          tools=[TOOL, pick], tool_choice={"type": "function", "name": "pick"},
                                          reasoning={"effort": "none"})
    calls = [i for i in r.output if i.type == "function_call"]
    assert r.status == "completed" and calls and all(c.name == "pick" for c in calls), r.output
    assert all(json.loads(c.arguments)["unit"] in ("C", "F") for c in calls)      # required by the tool's schema
