"""OpenAI's Responses API (`POST /v1/responses`; `GET` / `DELETE /v1/responses/{id}` and `GET
/v1/responses/{id}/input_items` for stored ones), as vLLM serves it for clients written against it: the request is
checked under its own field names, then turned into the chat request the rest of the server runs (same template,
sampling, tools, images, structured output, queue).

Mapping: `instructions` -> a system message first; `input` (a string: one user message) items in order: messages
(input_text / output_text / refusal parts -> text, input_image -> an image part), `reasoning` items -> the next
assistant turn's reasoning content, `function_call` items -> that turn's tool calls, `function_call_output` items ->
tool messages; `previous_response_id` -> the stored response's input and output items first (its instructions are
not carried over, as OpenAI's); `tools` (function tools) -> chat tools; `tool_choice`, `parallel_tool_calls`;
`text.format` -> response_format; `max_output_tokens` -> max_tokens; `reasoning.effort` "none" -> the template's
thinking off; `include: ["message.output_text.logprobs"]` with `top_logprobs` -> logprobs.
"""
from __future__ import annotations

import collections
import json
import threading
from typing import Literal

from pydantic import Field

from . import protocol as P

STORE_MAX = 1024                # stored responses kept (the oldest go first); they live in this process only
STORE_BYTES = 256 << 20         # and at most this much of their JSON (images in inputs can be megabytes each)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_INCLUDES = (LOGPROBS_INCLUDE, "reasoning.encrypted_content")   # the second: nothing to add (no encryption here)


class Part(P._Strict):
    type: Literal["input_text", "output_text", "text", "refusal", "input_image", "input_file", "reasoning_text",
                  "summary_text"]
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class Item(P._Strict):
    """One input item; which fields matter depends on `type` (a message when absent), checked in `_check_item`."""
    type: Literal["message", "function_call", "function_call_output", "reasoning", "item_reference"] = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[Part] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[Part] | None = None
    summary: list[Part] | None = None
    status: str | None = None


class FunctionTool(P._Strict):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class TextConfig(P._Strict):
    format: dict | None = None
    verbosity: str | None = None


class Reasoning(P._Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None


class ResponsesRequest(P._Strict):
    model: str | None = None
    input: str | list[Item] | None = None      # may be left out when previous_response_id gives the conversation
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None                 # vLLM's extra sampling fields
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    store: bool = True
    previous_response_id: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    metadata: dict | None = None
    user: str | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None
    chat_template_kwargs: dict | None = None


class Store:
    """Finished responses by id (bounded in count and in bytes, oldest out first): their body, their own input
    items, and the items a continuation starts from (the earlier ones, their input, their output)."""

    def __init__(self, size: int = STORE_MAX, max_bytes: int = STORE_BYTES):
        self.size, self.max_bytes, self.bytes, self._lock = size, max_bytes, 0, threading.Lock()
        self._items: collections.OrderedDict[str, tuple[dict, list[dict], list[dict], int]] = \
            collections.OrderedDict()

    def put(self, body: dict, inputs: list[dict], continuation: list[dict]) -> None:
        n = len(json.dumps([body, continuation], ensure_ascii=False))     # inputs: a part of continuation
        if n > self.max_bytes:
            return                      # never kept: later requests naming it get the 404
        with self._lock:
            self._items[body["id"]] = (body, inputs, continuation, n)
            self.bytes += n
            while len(self._items) > self.size or self.bytes > self.max_bytes:
                self.bytes -= self._items.popitem(last=False)[1][3]

    def get(self, rid: str, param: str = "response_id") -> tuple[dict, list[dict], list[dict]]:
        with self._lock:
            got = self._items.get(rid)
        if got is None:
            raise P.ApiError(404, f"{param}: response {rid!r} not found (not stored, expired, or deleted)",
                             param=param, code="not_found")
        return got[:3]

    def continuation(self, rid: str) -> list[dict]:
        return self.get(rid, "previous_response_id")[2]

    def delete(self, rid: str) -> None:
        with self._lock:
            got = self._items.pop(rid, None)
            if got is not None:
                self.bytes -= got[3]
                return
        self.get(rid)                   # the 404


def listing(items: list[dict], query) -> dict:
    """`GET /v1/responses/{id}/input_items?order=&limit=&after=`: a stored response's input items, each with an
    id, newest first unless `order=asc` (OpenAI's default and paging)."""
    order, after = query.get("order", "desc"), query.get("after")
    if order not in ("asc", "desc"):
        raise P.bad_request(f"order: expected 'asc' or 'desc', got {order!r}", param="order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise P.bad_request(f"limit: expected an integer in [1, 100], got {query.get('limit')!r}", param="limit")
    data = [dict(item, id=item.get("id") or f"in_{i}") for i, item in enumerate(items)]
    data = data[::-1] if order == "desc" else data
    if after is not None:
        ids = [d["id"] for d in data]
        if after not in ids:
            raise P.bad_request(f"after: no input item {after!r} in this response", param="after")
        data = data[ids.index(after) + 1:]
    page = data[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(data) > limit}


def parse(data) -> ResponsesRequest:
    req = P.parse(ResponsesRequest, data)
    unsupported = {"background": req.background, "conversation": req.conversation, "prompt": req.prompt}
    bad = next((k for k, v in unsupported.items() if v), None)
    if bad is not None:
        raise P.bad_request(f"{bad}: not supported by this server", param=bad)
    if req.truncation == "auto":
        raise P.bad_request("truncation: only 'disabled' is supported (a prompt past the context is a 400)",
                            param="truncation")
    for i, inc in enumerate(req.include or ()):
        if inc not in _INCLUDES:
            raise P.bad_request(f"include.{i}: {inc!r} is not supported (only {', '.join(_INCLUDES)})",
                                param=f"include.{i}")
    for i, t in enumerate(req.tools or ()):
        if t.type != "function":
            raise P.bad_request(f"tools.{i}.type: only function tools are supported, got {t.type!r}",
                                param=f"tools.{i}.type")
        if not t.name:
            raise P.bad_request(f"tools.{i}.name: a function tool needs a name", param=f"tools.{i}.name")
    if isinstance(req.input, str) and not req.input:
        raise P.bad_request("input: must not be empty", param="input")
    for i, item in enumerate(req.input if isinstance(req.input, list) else ()):
        _check_item(item, f"input.{i}")
    return req


_NEEDS = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
          "function_call_output": ("call_id", "output"), "reasoning": (), "item_reference": ("id",)}


def _check_item(item: Item, where: str) -> None:
    missing = next((f for f in _NEEDS[item.type] if getattr(item, f) is None), None)
    if missing is not None:
        raise P.bad_request(f"{where}.{missing}: a {item.type} item needs it", param=f"{where}.{missing}")
    for field in ("content", "output", "summary"):
        parts = getattr(item, field)
        for j, part in enumerate(parts if isinstance(parts, list) else ()):
            _check_part(part, f"{where}.{field}.{j}", images=field == "content" and item.role == "user")


def _check_part(part: Part, where: str, images: bool) -> None:
    if part.type == "input_file" or (part.type == "input_image" and part.image_url is None):
        raise P.bad_request(f"{where}: files (file_id) are not supported; give an image_url", param=where)
    if part.type == "input_image" and not images:
        raise P.bad_request(f"{where}: images belong in the content of user messages", param=where)
    need = "refusal" if part.type == "refusal" else None if part.type == "input_image" else "text"
    if need is not None and getattr(part, need) is None:
        raise P.bad_request(f"{where}.{need}: a {part.type} part needs it", param=f"{where}.{need}")


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join((p.text if p.type != "refusal" else p.refusal) or "" for p in content or ())


def _parts(content) -> str | list[dict]:
    """A message's content for the chat request: its text, or text and image parts."""
    if not isinstance(content, list) or not any(p.type == "input_image" for p in content):
        return _text(content)
    return [{"type": "image_url", "image_url": {"url": p.image_url}} if p.type == "input_image"
            else {"type": "text", "text": _text([p])} for p in content]


class _Messages:
    """Input items -> chat messages, with the name of the item each came from (errors name the client's item)."""

    def __init__(self):
        self.msgs: list[dict] = []
        self.names: dict[str, str] = {}
        self._reasoning: str | None = None      # a reasoning item's text, for the assistant turn that follows

    def add(self, item: Item, where: str) -> None:
        if item.type == "item_reference":
            raise P.bad_request(f"{where}: item references are not supported; send the item itself",
                                param=where)
        if item.type == "reasoning":
            text = _text(item.content) if item.content else _text(item.summary)    # its text, else its summary
            self._reasoning = (self._reasoning or "") + text
            return
        if item.type == "function_call_output":
            self._put(where, {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        elif item.type == "function_call":
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                         "arguments": item.arguments}}
            last = self.msgs[-1] if self.msgs else None
            if last is not None and last["role"] == "assistant" and self._reasoning is None:
                last.setdefault("tool_calls", []).append(call)      # the same turn's text, or its earlier calls
            else:
                self._assistant(where, {"role": "assistant", "content": "", "tool_calls": [call]})
            at = f"messages.{len(self.msgs) - 1}.tool_calls.{len(self.msgs[-1]['tool_calls']) - 1}"
            self.names.update({at: where, f"{at}.function.arguments": f"{where}.arguments",
                               f"{at}.function.name": f"{where}.name"})
        elif item.role == "assistant":
            self._assistant(where, {"role": "assistant", "content": _text(item.content)})
        else:
            self._put(where, {"role": item.role, "content": _parts(item.content)})

    def _assistant(self, where: str, msg: dict) -> None:
        if self._reasoning is not None:
            msg["reasoning_content"], self._reasoning = self._reasoning, None
        self._put(where, msg)

    def _put(self, where: str, msg: dict) -> None:
        self.names.setdefault(f"messages.{len(self.msgs)}", where)
        self.msgs.append(msg)


def input_items(req: ResponsesRequest) -> list[dict]:
    """The request's input as items (a string input: one user message), as they are stored and listed."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": req.input}]}]
    return [i.model_dump(exclude_none=True) for i in req.input or ()]


def to_chat(req: ResponsesRequest, earlier: list[dict]) -> tuple[P.ChatRequest, dict[str, str]]:
    """(the chat request, {its field's name: the Responses request's}); `earlier`: the items of the response that
    `previous_response_id` names (none without one)."""
    m = _Messages()
    if req.instructions:
        m._put("instructions", {"role": "system", "content": req.instructions})
    for i, item in enumerate(earlier):
        m.add(P.parse(Item, item), f"previous_response_id (item {i})")
    for i, item in enumerate(P.parse(Item, x) for x in input_items(req)):
        m.add(item, f"input.{i}" if isinstance(req.input, list) else "input")
    if not m.msgs:
        raise P.bad_request("input: no message to answer", param="input")
    names = dict(m.names)
    kw = _sampling(req)
    if req.tools:
        kw["tools"] = [{"type": "function", "function": {k: v for k, v in t.model_dump(exclude_none=True).items()
                                                         if k != "type"}} for t in req.tools]
        for i in range(len(req.tools)):
            names.update({f"tools.{i}.function.parameters": f"tools.{i}.parameters",
                          f"tools.{i}.function.name": f"tools.{i}.name"})
    try:
        return P.parse(P.ChatRequest, {"messages": m.msgs, **kw}), names
    except P.ApiError as e:
        raise renamed(e, names) from None


def _sampling(req: ResponsesRequest) -> dict:
    kw = {"max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
          "top_k": req.top_k, "min_p": req.min_p, "seed": req.seed, "stop": req.stop, "stream": req.stream,
          "repetition_penalty": req.repetition_penalty, "parallel_tool_calls": req.parallel_tool_calls,
          "user": req.user}
    kw = {k: v for k, v in kw.items() if v is not None}
    if req.tool_choice is not None:
        kw["tool_choice"] = _tool_choice(req.tool_choice)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None:
        kw["response_format"] = _format(fmt)
    if LOGPROBS_INCLUDE in (req.include or ()) or req.top_logprobs:
        kw.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    template = dict(req.chat_template_kwargs or {})
    if req.reasoning is not None and req.reasoning.effort == "none":
        template.setdefault("enable_thinking", False)
    if template:
        kw["chat_template_kwargs"] = template
    return kw


def _tool_choice(c):
    """OpenAI's Responses shape ("auto" / "none" / "required" / {"type": "function", "name"}) -> the chat one."""
    if c in ("auto", "none", "required"):
        return c
    if isinstance(c, dict) and c.get("type") == "function":
        if not isinstance(c.get("name"), str):
            raise P.bad_request("tool_choice.name: a function tool choice needs the function's name",
                                param="tool_choice.name")
        return {"type": "function", "function": {"name": c["name"]}}
    raise P.bad_request(f"tool_choice: expected 'auto', 'none', 'required' or {{\"type\": \"function\", \"name\": "
                        f"...}}, got {c!r}", param="tool_choice")


def _format(fmt: dict) -> dict:
    """text.format -> chat's response_format (json_schema's name / schema / strict move into `json_schema`)."""
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise P.bad_request("text.format.schema: expected a JSON schema object", param="text.format.schema")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    if fmt.get("type") not in ("text", "json_object"):
        raise P.bad_request(f"text.format.type: expected 'text', 'json_object' or 'json_schema', got "
                            f"{fmt.get('type')!r}", param="text.format.type")
    return {"type": fmt["type"]}


_CHAT_FIELDS = {"max_tokens": "max_output_tokens", "response_format.json_schema.schema": "text.format.schema",
                "response_format": "text.format", "top_logprobs": "top_logprobs",
                "tool_choice.function.name": "tool_choice.name"}


def renamed(e: P.ApiError, names: dict[str, str]) -> P.ApiError:
    """An error about a chat field, under the Responses request's name for it."""
    table = {**_CHAT_FIELDS, **names}
    for chat, ours in sorted(table.items(), key=lambda kv: -len(kv[0])):
        if e.param and (e.param == chat or e.param.startswith(chat + ".")):
            param = ours + e.param[len(chat):]
            return P.ApiError(e.status, e.message.replace(e.param, param, 1), type=e.type, param=param, code=e.code)
    return e
