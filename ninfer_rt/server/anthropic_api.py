"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), as llama.cpp's and vLLM's
servers offer it for clients written against it: the request is checked under its own field names, then turned
into the chat request the rest of the server runs (same template, sampling, tools, images, queue).

Mapping: `system` -> a system message; text / image blocks -> content parts (a base64 source becomes a data
URL); `tool_use` blocks -> the assistant's tool calls; `tool_result` blocks -> tool messages, in order;
`thinking` blocks -> reasoning content; `tools[].input_schema` -> function parameters; `tool_choice` auto /
none / any / tool -> auto / none / required / the named function; `thinking.type` enabled / adaptive -> the
template's `enable_thinking` on, disabled or absent -> off (as Anthropic's models think only when asked);
`stop_sequences` -> stop strings; a final assistant message is a prefill (vLLM's `continue_final_message`).
Errors use Anthropic's shape: `{"type": "error", "error": {"type", "message"}}` (`error_body`).
"""
from __future__ import annotations

import json
from typing import Literal

from pydantic import Field

from . import protocol as P

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(e: P.ApiError) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


class Source(P._Strict):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class Block(P._Strict):
    """One content block; which fields matter depends on `type` (checked in `_check_block`)."""
    type: Literal["text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"]
    text: str | None = None
    source: Source | None = None
    id: str | None = None
    name: str | None = None
    input: dict | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None


class Message(P._Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDef(P._Strict):
    name: str
    description: str | None = None
    input_schema: dict


class ToolChoice(P._Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(P._Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class MessagesRequest(P._Strict):
    model: str | None = None
    messages: list[Message]
    max_tokens: int = Field(ge=1)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    metadata: dict | None = None


class CountRequest(P._Strict):
    model: str | None = None
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[ToolDef] | None = None
    thinking: Thinking | None = None


def parse(data, model: type[P._Strict] = MessagesRequest):
    req = P.parse(model, data)
    if not req.messages:
        raise P.bad_request("messages: must contain at least one message", param="messages")
    for i, m in enumerate(req.messages):
        for j, b in enumerate(m.content if isinstance(m.content, list) else ()):
            _check_block(b, f"messages.{i}.content.{j}", m.role)
    if isinstance(req.system, list):
        for j, b in enumerate(req.system):
            if b.type != "text" or b.text is None:
                raise P.bad_request(f"system.{j}: only text blocks may form the system prompt", param=f"system.{j}")
    return req


_NEEDS = {"text": ("text",), "image": ("source",), "tool_use": ("id", "name", "input"),
          "tool_result": ("tool_use_id",), "thinking": ("thinking",), "redacted_thinking": ()}
_ROLES = {"tool_use": "assistant", "thinking": "assistant", "redacted_thinking": "assistant",
          "tool_result": "user", "image": "user"}


def _check_block(b: Block, where: str, role: str) -> None:
    missing = next((f for f in _NEEDS[b.type] if getattr(b, f) is None), None)
    if missing is not None:
        raise P.bad_request(f"{where}.{missing}: a {b.type} block needs it", param=f"{where}.{missing}")
    if _ROLES.get(b.type, role) != role:
        raise P.bad_request(f"{where}: a {b.type} block belongs in a {_ROLES[b.type]} message, not a {role} one",
                            param=where)
    if b.type == "image" and (b.source.data if b.source.type == "base64" else b.source.url) is None:
        field = "data" if b.source.type == "base64" else "url"
        raise P.bad_request(f"{where}.source.{field}: a {b.source.type} image source needs it",
                            param=f"{where}.source.{field}")
    if b.type == "image" and b.source.type == "base64" and not b.source.media_type:
        raise P.bad_request(f"{where}.source.media_type: a base64 image source needs it",
                            param=f"{where}.source.media_type")


def to_chat(req) -> P.ChatRequest:
    """The chat request this Messages request stands for (MessagesRequest or CountRequest)."""
    return to_chat_named(req)[0]


def to_chat_named(req) -> tuple[P.ChatRequest, dict[str, str]]:
    """(the chat request, {its field's name: the Messages request's}): an error about an image or a tool names
    the block or tool the client sent, not the chat field it became."""
    msgs, names = [], {}
    if req.system:
        text = req.system if isinstance(req.system, str) else "".join(b.text for b in req.system)
        msgs.append({"role": "system", "content": text})
    for i, m in enumerate(req.messages):
        for chat_msg, blocks in _messages(m):
            at = len(msgs)
            names.update({f"messages.{at}.content.{j}": f"messages.{i}.content.{b}" for j, b in enumerate(blocks)})
            names.setdefault(f"messages.{at}", f"messages.{i}")
            msgs.append(chat_msg)
    # Anthropic's models think only when asked: no `thinking` (or "disabled") closes the template's think block
    kw = {"chat_template_kwargs": {"enable_thinking": req.thinking is not None and req.thinking.type != "disabled"}}
    if req.tools:
        kw["tools"] = [{"type": "function", "function": _given(name=t.name, description=t.description,
                                                               parameters=t.input_schema)} for t in req.tools]
        for i in range(len(req.tools)):
            names.update({f"tools.{i}.function.parameters": f"tools.{i}.input_schema",
                          f"tools.{i}.function.name": f"tools.{i}.name"})
    if isinstance(req, MessagesRequest):
        kw.update(_sampling(req))
    if req.messages[-1].role == "assistant":        # a prefill: the answer continues that message
        kw["continue_final_message"] = True
    try:
        return P.parse(P.ChatRequest, {"messages": msgs, **kw}), names
    except P.ApiError as e:
        raise renamed(e, names) from None


def renamed(e: P.ApiError, names: dict[str, str]) -> P.ApiError:
    """An error about a converted content part, under the name of the block it came from."""
    for chat, ours in sorted(names.items(), key=lambda kv: -len(kv[0])):     # the most specific name first
        if e.param and (e.param == chat or e.param.startswith(chat + ".")):
            param = ours + e.param[len(chat):].replace(".image_url", ".source", 1)   # the block's own field
            return P.ApiError(e.status, e.message.replace(e.param, param, 1), type=e.type, param=param, code=e.code)
    return e


def _given(**kw) -> dict:
    return {k: v for k, v in kw.items() if v is not None}


def _sampling(req: MessagesRequest) -> dict:
    kw = {"max_tokens": req.max_tokens, "stop": req.stop_sequences, "stream": req.stream,
          "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k}
    c = req.tool_choice
    if c is not None:
        kw["tool_choice"] = {"any": "required", "tool": {"type": "function", "function": {"name": c.name}}}.get(
            c.type, c.type)
        if c.type == "tool" and c.name not in [t.name for t in req.tools or ()]:
            raise P.bad_request(f"tool_choice.name: {c.name!r} is not one of the request's tools",
                                param="tool_choice.name")
        if c.type in ("any", "tool") and not req.tools:
            raise P.bad_request("tool_choice.type: forcing a tool call needs tools", param="tool_choice.type")
        if c.disable_parallel_tool_use:
            kw["parallel_tool_calls"] = False
    return _given(**kw)


def _messages(m: Message) -> list[tuple[dict, list[int]]]:
    """One Anthropic message -> chat messages, each with the block index of each of its content parts: tool
    results become tool messages (before the user's own text, as they answer the calls of the turn before)."""
    if isinstance(m.content, str):
        return [({"role": m.role, "content": m.content}, [])]
    if m.role == "assistant":
        return [(_assistant(m.content), [])]
    out, parts, blocks = [], [], []
    for k, b in enumerate(m.content):
        if b.type == "tool_result":
            out.append(({"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b)}, []))
            continue
        if b.type == "text":
            parts.append({"type": "text", "text": b.text})
        else:
            parts.append({"type": "image_url", "image_url": {"url": _image_url(b.source)}})
        blocks.append(k)
    if parts:
        out.append(({"role": "user", "content": parts}, blocks))
    return out


def _assistant(blocks: list[Block]) -> dict:
    text = "".join(b.text for b in blocks if b.type == "text")
    msg = {"role": "assistant", "content": text}
    thinking = "".join(b.thinking for b in blocks if b.type == "thinking")
    if thinking:
        msg["reasoning_content"] = thinking
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in blocks if b.type == "tool_use"]
    if calls:
        msg["tool_calls"] = calls
    return msg


def _result_text(b: Block) -> str:
    if isinstance(b.content, list):
        return "".join(x.text or "" for x in b.content if x.type == "text")
    return b.content or ""


def _image_url(s: Source) -> str:
    return f"data:{s.media_type};base64,{s.data}" if s.type == "base64" else s.url
