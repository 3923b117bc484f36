"""Replies of `POST /v1/messages`: one message body, or Anthropic's SSE event sequence (message_start, per content
block a start / deltas / stop, message_delta with the stop reason and usage, message_stop).

Blocks come in the order the model writes them: thinking (its reasoning), text, then one tool_use block per
parsed call (its whole input in one `input_json_delta`). The stop reason: `max_tokens` (length), `tool_use`
(calls were made), `stop_sequence` (with the string that matched) or `end_turn`.
"""
from __future__ import annotations

import json
import sys
import traceback
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from . import bodies as B
from . import protocol as P
from .anthropic_api import error_body
from .replies import Choice, Reply, _events, collect_one, sse_response


def _stop(c: Choice, finish: str) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if finish == "length":
        return "max_tokens", None
    if c.tools is not None and c.tools.calls:
        return "tool_use", None
    matched = c.handle.text.answer.matched
    return ("stop_sequence", matched) if matched is not None else ("end_turn", None)


def _tool_block(call) -> dict:
    return {"type": "tool_use", "id": call.id.replace("call_", "toolu_", 1), "name": call.name,
            "input": json.loads(call.arguments)}


def _message(rid: str, model: str, content: list, stop: tuple, usage: dict) -> dict:
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


def _usage(prompt: int, output: int, cached: int = 0) -> dict:
    """Anthropic counts prompt tokens read from a cache apart: input_tokens are the rest."""
    use = {"input_tokens": prompt - cached, "output_tokens": output}
    if cached:
        use["cache_read_input_tokens"] = cached
    return use


def new_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


async def respond(c: Choice, request: Request, reply: Reply, prompt_tokens: int):
    rid, model, stream = reply.rid, reply.model, reply.stream
    if stream:
        return sse_response(_stream(c, rid, model, prompt_tokens))
    got = await collect_one(c, request, error_body)
    if isinstance(got, Response):
        return got
    content = []
    if got.reasoning and "".join(got.reasoning):
        content.append({"type": "thinking", "thinking": "".join(got.reasoning), "signature": ""})
    text = "".join(got.content)
    if c.tools is not None:
        text = c.tools.parse_all(text)
    if text or not (c.tools and c.tools.calls):
        content.append({"type": "text", "text": text})
    content += [_tool_block(t) for t in (c.tools.calls if c.tools is not None else ())]
    use = _usage(got.use["prompt_tokens"], got.use["completion_tokens"], B.cached_tokens(got.use))
    return JSONResponse(_message(rid, model, content, _stop(c, got.finish), use))


def _sse(kind: str, obj: dict) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() \
        + b"\n\n"


class _Blocks:
    """The open content block of a stream: a delta of another kind closes it and opens the next."""

    def __init__(self):
        self.index, self.kind, self.kinds = -1, None, set()

    def switch(self, kind: str | None, start: dict | None = None) -> list[bytes]:
        out = []
        if self.kind is not None:
            out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.kind = kind
        if kind is not None:
            self.kinds.add(kind)
            self.index += 1
            out.append(_sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                    "content_block": start}))
        return out

    def delta(self, kind: str, delta: dict, start: dict) -> list[bytes]:
        out = self.switch(kind, start) if self.kind != kind else []
        out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}))
        return out


def _parsed(c: Choice, content: str) -> tuple[str, list]:
    return c.tools.feed(content) if c.tools is not None else (content, [])


def _chunks(blocks: _Blocks, reasoning: str, content: str, calls: list) -> list[bytes]:
    out = []
    if reasoning:
        out += blocks.delta("thinking", {"type": "thinking_delta", "thinking": reasoning},
                            {"type": "thinking", "thinking": "", "signature": ""})
    if content:
        out += blocks.delta("text", {"type": "text_delta", "text": content}, {"type": "text", "text": ""})
    for call in calls:
        block = _tool_block(call)
        out += blocks.switch("tool_use", dict(block, input={}))
        out += blocks.delta("tool_use", {"type": "input_json_delta", "partial_json": call.arguments}, None)
    return out


async def _stream(c: Choice, rid: str, model: str, prompt_tokens: int):
    blocks, started = _Blocks(), False
    try:
        async for ev in _events(c.handle, None):
            if not started:        # after the admission, so its usage counts the prompt tokens read from the cache
                started = True
                yield _sse("message_start", {"type": "message_start", "message": _message(
                    rid, model, [], (None, None), _usage(prompt_tokens, 0, c.handle.cached))})
            if ev[0] == "delta":
                for b in _chunks(blocks, ev[1], *_parsed(c, ev[2])):
                    yield b
            elif ev[0] == "error":
                yield _sse("error", error_body(ev[1]))
                return
            elif ev[0] == "done":
                _, finish, use = ev
                rest = c.tools.finish() if c.tools is not None else ""
                for b in _chunks(blocks, "", rest, []):
                    yield b
                if not blocks.kinds & {"text", "tool_use"}:     # as the blocking reply: a text block, maybe empty
                    for b in blocks.switch("text", {"type": "text", "text": ""}):
                        yield b
                for b in blocks.switch(None):
                    yield b
                stop = _stop(c, finish)
                yield _sse("message_delta", {"type": "message_delta", "delta": {
                    "stop_reason": stop[0], "stop_sequence": stop[1]},
                    "usage": _usage(use["prompt_tokens"], use["completion_tokens"], B.cached_tokens(use))})
                yield _sse("message_stop", {"type": "message_stop"})
    except Exception as e:       # a bug: the client still gets an error event, not a stream that just stops
        traceback.print_exc(file=sys.stderr)
        yield _sse("error", error_body(P.ApiError(500, f"internal server error: {type(e).__name__}")))
    finally:
        c.handle.cancel()
