"""Replies of `POST /v1/responses`: one response object, or the Responses SSE events (response.created /
in_progress, per output item its added / deltas / done events, response.completed or .incomplete; every event
numbered by `sequence_number`, no `[DONE]`).

Output items come in the order the model writes them: a reasoning item (its reasoning text), a message item
(`output_text`, with logprobs when asked), then one function_call item per parsed call. A reply cut by
max_output_tokens is `status: "incomplete"` with `incomplete_details.reason: "max_output_tokens"`. A stored
response (`store`, the default) keeps its input and output items for `previous_response_id`.
"""
from __future__ import annotations

import json
import sys
import time
import traceback
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from . import bodies as B
from . import protocol as P
from .replies import Choice, ClientGone, Reply, _events, sse_response
from .responses_api import ResponsesRequest, Store, input_items


def new_id(prefix: str = "resp") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class Shape:
    """What a response object repeats of its request, and its id and creation time."""

    def __init__(self, reply: Reply, req: ResponsesRequest, prompt_tokens: int):
        self.rid, self.model, self.req, self.prompt_tokens = reply.rid, reply.model, req, prompt_tokens
        self.created = int(time.time())

    def body(self, status: str, output: list, use: dict | None, finish: str | None = None) -> dict:
        r = self.req
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": r.reasoning.effort if r.reasoning else None, "summary": None},
            "store": r.store, "temperature": r.temperature, "top_p": r.top_p,
            "text": {"format": (r.text.format if r.text and r.text.format else {"type": "text"})},
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or ()], "top_logprobs": r.top_logprobs,
            "truncation": "disabled", "usage": use, "user": r.user, "metadata": r.metadata or {}}

    def usage(self, output_tokens: int, reasoning_tokens: int, cached: int = 0) -> dict:
        # cache_write_tokens: OpenAI's prompt caching bills writes; the prefix cache here has no such cost
        return {"input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": self.prompt_tokens + output_tokens}


def _status(finish: str) -> str:
    return "incomplete" if finish == "length" else "completed"


def _reasoning_item(iid: str, text: str, status: str) -> dict:
    return {"id": iid, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def _text_part(text: str, logprobs: list | None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(iid: str, content: list, status: str) -> dict:
    return {"id": iid, "type": "message", "role": "assistant", "status": status, "content": content}


def _call_item(call, status: str = "completed") -> dict:
    return {"id": new_id("fc"), "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}


def reasoning_tokens(c: Choice) -> int:
    """Output tokens of the reasoning block, its tags included (the handle's text is final once done)."""
    return c.handle.text.reasoning_tokens


async def respond(c: Choice, request: Request, reply: Reply, shape: Shape, store: Store, items: list[dict]):
    """`items`: the items a continuation of this response starts from before its output (the earlier response's,
    then this request's input). The blocking reply is built by the stream's own machinery, so both carry the same
    items."""
    if reply.stream:
        return sse_response(_stream(c, shape, store, items))
    evs = _Events(c)
    try:
        async for ev in _events(c.handle, request):
            if ev[0] == "error":
                raise ev[1]
            if ev[0] == "delta":
                evs.chunks(*ev[1:5])
            elif ev[0] == "done":
                body = _done(evs, shape, store, items, *ev[1:])[1]
    except ClientGone:
        return Response(status_code=499)
    except P.ApiError as e:
        return JSONResponse(e.body(), status_code=e.status)
    return JSONResponse(body)


def _done(evs: _Events, shape: Shape, store: Store, items: list[dict], finish: str, use: dict) -> tuple[list, dict]:
    """The last events of a finished reply and its response object (stored when asked)."""
    out = evs.finish(finish)
    status = _status(finish)
    body = shape.body(status, evs.output, shape.usage(use["completion_tokens"], reasoning_tokens(evs.c),
                                                      B.cached_tokens(use)), finish)
    _store(store, shape, body, items, evs.output)
    return out + [evs.ev(f"response.{status}", response=body)], body


def _store(store: Store, shape: Shape, body: dict, items: list[dict], output: list[dict]) -> None:
    if shape.req.store:
        own = items[len(items) - len(input_items(shape.req)):]
        store.put(body, own, items + output)


def _sse(obj: dict) -> bytes:
    return f"event: {obj['type']}\ndata: ".encode() + \
        json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class _Events:
    """The stream's numbered events and its output items: the open item (reasoning or message) takes text deltas
    of its kind; another kind closes it and opens the next."""

    def __init__(self, c: Choice):
        self.c, self.seq, self.output = c, 0, []
        self.kind: str | None = None
        self.text, self.lps, self.pending = "", [], []

    def ev(self, kind: str, **fields) -> bytes:
        self.seq += 1
        return _sse({"type": kind, "sequence_number": self.seq - 1, **fields})

    def _at(self) -> dict:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def open(self, kind: str) -> list[bytes]:
        out = self.close() if self.kind is not None else []
        self.kind, self.text, self.lps = kind, "", []
        if kind == "reasoning":
            item, part = _reasoning_item(new_id("rs"), "", "in_progress"), {"type": "reasoning_text", "text": ""}
        else:
            item, part = _message_item(new_id("msg"), [], "in_progress"), _text_part("", None)
        self.output.append(item)
        return out + [self.ev("response.output_item.added", output_index=len(self.output) - 1, item=item),
                      self.ev("response.content_part.added", **self._at(), content_index=0, part=part)]

    def delta(self, kind: str, text: str, lps: list | None = None) -> list[bytes]:
        out = self.open(kind) if self.kind != kind else []
        self.text += text
        if kind == "reasoning":
            return out + [self.ev("response.reasoning_text.delta", **self._at(), content_index=0, delta=text)]
        self.lps += lps or []
        return out + [self.ev("response.output_text.delta", **self._at(), content_index=0, delta=text,
                              logprobs=lps or [])]

    def close(self, status: str = "completed") -> list[bytes]:
        kind, self.kind = self.kind, None
        if kind == "reasoning":
            item = _reasoning_item(self.output[-1]["id"], self.text, status)
            done, part = self.ev("response.reasoning_text.done", **self._at(), content_index=0, text=self.text), \
                {"type": "reasoning_text", "text": self.text}
        else:
            part = _text_part(self.text, self.lps)
            item = _message_item(self.output[-1]["id"], [part], status)
            done = self.ev("response.output_text.done", **self._at(), content_index=0, text=self.text,
                           logprobs=self.lps)
        self.output[-1] = item
        return [done, self.ev("response.content_part.done", **self._at(), content_index=0, part=part),
                self.ev("response.output_item.done", output_index=len(self.output) - 1, item=item)]

    def call(self, call) -> list[bytes]:
        out = self.close() if self.kind is not None else []
        item = _call_item(call, "in_progress")
        self.output.append(item)
        done = dict(item, arguments=call.arguments, status="completed")
        out += [self.ev("response.output_item.added", output_index=len(self.output) - 1, item=item),
                self.ev("response.function_call_arguments.delta", **self._at(), delta=call.arguments),
                self.ev("response.function_call_arguments.done", **self._at(), name=call.name,
                        arguments=call.arguments),
                self.ev("response.output_item.done", output_index=len(self.output) - 1, item=done)]
        self.output[-1] = done
        return out

    def chunks(self, reasoning: str, content: str, lps=None, n_reasoning: int = 0) -> list[bytes]:
        """One delta event. Logprobs are the answer's tokens' (after the `n_reasoning` of the think block), held
        until their text is released as message text; those of text that becomes a call are dropped."""
        if lps and self.c.logprobs is not None:
            self.pending += self.c.logprobs.format(lps[n_reasoning:])["content"]
        out = self.delta("reasoning", reasoning) if reasoning else []
        calls = []
        if self.c.tools is not None:
            content, calls = self.c.tools.feed(content)
        if content:
            out += self.delta("message", content, self.pending)
            self.pending = []
        for call in calls:
            self.pending = []
            out += self.call(call)
        return out

    def finish(self, finish: str) -> list[bytes]:
        rest = self.c.tools.finish() if self.c.tools is not None else ""
        out = self.delta("message", rest, self.pending) if rest else []
        if finish != "length" and not any(i["type"] in ("message", "function_call") for i in self.output):
            out += self.open("message")             # an answer with no text and no call: an empty message
        return out + (self.close(_status(finish)) if self.kind is not None else [])


async def _stream(c: Choice, shape: Shape, store: Store, items: list[dict]):
    evs = _Events(c)
    yield evs.ev("response.created", response=shape.body("in_progress", [], None))
    yield evs.ev("response.in_progress", response=shape.body("in_progress", [], None))
    try:
        async for ev in _events(c.handle, None):
            if ev[0] == "error":
                yield _failed(evs, shape, ev[1])
                return
            if ev[0] == "delta":
                out = evs.chunks(*ev[1:5])
            else:
                out = _done(evs, shape, store, items, *ev[1:])[0] if ev[0] == "done" else []
            for b in out:
                yield b
    except Exception as e:       # a bug: the client still gets a failed response, not a stream that just stops
        traceback.print_exc(file=sys.stderr)
        yield _failed(evs, shape, P.ApiError(500, f"internal server error: {type(e).__name__}", type="server_error",
                                             code="internal_error"))
    finally:
        c.handle.cancel()


def _failed(evs: _Events, shape: Shape, e: P.ApiError) -> bytes:
    # OpenAI's codes: the prompt's fault, or the server's
    code = "server_error" if e.status >= 500 else "invalid_prompt"
    body = dict(shape.body("failed", evs.output, None), error={"code": code, "message": e.message})
    return evs.ev("response.failed", response=body)
