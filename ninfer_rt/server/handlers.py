"""Completion request flows: prompt building, sampling parameters, SSE streaming and non-streaming replies.

Both flows cancel their request when the client goes away: a streaming response is cancelled by
Starlette on `http.disconnect` (the generator's `finally` runs), a non-streaming one polls for it.
"""
from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..sampling import SamplingError, SamplingParams
from ..tokenizer import ChatTemplateError, TokenizerError
from . import protocol as P
from .logprobs_api import LogprobFormat, requested
from .reasoning import ReasoningSplitter, prompt_think_state

DISCONNECT_POLL_S = 0.25
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "seed")
# keyword names the template call itself uses; a client may not override them through chat_template_kwargs
_RESERVED_TEMPLATE_KW = {"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"}


def sampling_defaults(generation_config: dict) -> dict:
    """The model's generation_config.json sampling values, used where a request leaves a field out."""
    return {k: generation_config[k] for k in ("temperature", "top_p", "top_k", "min_p")
            if isinstance(generation_config.get(k), (int, float)) and not isinstance(generation_config.get(k), bool)}


def sampling_params(req: P._Sampling, defaults: dict, max_tokens: int, stop_ids=(), vocab: int | None = None
                    ) -> SamplingParams:
    """`stop_ids`: the tokenizer's stop ids (e.g. `<|im_end|>`), which the engine's config eos may lack; `vocab`
    bounds logit_bias's token ids."""
    kw = {}
    for name in SAMPLING_FIELDS:
        v = getattr(req, name)
        v = defaults.get(name) if v is None else v
        if v is not None:
            kw[name] = v
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    lp, plp = requested(req, isinstance(req, P.ChatRequest))
    try:
        return SamplingParams(max_tokens=max_tokens, stop=tuple(stop), ignore_eos=req.ignore_eos,
                              stop_token_ids=() if req.ignore_eos else tuple(sorted(stop_ids)),
                              logprobs=lp, prompt_logprobs=plp, logit_bias=_logit_bias(req, vocab), **kw)
    except SamplingError as e:
        msg = str(e)
        raise P.bad_request(msg, param=msg.split(":", 1)[0]) from None


def _logit_bias(req: P._Sampling, vocab: int | None) -> dict:
    """OpenAI's {"token id": bias} -> {id: bias}; keys that are not token ids of this model are the client's 400."""
    out = {}
    for key, bias in (req.logit_bias or {}).items():
        t = int(key) if isinstance(key, str) and key.strip().isdigit() else None
        if t is None or (vocab is not None and t >= vocab):
            raise P.bad_request(f"logit_bias: keys must be token ids in [0, {vocab}), got {key!r}", param="logit_bias")
        out[t] = bias
    return out


def chat_prompt(tok, req: P.ChatRequest) -> list[int]:
    extra = dict(req.chat_template_kwargs or {})
    bad = sorted(k for k in extra if not isinstance(k, str) or k in _RESERVED_TEMPLATE_KW)
    if bad:
        raise P.bad_request(f"chat_template_kwargs: {bad[0]!r} cannot be set here", param="chat_template_kwargs")
    try:
        text = tok.render_chat(P.chat_messages(req), add_generation_prompt=True, **extra)
    except ChatTemplateError as e:     # the artifact's template is broken: the server's fault, not the request's
        raise P.ApiError(500, str(e), type="server_error", code="chat_template_error") from None
    except TokenizerError as e:        # the template's raise_exception refused these messages
        raise P.bad_request(str(e), param="messages") from None
    return tok.encode(text)


def completion_prompt(tok, req: P.CompletionRequest, vocab: int) -> list[int]:
    p = req.prompt
    if isinstance(p, list) and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return tok.encode(p)
    bad = next((t for t in p if not 0 <= t < vocab), None)
    if bad is not None:
        raise P.bad_request(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
    return list(p)


def prompt_text(tok, req: P.CompletionRequest, ids: list[int]) -> str:
    """What `echo` repeats: the prompt as sent, or the text of a token-id prompt (special tokens kept)."""
    p = req.prompt[0] if isinstance(req.prompt, list) and isinstance(req.prompt[0], (str, list)) else req.prompt
    return p if isinstance(p, str) else tok.decode(ids, skip_special_tokens=False)


def splitter(tok, prompt_ids: list[int]) -> ReasoningSplitter:
    start, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    return ReasoningSplitter(start, end, prompt_think_state(prompt_ids, start, end, tok.token_to_id("<|im_start|>")))


# ---- replies ----

class ClientGone(Exception):
    """The client disconnected before a non-streaming reply was ready."""


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


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


async def respond(handle, request: Request, *, chat: bool, model: str, stream: bool, include_usage: bool,
                  fingerprint: str | None = None, logprobs: LogprobFormat | None = None,
                  echo: tuple[str, int] | None = None):
    """logprobs: the request's formatter when it asked for logprobs (the engine then sends them with its tokens);
    echo: completions' (prompt text, first prompt token), which the reply starts with (and its logprobs, if any)."""
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    if stream:
        chunks = P.Chunks(rid, model, chat=chat, include_usage=include_usage, fp=fingerprint)
        return StreamingResponse(_stream(handle, chunks, logprobs, echo), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    reasoning, content, lps, prompt_lps = [], [], [], []
    try:
        async for ev in _events(handle, request):
            if ev[0] == "delta":
                reasoning.append(ev[1])
                content.append(ev[2])
                lps += ev[3] or []
            elif ev[0] == "prompt":
                prompt_lps = ev[1]
            elif ev[0] == "error":
                raise ev[1]
            else:
                _, finish, use = ev
    except ClientGone:
        return Response(status_code=499)       # nobody reads it; nginx's "client closed request"
    head = logprobs.format_prompt(echo[1], prompt_lps) if logprobs is not None and echo else None
    lp = logprobs.format(lps) if logprobs is not None else None
    if chat:
        body = P.chat_response(rid, model, "".join(content), "".join(reasoning), finish, use, fingerprint, lp)
    else:
        lp = {k: head[k] + lp[k] for k in lp} if head else lp
        text = (echo[0] if echo else "") + "".join(content)
        body = P.completion_response(rid, model, text, finish, use, fingerprint, lp)
    return JSONResponse(body)


def _delta(chunks: P.Chunks, reasoning: str, content: str, lp: dict | None) -> dict | None:
    """The chunk of one delta event; None when a completion stream has neither text nor logprobs to send."""
    if not chunks.chat:
        return chunks.delta(content, logprobs=lp) if content or lp else None
    delta = {"reasoning_content": reasoning} if reasoning else {}
    if content:
        delta["content"] = content
    return chunks.delta(delta, logprobs=lp)


async def _stream(handle, chunks: P.Chunks, logprobs: LogprobFormat | None, echo: tuple[str, int] | None):
    if chunks.chat:
        yield _sse(chunks.delta({"role": "assistant", "content": ""}))
    async for ev in _events(handle, None):
        if echo is not None and ev[0] != "error":     # the prompt first (with its logprobs when they come)
            head = logprobs.format_prompt(echo[1], ev[1]) if logprobs is not None and ev[0] == "prompt" else None
            yield _sse(chunks.delta(echo[0], logprobs=head))
            echo = None
        if ev[0] == "delta":
            lp = logprobs.format(ev[3]) if logprobs is not None and ev[3] else None
            chunk = _delta(chunks, ev[1], ev[2], lp)
            if chunk is not None:
                yield _sse(chunk)
        elif ev[0] == "error":       # headers are sent: the error travels as an SSE event, then [DONE]
            yield _sse(ev[1].body())
        elif ev[0] == "done":
            _, finish, use = ev
            yield _sse(chunks.delta({} if chunks.chat else "", finish))
            if chunks.include_usage:
                yield _sse(chunks.usage(use))
    yield b"data: [DONE]\n\n"
