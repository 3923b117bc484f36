"""Tool calls: the calls a chat answer makes, parsed out of its text in Qwen3.8's format, never executed.

The chat template renders the request's `tools` into the prompt (reference §15) and asks for each call as
Qwen3-Coder XML:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

`ToolParser` takes the answer text as it is released (any split, one character at a time included) and
returns the text that stays content plus each call once its `</tool_call>` has arrived, so a streamed reply
and a blocking one carry the same content and calls. A value is text; it becomes JSON by the type the tool's
JSON schema gives that parameter (string when the schema says string, names no type, or the value does not
convert). A block that does not parse as a call stays in the content, as written. Whitespace around calls is
dropped (the model separates calls with newlines), so it is held back until the next non-space text decides.
"""
from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass

from ..grammar import JSON_WHITESPACE
from ..tokenizer import TOOL_CALL_TAGS

OPEN, CLOSE = TOOL_CALL_TAGS
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?$", re.S)
# a parameter ends at its closing tag, or (the model left it out) where the next one or the function ends
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.S)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str            # a JSON object's text, as OpenAI's `function.arguments`

    def api(self, index: int) -> dict:
        """The `tool_calls` entry of a message or of a stream delta."""
        return {"index": index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _schema_types(tools: list[dict]) -> dict[str, dict[str, str | None]]:
    """{function name: {parameter: its JSON-schema type, the first that is not "null"; None if unnamed}}."""
    out = {}
    for t in tools:
        fn = t.get("function", t)
        props = ((fn.get("parameters") or {}).get("properties") or {})
        types = {}
        for key, schema in (props.items() if isinstance(props, dict) else ()):
            types[key] = next((x for x in _type_list(schema) if x != "null"), None)
        out[fn.get("name")] = types
    return out


def _type_list(schema) -> list[str]:
    """The JSON-schema `type` of a parameter as a list (a string, a list of them, or absent)."""
    ty = schema.get("type") if isinstance(schema, dict) else None
    return [ty] if isinstance(ty, str) else [x for x in ty if isinstance(x, str)] if isinstance(ty, list) else []


def convert(value: str, ty: str | None):
    """A parameter's text as the JSON value its schema type asks for; the text itself where it does not fit."""
    if ty in (None, "string"):
        return value
    v = value.strip()
    if v == "null":
        return None
    try:
        out = _typed(v, ty)
        json.dumps(out, allow_nan=False)       # a set, bytes, NaN...: not a JSON value, so the text it is
        return out
    except (ValueError, KeyError, TypeError, SyntaxError, MemoryError, RecursionError):
        return value


def _typed(v: str, ty: str):
    if ty == "integer":
        return int(v)
    if ty == "number":
        return int(v) if re.fullmatch(r"[+-]?\d+", v) else float(v)
    if ty == "boolean":
        return {"true": True, "false": False}[v.lower()]
    if ty in ("object", "array"):
        try:
            return json.loads(v)
        except ValueError:
            return ast.literal_eval(v)      # a Python literal ({'a': 1}, True) is what models often write
    raise ValueError(ty)                    # a type this parser does not convert: the text


def parse_call(block: str, types: dict) -> ToolCall | None:
    """The text between `<tool_call>` and `</tool_call>` as a call; None if it does not name a function."""
    m = _FUNCTION.fullmatch(block)
    if m is None:
        return None
    name, body = m.group(1).strip(), m.group(2)
    params = types.get(name, {})
    args = {}
    for pm in _PARAM.finditer(body):
        key, value = pm.group(1).strip(), pm.group(2)
        value = value[1:] if value.startswith("\n") else value      # the format's own line breaks
        value = value[:-1] if value.endswith("\n") else value
        args[key] = convert(value, params.get(key))
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(args, ensure_ascii=False))


class ToolParser:
    """One answer's text -> (content, calls), incrementally. `parallel=False` keeps the first call only
    (OpenAI's `parallel_tool_calls: false`)."""

    def __init__(self, tools: list[dict], parallel: bool = True):
        self.types, self.parallel = _schema_types(tools), parallel
        self.calls: list[ToolCall] = []
        self._buf = ""            # text not yet decided: inside a call, or maybe the start of OPEN
        self._inside = False
        self._space = ""          # trailing whitespace held back: dropped if a call follows it
        self._after_call = False  # the last thing parsed was a call: leading whitespace is dropped

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Newly released answer text -> (content to send, calls completed by it)."""
        self._buf += text
        content, new = "", []
        while True:
            if self._inside:
                end = self._buf.find(CLOSE)
                if end < 0:
                    break
                block, self._buf, self._inside = self._buf[:end], self._buf[end + len(CLOSE):], False
                content += self._complete(block, new)
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                content += self._text(self._buf[:start])    # its trailing space waits for the block
                self._buf, self._inside = self._buf[start + len(OPEN):], True
                continue
            keep = _partial_suffix(self._buf, OPEN)
            content += self._text(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return content, new

    def parse_all(self, text: str) -> str:
        """A whole answer (a blocking reply) -> its content; the calls are in `calls`."""
        return self.feed(text)[0] + self.finish()

    def finish(self) -> str:
        """End of the answer: the rest is content (an unclosed call too, as written)."""
        rest = (OPEN if self._inside else "") + self._buf
        self._buf, self._inside = "", False
        content = self._text(rest) + self._space
        self._space = ""
        return content

    def _complete(self, block: str, new: list) -> str:
        call = parse_call(block, self.types)
        if call is None:                       # not a call: the model's text, as written
            return self._text(OPEN + block + CLOSE)
        if self.parallel or not self.calls:
            self.calls.append(call)
            new.append(call)
        self._after_call, self._space = True, ""
        return ""

    def _text(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._after_call = False
        body = text.rstrip()
        if not body:
            self._space += text
            return ""
        out, self._space = self._space + body, text[len(body):]
        return out


# tags a value may not hold: the parser ends a value (or the call) at the first of them
_VALUE_EXCLUDES = ("</parameter>", "</function>", CLOSE, "<parameter=")


def call_tag(tools: list[dict], name: str | None = None, parallel: bool = True) -> str:
    """xgrammar's structural tag (its JSON text) for answers that are only calls in this format: of function
    `name`, or of any of the tools; one call, or several separated by newlines when `parallel`. The arguments
    follow each tool's JSON schema as the format writes them (xgrammar's "qwen_xml" style: the schema's order,
    required parameters present, typed values), and no string in them holds one of the format's tags, where the
    parser would end the value. The tool_choice "required" / named-function grammar."""
    tags = [{"type": "tag", "begin": f"{OPEN}\n<function={t['name']}>\n", "end": f"</function>\n{CLOSE}",
             "content": {"type": "json_schema", "json_schema": _parameters(t), "style": "qwen_xml",
                         "max_whitespace_cnt": JSON_WHITESPACE, "excludes": list(_VALUE_EXCLUDES)}}
            for t in (x.get("function", x) for x in tools) if name is None or t["name"] == name]
    fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
           "stop_after_first": not parallel}
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)


def _parameters(fn: dict) -> dict:
    """A function's parameter schema; none given is an empty parameter list (OpenAI's rule)."""
    return fn.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
