"""The tool-call parser (ninfer_rt/server/tool_calls.py): Qwen3-Coder XML calls out of answer text, fed whole or
in pieces, with the parameter values converted by the tools' JSON schemas."""
from __future__ import annotations

import json

import pytest

from ninfer_rt.server.tool_calls import ToolParser, convert

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": ["number", "null"]},
    "metric": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"properties": {"q": {}}}}}


def call(name: str, **params) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def run(chunks, tools=(WEATHER, SEARCH), parallel=True):
    """(content, [(name, arguments as a dict)]) of the answer fed in `chunks`; every call id is distinct."""
    p = ToolParser(list(tools), parallel)
    content, calls = "", []
    for ch in chunks:
        text, new = p.feed(ch)
        content, calls = content + text, calls + new
    content += p.finish()
    assert calls == p.calls and len({c.id for c in calls}) == len(calls)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


TWO_CALLS = ("Let me look.\n\n" + call("get_weather", city="Paris", days="3", metric="true") + "\n"
             + call("search", q="rain  \n in Paris") + "\n")
CASES = {
    "two-calls": (TWO_CALLS, "Let me look.", [("get_weather", {"city": "Paris", "days": 3, "metric": True}),
                                              ("search", {"q": "rain  \n in Paris"})]),
    "text-only": ("Plain <b>answer</b> with <tool and a trailing space ", "Plain <b>answer</b> with <tool and a "
                  "trailing space ", []),
    "call-then-text": (call("search", q="x") + "\n\nDone.\n", "Done.\n", [("search", {"q": "x"})]),
    "leading-space-kept": ("  hi", "  hi", []),
    "not-a-call": ("a <tool_call>no function here</tool_call> b", "a <tool_call>no function here</tool_call> b", []),
    "unclosed": ("x " + call("search", q="y")[:-len("</tool_call>")], "x " + call("search", q="y")[:-12], []),
    "no-closing-parameter": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n"
                             "</function>\n</tool_call>", "", [("get_weather", {"city": "Oslo", "days": 2})]),
    "unknown-function": (call("nope", a="1"), "", [("nope", {"a": "1"})]),
    "typed-values": (call("get_weather", temp="-2.5", opts='{"unit": "C"}', tags="['a', 'b']", days="x"), "",
                     [("get_weather", {"temp": -2.5, "opts": {"unit": "C"}, "tags": ["a", "b"], "days": "x"})]),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_whole_answer(case):
    text, content, calls = CASES[case]
    assert run([text]) == (content, calls)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("size", [1, 2, 7], ids=["by-char", "by-2", "by-7"])
def test_streamed_in_pieces_equals_whole(case, size):
    text = CASES[case][0]
    assert run([text[i:i + size] for i in range(0, len(text), size)]) == run([text])


def test_text_is_released_as_soon_as_it_cannot_start_a_call():
    p = ToolParser([SEARCH])
    assert p.feed("Hello <to") == ("Hello", [])            # the space waits for what follows, '<to' may be a call
    assert p.feed("y") == (" <toy", [])
    text, new = p.feed(" " + call("search", q="z"))
    assert text == "" and [c.name for c in new] == ["search"]     # whitespace before a call is dropped


def test_parallel_false_keeps_the_first_call():
    assert run([TWO_CALLS], parallel=False)[1] == [("get_weather", {"city": "Paris", "days": 3, "metric": True})]


@pytest.mark.parametrize("value,ty,want", [
    ("42", "integer", 42), ("4.0", "integer", "4.0"), ("7", "number", 7), ("1e3", "number", 1000.0),
    ("False", "boolean", False), ("yes", "boolean", "yes"), ("null", "object", None), ("null", "string", "null"),
    (" [1, 2] ", "array", [1, 2]), ("{'k': None}", "object", {"k": None}), ("{oops", "object", "{oops"),
    (" spaced ", None, " spaced "), ("3", "string", "3"),
    ("{1, 2}", "object", "{1, 2}"), ("nan", "number", "nan"), ("inf", "number", "inf"), ("b'x'", "array", "b'x'"),
], ids=lambda v: repr(v))
def test_convert_by_schema_type(value, ty, want):
    assert convert(value, ty) == want
