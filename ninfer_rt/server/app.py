"""FastAPI app factory: routes, API-key guard, body cap, OpenAI-style errors.

The app exists before the model: `/health` answers 503 until `ServerState.ready()` is called with a
scheduler, and the completion routes answer 503 meanwhile. Bodies are read by the handlers themselves
(capped, then `json.loads`) so every malformed request gets an OpenAI error body instead of FastAPI's 422.
"""
from __future__ import annotations

import hashlib
import hmac
import importlib.metadata
import json
import time
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..sampling import MAX_SEED
from . import anthropic_api as A
from . import anthropic_replies as AR
from . import bodies as B
from . import handlers as H
from . import protocol as P
from . import replies as R
from . import responses_api as RA
from . import responses_replies as RR
from . import tokenize_api as T
from .images import image_prompt
from .logprobs_api import LogprobFormat
from .metrics import ServerMetrics
from .runtime import DEFAULT_VISION_TOKENS
from .tool_calls import ToolParser

MAX_BODY_BYTES = 4 << 20
BIG_BODY_BYTES = 1 << 20
UNGUARDED = ("/health", "/version")
ANTHROPIC_PREFIX = "/v1/messages"


@dataclass
class ServerState:
    model_id: str
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    scheduler: object | None = None        # set by ready(); None while loading
    tokenizer: object | None = None
    vocab_size: int = 0
    defaults: dict = field(default_factory=dict)
    vision: object | None = None           # VisionRuntime with --vision; None: image parts are a 400
    vision_max_tokens: int = DEFAULT_VISION_TOKENS   # image tokens per request (--vision-max-tokens)
    load_error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    fingerprint: str = ""                  # system_fingerprint of every reply; derived from model_id if empty
    responses: RA.Store = field(default_factory=RA.Store)    # stored Responses API responses (in memory)
    allowed_origins: tuple[str, ...] = ()  # CORS: the origins browsers may call from ("*": any); () = no CORS
    aliases: tuple[str, ...] = ()          # more names requests may use (vLLM's extra --served-model-name values)

    def __post_init__(self):
        if not self.fingerprint:
            self.fingerprint = _fingerprint(self.model_id)

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a request's `model` may carry; replies name the first (vLLM's rule)."""
        return (self.model_id, *self.aliases)

    def ready(self, scheduler, tokenizer, vocab_size: int, generation_config: dict, *, vision=None,
              vision_max_tokens: int = DEFAULT_VISION_TOKENS) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.defaults = H.sampling_defaults(generation_config)
        self.vision, self.vision_max_tokens = vision, vision_max_tokens
        self.scheduler = scheduler       # last: the routes test this one

    def serving(self):
        if self.scheduler is None:
            raise P.ApiError(503, self.load_error or "the model is still loading", type="server_error",
                             code="model_loading" if self.load_error is None else "model_load_failed")
        return self.scheduler


def _version() -> str:
    try:
        return importlib.metadata.version("ninfer")
    except importlib.metadata.PackageNotFoundError:
        return "dev"


def _fingerprint(model_id: str) -> str:
    """OpenAI's `system_fingerprint`: changes when the serving software or the served model does."""
    return "fp_" + hashlib.sha256(f"{_version()}\0{model_id}".encode()).hexdigest()[:12]


class _Guard:
    """Pure ASGI middleware (streaming and disconnects pass through untouched): API key and Content-Length."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state
        self.key = state.api_key.encode() if state.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        err = self._check(scope, headers)
        if err is not None:
            self.state.metrics.errors.labels(status=str(err.status)).inc()
            return await _error(err, scope.get("path", ""))(scope, receive, send)
        return await self.app(scope, receive, send)

    def _check(self, scope, headers) -> P.ApiError | None:
        if self.key is not None and scope.get("path") not in UNGUARDED:
            auth = headers.get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(token, self.key):
                return P.ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                  type="invalid_request_error", code="invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return P.bad_request("invalid Content-Length header")
            if n > self.state.max_body_bytes:
                return _too_large(self.state.max_body_bytes)
        return None


def _too_large(cap: int) -> P.ApiError:
    return P.ApiError(413, f"request body exceeds {cap} bytes", code="request_too_large")


def _error(e: P.ApiError, path: str = "") -> JSONResponse:
    """OpenAI's error body, or Anthropic's on the Messages routes (their clients read that shape)."""
    anthropic = path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")
    return JSONResponse(A.error_body(e) if anthropic else e.body(), status_code=e.status)


async def read_json(request: Request, cap: int):
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > cap:           # chunked uploads carry no Content-Length for the guard to check
            raise _too_large(cap)
    try:
        if len(body) > BIG_BODY_BYTES:     # image data URIs: parse off the event loop, streams keep flowing
            return await run_in_threadpool(json.loads, bytes(body))
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise P.bad_request(f"request body is not valid JSON ({e})") from None


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="ninfer-rt", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ninfer = state

    @app.exception_handler(P.ApiError)
    async def _api_error(request, e: P.ApiError):
        state.metrics.errors.labels(status=str(e.status)).inc()
        return _error(e, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        kind = "not_found" if e.status_code == 404 else "method_not_allowed" if e.status_code == 405 else None
        state.metrics.errors.labels(status=str(e.status_code)).inc()
        resp = _error(P.ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=kind),
                      request.url.path)
        resp.headers.update(e.headers or {})          # a 405 names the allowed methods in `Allow`
        return resp

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):
        # a bug, not a client error: keep the OpenAI error shape; Starlette still logs the traceback
        state.metrics.errors.labels(status="500").inc()
        return _error(P.ApiError(500, f"internal server error: {type(e).__name__}", type="server_error",
                                 code="internal_error"), request.url.path)

    @app.get("/health")
    async def health():
        if state.scheduler is None:
            status = "error" if state.load_error else "loading"
            return JSONResponse({"status": status, "detail": state.load_error}, status_code=503)
        if not state.scheduler.healthy():
            return JSONResponse({"status": "error", "detail": "the engine can no longer step"}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():                 # vLLM's
        return {"version": _version()}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(state, name) for name in state.names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in state.names:
            raise P.ApiError(404, f"model {model_id!r} does not exist", param="model", code="model_not_found")
        return _model_card(state, model_id)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _complete(state, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(state, request, chat=False)

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await _messages(state, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return await _count_tokens(state, request)

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await _responses(state, request)

    @app.post("/v1/responses/input_tokens")
    async def response_input_tokens(request: Request):
        return await _responses(state, request, count=True)

    @app.get("/v1/responses/{rid}")
    async def stored_response(rid: str):
        return state.responses.get(rid)[0]

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str):
        state.responses.delete(rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}

    @app.get("/v1/responses/{rid}/input_items")
    async def input_items(rid: str, request: Request):
        return RA.listing(state.responses.get(rid)[1], request.query_params)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        sched = state.serving()
        data = await read_json(request, state.max_body_bytes)
        return T.tokenize(state.tokenizer, data, state.names, sched.max_context)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        reset = getattr(state.serving().engine, "reset_prefix_cache", None)
        if reset is None or not reset():
            raise P.ApiError(400, "the prefix cache is off (the server runs with --no-enable-prefix-caching)")
        return {}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        state.serving()
        data = await read_json(request, state.max_body_bytes)
        return T.detokenize(state.tokenizer, data, state.names)

    app.add_middleware(_Guard, state=state)
    if state.allowed_origins:       # added last, so outermost: a preflight is answered before the API-key check
        app.add_middleware(CORSMiddleware, allow_origins=list(state.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    return app


def _model_card(state: ServerState, name: str) -> dict:
    card = {"id": name, "object": "model", "created": state.created, "owned_by": "ninfer"}
    if state.scheduler is not None:
        card["max_model_len"] = state.scheduler.max_context
    return card


async def _complete(state: ServerState, request: Request, *, chat: bool):
    sched = state.serving()
    data = await read_json(request, state.max_body_bytes)
    req = P.parse(P.ChatRequest if chat else P.CompletionRequest, data)
    P.check_model(req.model, state.names)
    ids, img, params = await _prepare(state, sched, req, chat)
    tok = state.tokenizer
    usage_chunk = bool(req.stream_options and req.stream_options.include_usage)
    reply = R.Reply(B.new_id("chatcmpl" if chat else "cmpl"), chat, state.model_id, bool(req.stream), usage_chunk,
                    state.fingerprint, (H.prompt_text(tok, req, ids), ids[0]) if not chat and req.echo else None,
                    LogprobFormat(tok, chat=True, top=req.prompt_logprobs) if req.prompt_logprobs is not None else None,
                    token_ids=req.return_tokens_as_token_ids, chat_echo=P.chat_echo(req) if chat else "",
                    continuous_usage=usage_chunk and req.stream_options.continuous_usage_stats)
    return await R.respond(_submit(sched, tok, req.n or 1, ids, img, params, reply, *_tools(req, chat),
                                   priority=req.priority), request, reply)


def _tools(req, chat: bool) -> tuple[list[dict] | None, bool]:
    """(the tools to parse calls of, or None; whether several calls may be kept)."""
    if not chat or not P.parses_tools(req):
        return None, True
    return P.template_tools(req), req.parallel_tool_calls is not False


async def _prepare(state: ServerState, sched, req, chat: bool):
    """-> (prompt ids, ImagePrompt or None, SamplingParams) of a parsed chat or completion request."""
    tok, img = state.tokenizer, None
    if chat:
        ids = H.chat_prompt(tok, req)
        img = await image_prompt(state.vision, state.vision_max_tokens, req.messages, ids)
    else:
        ids = H.completion_prompt(tok, req, state.vocab_size)
    if req.truncate_prompt_tokens is not None:
        ids = H.truncated(ids, req.truncate_prompt_tokens, sched.max_context, img)
    by_mct = chat and req.max_completion_tokens is not None
    requested = req.max_completion_tokens if by_mct else req.max_tokens
    n_prompt = len(img.request) if img is not None else len(ids)     # image placeholders expanded
    max_tokens = sched.max_tokens_for(n_prompt, requested, "messages" if chat else "prompt",
                                      "max_completion_tokens" if by_mct else "max_tokens")
    params = H.sampling_params(req, state.defaults, max_tokens, tok.stop_ids, state.vocab_size, tok)
    await H.check_grammar(sched.engine, req, params)
    if chat:
        params = H.after_reasoning(tok, ids, params)
    return ids, img, params


async def _messages(state: ServerState, request: Request):
    """Anthropic's `POST /v1/messages` (anthropic_api.py): the chat path under Anthropic's names and shapes."""
    sched = state.serving()
    areq = A.parse(await read_json(request, state.max_body_bytes))
    P.check_model(areq.model, state.names)
    req, names = A.to_chat_named(areq)
    try:
        ids, img, params = await _prepare(state, sched, req, True)
    except P.ApiError as e:
        raise A.renamed(e, names) from None
    reply = R.Reply(AR.new_id(), True, state.model_id, bool(req.stream))
    (choice,) = _submit(sched, state.tokenizer, 1, ids, img, params, reply, *_tools(req, True))
    return await AR.respond(choice, request, reply, len(img.request) if img else len(ids))


async def _responses(state: ServerState, request: Request, count: bool = False):
    """OpenAI's `POST /v1/responses` (responses_api.py): the chat path under the Responses API's names and shapes;
    `count`: `POST /v1/responses/input_tokens`, the prompt's length only."""
    sched = state.serving()
    rreq = RA.parse(await read_json(request, state.max_body_bytes))
    P.check_model(rreq.model, state.names)
    earlier = state.responses.continuation(rreq.previous_response_id) if rreq.previous_response_id else []
    req, names = RA.to_chat(rreq, earlier)
    try:
        if count:
            return {"object": "response.input_tokens", "input_tokens": await _prompt_tokens(state, req)}
        ids, img, params = await _prepare(state, sched, req, True)
    except P.ApiError as e:
        raise RA.renamed(e, names) from None
    reply = R.Reply(RR.new_id(), True, state.model_id, bool(req.stream))
    (choice,) = _submit(sched, state.tokenizer, 1, ids, img, params, reply, *_tools(req, True))
    shape = RR.Shape(reply, rreq, len(img.request) if img else len(ids))
    return await RR.respond(choice, request, reply, shape, state.responses, earlier + RA.input_items(rreq))


async def _count_tokens(state: ServerState, request: Request):
    state.serving()
    areq = A.parse(await read_json(request, state.max_body_bytes), A.CountRequest)
    P.check_model(areq.model, state.names)
    req, names = A.to_chat_named(areq)
    try:
        return {"input_tokens": await _prompt_tokens(state, req)}
    except P.ApiError as e:
        raise A.renamed(e, names) from None


async def _prompt_tokens(state: ServerState, req: P.ChatRequest) -> int:
    """A chat request's prompt length, image tokens included (nothing is queued)."""
    ids = H.chat_prompt(state.tokenizer, req)
    img = await image_prompt(state.vision, state.vision_max_tokens, req.messages, ids)
    return len(img.request) if img else len(ids)


def _submit(sched, tok, n: int, ids: list[int], img, params, reply: R.Reply, tools: list[dict] | None = None,
            parallel_calls: bool = True, priority: int = 0) -> list[R.Choice]:
    """n choices: n engine requests queued together (all or none); a seed gives each its own, reproducibly."""
    if n > sched.cfg.max_pending:        # a 429 would invite retries that can never fit
        raise P.bad_request(f"n: {n} choices exceed the server's queue of {sched.cfg.max_pending} (--max-pending)",
                            param="n")
    choices = []
    for i in range(n):
        p = params if i == 0 or params.seed is None else replace(params, seed=(params.seed + i) % (MAX_SEED + 1))
        h = sched.handle(ids, p, H.splitter(tok, ids) if reply.chat else None, vision=img.request if img else None,
                         image_tokens=img.image_tokens if img else 0, keep_special=tools is not None,
                         priority=priority)
        h.reply_id, h.choice = reply.rid, i
        fmt = LogprobFormat(tok, chat=reply.chat, top=p.logprobs, as_ids=reply.token_ids) \
            if p.logprobs is not None else None
        choices.append(R.Choice(h, fmt, ToolParser(tools, parallel_calls) if tools is not None else None))
    sched.submit_all([c.handle for c in choices])
    return choices
