"""Replies: the engine's events of a request's n choices (one engine request each) merged into one OpenAI body,
or one SSE stream whose chunks name their choice by `index`.

Every flow cancels its requests when the client goes away: a streaming response is cancelled by Starlette on
`http.disconnect` (the generator's `finally` runs), a non-streaming one polls for it. One choice failing fails
the reply and cancels the others. Usage counts the prompt once and every choice's tokens.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
import traceback
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import bodies as B
from . import protocol as P
from .protocol import ApiError
from .logprobs_api import LogprobFormat
from .tool_calls import ToolParser

DISCONNECT_POLL_S = 0.25


@dataclass
class Choice:
    """One choice: its engine request, its logprobs formatter and its tool-call parser (None: not asked for)."""
    handle: object
    logprobs: LogprobFormat | None = None
    tools: ToolParser | None = None


def _finish_reason(c: Choice, finish: str) -> str:
    """A chat answer that made calls and ended by itself finishes with "tool_calls", as OpenAI's does."""
    return "tool_calls" if c.tools is not None and c.tools.calls and finish == "stop" else finish


@dataclass
class Reply:
    rid: str                                 # the response id the client sees (request logs name it too)
    chat: bool
    model: str
    stream: bool = False
    include_usage: bool = False
    fingerprint: str | None = None
    echo: tuple[str, int] | None = None      # completions' echo: (prompt text, first prompt token)
    prompt_logprobs: LogprobFormat | None = None     # vLLM's prompt_logprobs: their formatter (its top k)
    token_ids: bool = False                  # vLLM's return_tokens_as_token_ids: logprobs name "token_id:N"
    chat_echo: str = ""                      # vLLM's chat echo: text the reply's content starts with
    continuous_usage: bool = False           # vLLM's stream_options.continuous_usage_stats


class ClientGone(Exception):
    """The client disconnected before a non-streaming reply was ready."""


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def total_usage(uses: list[dict]) -> dict:
    return B.usage(uses[0]["prompt_tokens"], sum(u["completion_tokens"] for u in uses), B.cached_tokens(uses[0]))


async def respond(choices: list[Choice], request: Request, reply: Reply):
    rid = reply.rid
    if reply.stream:
        chunks = B.Chunks(rid, reply.model, chat=reply.chat, include_usage=reply.include_usage, fp=reply.fingerprint,
                          continuous=reply.continuous_usage)
        return sse_response(_stream(choices, chunks, reply.echo, reply.chat_echo))
    tasks = [asyncio.ensure_future(_collect(c, request)) for c in choices]
    try:
        got = await asyncio.gather(*tasks)
    except ClientGone:
        return Response(status_code=499)       # nobody reads it; nginx's "client closed request"
    finally:
        for t, c in zip(tasks, choices):       # a failed choice: the others stop too
            t.cancel()
            c.handle.cancel()                  # also where a task never started (idempotent)
    bodies = [g.choice(i, c, reply) for i, (c, g) in enumerate(zip(choices, got))]
    body = B.reply_body(rid, reply.model, reply.chat, bodies, total_usage([g.use for g in got]), reply.fingerprint)
    if reply.prompt_logprobs is not None:      # vLLM: per choice on completions, once for the chat reply
        if reply.chat:
            body["prompt_logprobs"] = reply.prompt_logprobs.vllm_prompt(got[0].prompt_lps)
        for b, g in zip(bodies, got if not reply.chat else ()):
            b["prompt_logprobs"] = reply.prompt_logprobs.vllm_prompt(g.prompt_lps)
    return JSONResponse(body)


def sse_response(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def collect_one(c: Choice, request: Request, error_body) -> _Collected | Response:
    """One choice's whole answer, or the response to send instead: 499 when the client left, the error's body
    (`error_body(ApiError)`: the API's own shape) when the request failed."""
    try:
        return await _collect(c, request)
    except ClientGone:
        return Response(status_code=499)
    except ApiError as e:
        return JSONResponse(error_body(e), status_code=e.status)
    finally:
        c.handle.cancel()


@dataclass
class _Collected:
    reasoning: list = field(default_factory=list)
    content: list = field(default_factory=list)
    lps: list = field(default_factory=list)
    prompt_lps: list = field(default_factory=list)
    finish: str | None = None
    use: dict | None = None

    def choice(self, index: int, c: Choice, reply: Reply) -> dict:
        fmt = c.logprobs
        head = fmt.format_prompt(reply.echo[1], self.prompt_lps) if fmt is not None and reply.echo else None
        lp = fmt.format(self.lps) if fmt is not None else None
        if reply.chat:
            content, calls = "".join(self.content), None
            if c.tools is not None:            # the same parser a stream uses, over the whole answer
                content = c.tools.parse_all(content)
                calls = [t.api(i) for i, t in enumerate(c.tools.calls)]
            return B.chat_choice(index, reply.chat_echo + content, "".join(self.reasoning),
                                 _finish_reason(c, self.finish), lp, calls)
        lp = {k: head[k] + lp[k] for k in lp} if head else lp
        text = (reply.echo[0] if reply.echo else "") + "".join(self.content)
        return B.completion_choice(index, text, self.finish, lp)


async def _collect(c: Choice, request: Request) -> _Collected:
    out = _Collected()
    async for ev in _events(c.handle, request):
        if ev[0] == "delta":
            out.reasoning.append(ev[1])
            out.content.append(ev[2])
            out.lps += ev[3] or []
        elif ev[0] == "prompt":
            out.prompt_lps = ev[1]
        elif ev[0] == "error":
            raise ev[1]
        else:
            _, out.finish, out.use = ev
    return out


async def _events(handle, request: Request | None):
    """Yield the request's events; cancel it in the engine if the consumer stops early or the client leaves.

    With `request`, the client's connection is polled every DISCONNECT_POLL_S (events may keep coming
    faster than that, so the poll is by time, not by idle waits).
    """
    checked = time.monotonic()
    try:
        while True:
            if request is None:
                ev = await handle.next_event()
            else:
                ev = await _next_or_disconnect(handle, request, checked)
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    if await request.is_disconnected():
                        raise ClientGone()
                    checked = time.monotonic()
            yield ev
            if ev[0] not in ("delta", "prompt"):
                return
    finally:
        handle.cancel()


async def _next_or_disconnect(handle, request: Request, checked: float):
    get = asyncio.ensure_future(handle.next_event())
    try:
        while True:
            wait = max(0.0, DISCONNECT_POLL_S - (time.monotonic() - checked))
            done, _ = await asyncio.wait({get}, timeout=wait)
            if done:
                return get.result()
            if await request.is_disconnected():
                raise ClientGone()
            checked = time.monotonic()
    finally:
        if not get.done():
            get.cancel()


async def _pump(i: int, c: Choice, queue: asyncio.Queue) -> None:
    try:
        async for ev in _events(c.handle, None):
            await queue.put((i, ev))
    except Exception as e:        # a bug: the stream must not wait for this choice forever
        traceback.print_exc(file=sys.stderr)
        await queue.put((i, ("error", P.ApiError(500, f"internal server error: {type(e).__name__}",
                                                  type="server_error", code="internal_error"))))


async def _stream(choices: list[Choice], chunks: B.Chunks, echo: tuple[str, int] | None, chat_echo: str = ""):
    """The choices' chunks in the order their events come; each choice's echo first, its finish chunk last; the
    usage chunk (if asked) once every choice is done. An error ends the stream (then [DONE])."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(i, c, queue)) for i, c in enumerate(choices)]
    echoing, uses = set(range(len(choices))) if echo else set(), {}
    for i, c in enumerate(choices if chunks.continuous else ()):
        chunks.running[i] = B.usage(c.handle.prompt_len, 0, c.handle.cached)
    try:
        if chunks.chat:
            for i in range(len(choices)):
                yield _sse(chunks.delta({"role": "assistant", "content": ""}, index=i))
                if chat_echo:
                    yield _sse(chunks.delta({"content": chat_echo}, index=i))
        while len(uses) < len(choices):
            i, ev = await queue.get()
            fmt = choices[i].logprobs
            if i in echoing and ev[0] != "error":     # the prompt first (with its logprobs when they come)
                head = fmt.format_prompt(echo[1], ev[1]) if fmt is not None and ev[0] == "prompt" else None
                yield _sse(chunks.delta(echo[0], logprobs=head, index=i))
                echoing.discard(i)
            if ev[0] == "delta":
                if chunks.continuous:
                    h = choices[i].handle
                    chunks.running[i] = B.usage(h.prompt_len, ev[5], h.cached)
                content, calls = _tool_split(choices[i].tools, ev[2])
                chunk = _delta(chunks, ev[1], content, fmt.format(ev[3]) if fmt is not None and ev[3] else None, i,
                               calls)
                if chunk is not None:
                    yield _sse(chunk)
            elif ev[0] == "error":     # headers are sent: the error travels as an SSE event, then [DONE]
                yield _sse(ev[1].body())
                break
            elif ev[0] == "done":
                _, finish, uses[i] = ev
                chunks.running[i] = uses[i]
                rest = choices[i].tools.finish() if choices[i].tools is not None else ""
                if rest:
                    yield _sse(chunks.delta({"content": rest}, index=i))
                yield _sse(chunks.delta({} if chunks.chat else "", _finish_reason(choices[i], finish), index=i))
        else:
            if chunks.include_usage:
                yield _sse(chunks.usage(total_usage([uses[i] for i in range(len(choices))])))
    finally:
        for t, c in zip(tasks, choices):
            t.cancel()
            c.handle.cancel()                  # also where a task never started (idempotent)
    yield b"data: [DONE]\n\n"


def _tool_split(parser: ToolParser | None, content: str) -> tuple[str, list[dict]]:
    """A delta's answer text -> (content to send, tool_calls entries completed by it)."""
    if parser is None:
        return content, []
    done = len(parser.calls)
    text, new = parser.feed(content)
    return text, [t.api(done + k) for k, t in enumerate(new)]


def _delta(chunks: B.Chunks, reasoning: str, content: str, lp: dict | None, index: int,
           calls: list[dict] = ()) -> dict | None:
    """The chunk of one delta event; None when a completion stream has neither text nor logprobs to send."""
    if not chunks.chat:
        return chunks.delta(content, logprobs=lp, index=index) if content or lp else None
    delta = {"reasoning_content": reasoning} if reasoning else {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = list(calls)
    if not delta and lp is None:          # the tool parser holds this text back for now
        return None
    return chunks.delta(delta, logprobs=lp, index=index)
