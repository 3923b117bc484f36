"""`ninfer-rt serve`: the OpenAI-compatible server against the official `openai` client on loopback.

Most tests drive the real Engine on a tiny fp32 artifact (packed once per session); scheduler edge cases
(admission under a tiny KV pool, queue limits, engine failures) use `FakeEngine`, a deterministic stand-in
with the Engine's interface and its own page accounting.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import hf_tiny
import httpx
import pytest

from ninfer_rt.server import ServerState, create_app
from ninfer_rt.server.scheduler import Scheduler, SchedulerConfig
from ninfer_rt.tokenizer import Tokenizer

MODEL_ID = "tiny-test"
CTX = 256                      # per-request context of the real-engine servers
DRAFT_TOKENS = 2               # the real-engine server runs MTP speculative decoding
_ARTIFACT: dict = {}


# ---- the tiny fp32 artifact (built once per session, shared with test_server_load.py) -------------------

def tiny_artifact(tmp_path_factory, tp: int = 1) -> str:
    """tests/hf_tiny.py checkpoint (with MTP) packed by the real packer, every tensor kept at fp32."""
    from ninfer_pack.convert import convert
    from ninfer_pack.recipes import ROLES
    if "hf" not in _ARTIFACT:
        _ARTIFACT["root"] = tmp_path_factory.mktemp("serve-artifact")
        _ARTIFACT["hf"] = hf_tiny.make_tiny_checkpoint(_ARTIFACT["root"] / "hf", seed=3)
    if tp not in _ARTIFACT:
        out = _ARTIFACT["root"] / f"art-tp{tp}"
        convert(str(_ARTIFACT["hf"]), out, recipe="bf16", overrides=tuple(f"{r}=source" for r in ROLES),
                jobs=1, progress=False, vision=False, tp=tp)
        _ARTIFACT[tp] = str(out)
    return _ARTIFACT[tp]


def real_runtime(artifact: str, *, max_concurrency=4, draft_tokens=DRAFT_TOKENS, kv_capacity=None, tp=1,
                 **vision_kw):
    """`vision_kw`: RuntimeOptions.vision / .vision_max_tokens (tests/test_server_vision.py)."""
    from ninfer_rt.server.runtime import RuntimeOptions, open_runtime
    return open_runtime(RuntimeOptions(artifact=artifact, tp=tp, device="cpu", dtype="float32", backend="torch",
                                       max_concurrency=max_concurrency, draft_tokens=draft_tokens,
                                       kv_capacity=kv_capacity, max_context=CTX, verify=False, **vision_kw))


def real_server(artifact: str, *, max_pending=64, api_key=None, log=None, **rt_kw):
    """(LiveServer, Runtime): the real Engine behind the HTTP app."""
    rt = real_runtime(artifact, **rt_kw)
    state = ServerState(model_id=MODEL_ID, api_key=api_key)
    cfg = SchedulerConfig(max_concurrency=rt.engine.cache.max_seqs, max_context=rt.max_context,
                          max_pending=max_pending)
    sched = Scheduler(rt.engine, rt.engine.model.kv_pool, rt.tokenizer, cfg, state.metrics, log)
    sched.start()
    budget = {"vision_max_tokens": rt_kw["vision_max_tokens"]} if "vision_max_tokens" in rt_kw else {}
    state.ready(sched, rt.tokenizer, rt.loaded.config.vocab_size, rt.loaded.generation_config, vision=rt.vision,
                **budget)
    return LiveServer(state, sched), rt


@pytest.fixture(scope="module")
def real_srv(tmp_path_factory):
    """The real Engine's server (MTP, the tiny fp32 artifact), shared by one module's tests."""
    s, rt = real_server(tiny_artifact(tmp_path_factory))
    yield s
    s.close()
    rt.close()


# ---- stand-ins ----------------------------------------------------------------------------------------

class FakePool:
    def __init__(self, num_pages: int, page_size: int = 4):
        self.num_pages, self.page_size = num_pages, page_size
        self._free = num_pages

    def free_pages(self) -> int:
        return self._free

    def take(self, n: int) -> None:
        if n > self._free:
            raise RuntimeError(f"fake KV pool over-committed: need {n}, {self._free} free")
        self._free -= n

    def give(self, n: int) -> None:
        self._free += n


class FakeEngine:
    """Engine stand-in: letters 'a'..'z' derived from the prompt; prefill in chunks; `per_step` tokens a step."""

    def __init__(self, pool: FakePool, *, per_step: int = 1, chunk: int = 16, step_s: float = 0.0,
                 fail_on: int | None = None):
        self.pool, self.per_step, self.chunk, self.step_s, self.fail_on = pool, per_step, chunk, step_s, fail_on
        self.seqs: dict[str, dict] = {}
        self.steps = 0
        self.stats = {"drafted": 0, "accepted": 0, "drafted_at": [0, 0], "accepted_at": [0, 0]}

    def add_request(self, rid, prompt_ids, params) -> None:
        assert rid not in self.seqs
        self.seqs[rid] = dict(prompt=list(prompt_ids), done=0, out=[], params=params, pages=0)
        self.last_params = params

    def has_work(self) -> bool:
        return bool(self.seqs)

    def abort(self, rid) -> None:
        s = self.seqs.pop(rid, None)
        if s is not None:
            self.pool.give(s["pages"])

    def _grow(self, s, length: int) -> None:
        need = -(-length // self.pool.page_size) - s["pages"]
        if need > 0:
            self.pool.take(need)
            s["pages"] += need

    def step(self):
        from types import SimpleNamespace
        self.steps += 1
        if self.fail_on is not None and self.steps == self.fail_on:
            raise RuntimeError("injected engine failure")
        time.sleep(self.step_s)
        outs = []
        for rid, s in list(self.seqs.items()):
            if s["done"] < len(s["prompt"]):
                s["done"] = min(len(s["prompt"]), s["done"] + self.chunk)
                self._grow(s, s["done"])
                if s["done"] < len(s["prompt"]):
                    continue
                n = 1
            else:
                n = self.per_step
                self.stats["drafted"] += n - 1
                self.stats["accepted"] += n - 1
            new, reason = self.emit(s, n)
            s["out"] += new
            self._grow(s, len(s["prompt"]) + len(s["out"]))
            outs.append(SimpleNamespace(req_id=rid, new_token_ids=new, finished=reason is not None,
                                        finish_reason=reason))
            if reason is not None:
                self.abort(rid)
        return outs

    def emit(self, s, n: int) -> tuple[list[int], str | None]:
        """The next (at most) n tokens of a sequence and its finish reason (None: it goes on)."""
        n = min(n, s["params"].max_tokens - len(s["out"]))
        new = [97 + (sum(s["prompt"]) + 7 * (len(s["out"]) + i)) % 26 for i in range(n)]
        return new, ("length" if len(s["out"]) + n >= s["params"].max_tokens else None)


def tiny_tokenizer() -> Tokenizer:
    res = {"tokenizer.json": hf_tiny.tokenizer_json(), "chat_template.jinja": hf_tiny.CHAT_TEMPLATE,
           "tokenizer_config.json": json.dumps({"eos_token": "<|im_end|>"})}
    return Tokenizer.from_resources(res, eos_token_ids=[hf_tiny.EOS_ID])


# ---- a live server on loopback --------------------------------------------------------------------------

class LiveServer:
    """uvicorn in a background thread on 127.0.0.1 (free port); `close()` shuts it down and the scheduler."""

    def __init__(self, state: ServerState, scheduler: Scheduler | None = None):
        import uvicorn
        self.state, self.scheduler = state, scheduler
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(create_app(state), log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)

    def client(self, **kw):
        import openai
        kw.setdefault("api_key", self.state.api_key or "unused")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=60, **kw)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        if self.scheduler is not None:
            self.scheduler.stop()
        self.sock.close()


def fake_server(*, pages=64, page_size=4, max_concurrency=4, max_pending=8, max_context=96, api_key=None,
                engine_cls=None, tok=None, policy="fcfs", **engine_kw):
    """`engine_cls`: a FakeEngine subclass (its own tokens); `tok`: a tokenizer other than tiny_tokenizer()."""
    pool = FakePool(pages, page_size)
    engine = (engine_cls or FakeEngine)(pool, **engine_kw)
    state = ServerState(model_id=MODEL_ID, api_key=api_key)
    tok = tok or tiny_tokenizer()
    sched = Scheduler(engine, pool, tok, SchedulerConfig(max_concurrency=max_concurrency, max_context=max_context,
                                                         max_pending=max_pending, policy=policy), state.metrics)
    sched.start()
    state.ready(sched, tok, 256, {})
    return LiveServer(state, sched), engine, pool


@pytest.fixture
def fake():
    srv, engine, pool = fake_server()
    yield srv, engine, pool
    srv.close()


def metric(srv: LiveServer, name: str, labels: str = "") -> float:
    text = httpx.get(srv.url + "/metrics", headers=_auth(srv)).text
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


def _auth(srv: LiveServer) -> dict:
    return {"Authorization": f"Bearer {srv.state.api_key}"} if srv.state.api_key else {}


def wait_idle(srv: LiveServer, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not srv.scheduler.idle():
        assert time.monotonic() < deadline, "scheduler did not become idle"
        time.sleep(0.01)


# ---- scheduler/HTTP behaviour on the stand-in -----------------------------------------------------------

def test_fake_chat_roundtrip_and_usage(fake):
    srv, engine, pool = fake
    c = srv.client()
    r = c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert len(r.choices[0].message.content) == 5
    wait_idle(srv)
    assert pool.free_pages() == pool.num_pages


def _post(srv, path, body=None, *, raw: bytes | None = None, headers=None):
    h = {"Content-Type": "application/json", **_auth(srv), **(headers or {})}
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(srv.url + path, content=content, headers=h, timeout=30)


CHAT = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}

BAD_REQUESTS = [
    ("malformed-json", "/v1/chat/completions", b'{"model": "x", "messages": [', 400, None),
    ("not-an-object", "/v1/chat/completions", b'[1, 2]', 400, None),
    ("temperature-string", "/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400, "temperature"),
    ("max-tokens-float", "/v1/chat/completions", {**CHAT, "max_tokens": 2.5}, 400, "max_tokens"),
    ("max-tokens-zero", "/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("seed-bool", "/v1/chat/completions", {**CHAT, "seed": True}, 400, "seed"),
    ("top-p-range", "/v1/chat/completions", {**CHAT, "top_p": 1.5}, 400, "top_p"),
    ("stop-number", "/v1/chat/completions", {**CHAT, "stop": 7}, 400, "stop"),
    ("empty-messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("bad-role", "/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role"),
    ("image-without-vision", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.0.content.0.image_url"),
    ("text-part-without-text", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages.0.content.0.text"),
    ("audio-part", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     400, "messages.0.content.0"),
    ("image-url-number", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 3}}]}]},
     400, "messages.0.content.0.image_url.url"),
    ("n-17", "/v1/chat/completions", {**CHAT, "n": 17}, 400, "n"),
    ("n-0", "/v1/completions", {"model": MODEL_ID, "prompt": "x", "n": 0}, 400, "n"),
    ("wrong-model", "/v1/chat/completions", {**CHAT, "model": "gpt-9"}, 404, "model"),
    ("missing-prompt", "/v1/completions", {"model": MODEL_ID}, 400, "prompt"),
    ("token-out-of-vocab", "/v1/completions", {"model": MODEL_ID, "prompt": [1, 99999]}, 400, "prompt"),
    ("two-prompts", "/v1/completions", {"model": MODEL_ID, "prompt": ["a", "b"]}, 400, "prompt"),
    ("overlong-prompt", "/v1/completions", {"model": MODEL_ID, "prompt": "x" * 200}, 400, "prompt"),
    ("prompt-plus-max-tokens", "/v1/completions", {"model": MODEL_ID, "prompt": "x" * 50, "max_tokens": 60},
     400, "max_tokens"),
    ("prompt-plus-max-completion-tokens", "/v1/chat/completions",
     {**CHAT, "max_tokens": None, "max_completion_tokens": 500}, 400, "max_completion_tokens"),
    # fields that would change the reply are refused by name, never silently ignored
    ("logit-bias-key", "/v1/chat/completions", {**CHAT, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("repetition-penalty-0", "/v1/chat/completions", {**CHAT, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("logit-bias-range", "/v1/chat/completions", {**CHAT, "logit_bias": {"10": 101}}, 400, "logit_bias"),
    ("logit-bias-vocab", "/v1/completions", {"model": MODEL_ID, "prompt": "x", "logit_bias": {"99999": 1}}, 400,
     "logit_bias"),
    ("response-format-json", "/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    ("best-of-2", "/v1/completions", {"model": MODEL_ID, "prompt": "x", "best_of": 2}, 400, "best_of"),
    ("top-logprobs-21", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("top-logprobs-without-logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("logprobs-not-bool", "/v1/chat/completions", {**CHAT, "logprobs": "yes"}, 400, "logprobs"),
    ("completion-logprobs-21", "/v1/completions", {"model": MODEL_ID, "prompt": "x", "logprobs": 21}, 400,
     "logprobs"),
    ("completion-logprobs-negative", "/v1/completions", {"model": MODEL_ID, "prompt": "x", "logprobs": -1}, 400,
     "logprobs"),
    # JSON's "\\ud800" decodes to a lone surrogate no tokenizer takes (json.dumps writes it escaped)
    ("lone-surrogate-chat", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "hi \ud800 there"}]}, 400, "messages.0.content"),
    ("lone-surrogate-prompt", "/v1/completions", {"model": MODEL_ID, "prompt": "a\udfff"}, 400, "prompt"),
]


def test_null_means_default_for_optional_fields(fake):
    """OpenAI's schema allows null for n, stream, logit_bias, response_format: the defaults apply."""
    srv, _, _ = fake
    nulls = {"n": None, "stream": None, "logit_bias": None, "response_format": None}
    r = _post(srv, "/v1/chat/completions", {**CHAT, **nulls})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
    r = _post(srv, "/v1/chat/completions", {**CHAT, "logit_bias": {}, "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text
    r = _post(srv, "/v1/completions", {"model": MODEL_ID, "prompt": "x", "max_tokens": 2, "best_of": 1, **nulls})
    assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text


def test_routing_errors_are_counted(fake):
    srv, _, _ = fake
    before = {s: metric(srv, "ninfer_request_errors_total", f'status="{s}"') for s in (404, 405)}
    assert httpx.get(srv.url + "/v1/nope", headers=_auth(srv)).status_code == 404
    assert httpx.get(srv.url + "/v1/chat/completions", headers=_auth(srv)).status_code == 405
    for s in (404, 405):
        assert metric(srv, "ninfer_request_errors_total", f'status="{s}"') == before[s] + 1


@pytest.mark.parametrize("path,body,status,param", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(fake, path, body, status, param):
    srv, _, _ = fake
    r = _post(srv, path, raw=body) if isinstance(body, bytes) else _post(srv, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    ok = _post(srv, "/v1/chat/completions", CHAT)        # the server keeps serving
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("resources,needle", [
    ({"chat_template.jinja": b"{{ 1/0 }}"}, "resource chat_template.jinja: rendering failed: ZeroDivisionError"),
    ({"tokenizer_config.json": b'{"chat_template": 5}'}, "resource tokenizer_config.json: chat_template: expected"),
], ids=["raises-at-render", "number"])
def test_broken_chat_template_is_a_500_naming_it(fake, resources, needle):
    """The artifact's template, not the request, is at fault: a 500 with the OpenAI error body; the
    completions route (no template) keeps working."""
    srv, _, _ = fake
    res = {"tokenizer.json": hf_tiny.tokenizer_json(), **resources}
    srv.state.tokenizer = Tokenizer.from_resources(res, eos_token_ids=[hf_tiny.EOS_ID])
    r = _post(srv, "/v1/chat/completions", CHAT)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "chat_template_error" and needle in err["message"]
    assert _post(srv, "/v1/completions", {"model": MODEL_ID, "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_huge_body_is_413_with_and_without_content_length(fake):
    srv, _, _ = fake
    big = json.dumps({**CHAT, "pad": "x" * (5 << 20)}).encode()
    r = _post(srv, "/v1/chat/completions", raw=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():                   # chunked transfer: no Content-Length for the guard to read
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + 1 << 16]
    r = httpx.post(srv.url + "/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert _post(srv, "/v1/chat/completions", CHAT).status_code == 200


def test_api_key_guards_every_route_but_health():
    srv, _, _ = fake_server(api_key="s3cret")
    try:
        for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/chat/completions"),
                             ("POST", "/v1/completions"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                             ("GET", "/nowhere")]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = httpx.request(method, srv.url + path, headers=headers, json=CHAT)
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/health").status_code == 200
        ok = srv.client().models.list()
        assert [m.id for m in ok.data] == [MODEL_ID]
        import openai
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="nope").models.list()
    finally:
        srv.close()


def test_health_is_503_while_loading_then_200():
    state = ServerState(model_id=MODEL_ID)
    srv = LiveServer(state)
    try:
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = _post(srv, "/v1/chat/completions", CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        pool = FakePool(16)
        sched = Scheduler(FakeEngine(pool), pool, tiny_tokenizer(), SchedulerConfig(max_context=32), state.metrics)
        sched.start()
        srv.scheduler = sched
        state.ready(sched, tiny_tokenizer(), 256, {})
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        r = _post(srv, "/v1/chat/completions", CHAT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    finally:
        srv.close()


def test_queue_over_max_pending_is_429_and_kv_reservation_is_fifo():
    # 12 pages of 4 tokens: each request reserves ceil((prompt + 8) / 4) pages, so only a few fit at once
    srv, engine, pool = fake_server(pages=12, max_concurrency=4, max_pending=3, max_context=48, step_s=0.05)
    try:
        prompts = [{"model": MODEL_ID, "prompt": "abcdefghijklmnop"[:n], "max_tokens": 8} for n in (9, 10, 11, 12)]

        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
                rs = await asyncio.gather(*[c.post("/v1/completions", json=p) for p in prompts * 3])
            return rs
        rs = asyncio.run(run())
        codes = [r.status_code for r in rs]
        assert set(codes) <= {200, 429} and 429 in codes and 200 in codes
        for r in rs:
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "queue_full", r.text
                assert r.json()["error"]["type"] == "rate_limit_error"
            else:
                assert r.json()["usage"]["completion_tokens"] == 8, r.text
        wait_idle(srv)
        assert pool.free_pages() == pool.num_pages
        assert metric(srv, "ninfer_request_errors_total", 'status="429"') == codes.count(429)
        assert metric(srv, "ninfer_kv_pages_reserved") == 0
    finally:
        srv.close()


def test_engine_failure_is_500_then_keeps_serving():
    srv, engine, pool = fake_server(fail_on=1)
    try:
        r = _post(srv, "/v1/chat/completions", CHAT)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert r.json()["error"]["code"] == "engine_error" and "internal engine error" in r.json()["error"]["message"]
        r = _post(srv, "/v1/chat/completions", CHAT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        wait_idle(srv)
        assert not engine.seqs
        engine.usable = False          # an engine that can no longer step (a failed TP step): 503, not 500s
        assert httpx.get(srv.url + "/health").status_code == 503
        r = _post(srv, "/v1/chat/completions", CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unusable"
    finally:
        srv.close()


@pytest.mark.parametrize("exc,status,logged", [
    (RuntimeError("tower exploded"), 500, True),
    (None, 400, False),                         # a NinferError: the client's input, no traceback
], ids=["bug-500-logged", "ninfer-error-400-quiet"])
def test_add_request_failure_answers_and_logs_bugs_only(exc, status, logged, capfd):
    from ninfer_formats.errors import NinferError
    exc = exc or NinferError("image: 3 x 5 pixels is below the 28 pixel minimum")
    srv, engine, pool = fake_server()
    real_add, calls = engine.add_request, []

    def add_once(*a, **kw):
        if not calls:
            calls.append(1)
            raise exc
        return real_add(*a, **kw)
    engine.add_request = add_once
    try:
        r = _post(srv, "/v1/chat/completions", CHAT)
        assert r.status_code == status and str(exc) in r.json()["error"]["message"], r.text
        r = _post(srv, "/v1/chat/completions", CHAT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        wait_idle(srv)
        assert pool.free_pages() == pool.num_pages
    finally:
        srv.close()
    err = capfd.readouterr().err
    assert ("Traceback" in err and "tower exploded" in err) == logged, err


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "blocking"])
def test_disconnect_aborts_request_and_frees_pages(stream):
    srv, engine, pool = fake_server(pages=64, max_context=200, step_s=0.02)
    try:
        body = {"model": MODEL_ID, "prompt": "abc", "max_tokens": 150, "stream": stream}
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            if stream:
                with c.stream("POST", "/v1/completions", json=body) as r:
                    lines = r.iter_lines()
                    assert next(l for l in lines if l.startswith("data:"))
            else:
                with pytest.raises(httpx.ReadTimeout):
                    c.post("/v1/completions", json=body, timeout=0.3)
        wait_idle(srv)
        assert engine.steps < 150                  # stopped early rather than running to max_tokens
        assert not engine.seqs and pool.free_pages() == pool.num_pages
        assert metric(srv, "ninfer_requests_total", 'finish_reason="abort"') == 1
    finally:
        srv.close()


# ---- the real Engine (tiny fp32 artifact, MTP K=2) ------------------------------------------------------

@pytest.fixture(scope="module")
def real(tmp_path_factory):
    from types import SimpleNamespace

    from ninfer_rt.server.request_log import RequestLog
    art = tiny_artifact(tmp_path_factory)
    log_path = tmp_path_factory.mktemp("serve-log") / "requests.jsonl"
    srv, rt = real_server(art, log=RequestLog(str(log_path)))
    ref = real_runtime(art, max_concurrency=1, draft_tokens=0)      # the Engine driven directly, no MTP
    yield SimpleNamespace(srv=srv, rt=rt, ref=ref, tok=rt.tokenizer, log_path=log_path)
    srv.close()
    rt.close()
    ref.close()


def solo_ids(ref, prompt_ids, max_tokens: int) -> list[int]:
    """Greedy tokens of one request served alone by the reference Engine."""
    from ninfer_rt.sampling import SamplingParams
    eng = ref.engine
    eng.add_request("solo", prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                       stop_token_ids=tuple(sorted(ref.tokenizer.stop_ids))))
    out = []
    while eng.has_work():
        for o in eng.step():
            out += o.new_token_ids
    return out


def expected_text(tok, ids, split=None) -> tuple[str, str]:
    """(reasoning, answer) text the server must produce for these ids (same incremental detokenizer)."""
    from ninfer_rt.server.reasoning import OutputText
    t = OutputText(tok, (), split)
    r, c = t.push(ids)
    r2, c2 = t.flush()
    return r + r2, c + c2


PROMPTS = ["The quick brown fox", "a", "Once upon a time, in a land far away, there lived", "0123456789 " * 4,
           "Zebra", "ü-umlaut and 漢字"]


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "stream"])
def test_greedy_completion_equals_engine(real, stream):
    c = real.srv.client()
    prompt, n = PROMPTS[0], 13
    ids = solo_ids(real.ref, real.tok.encode(prompt), n)
    want = expected_text(real.tok, ids)[1]
    if stream:
        chunks = list(c.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert chunks[-1].usage.completion_tokens == len(ids) and not chunks[-1].choices
        assert chunks[-1].usage.prompt_tokens == len(real.tok.encode(prompt))
    else:
        r = c.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=n, temperature=0)
        text, finish = r.choices[0].text, [r.choices[0].finish_reason]
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(real.tok.encode(prompt)), len(ids))
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert text == want
    assert finish == ["length" if len(ids) == n else "stop"]


def test_chat_thinking_split_and_stream_matches_blocking(real):
    c = real.srv.client()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    ids = real.tok.encode(real.tok.render_chat(msgs, add_generation_prompt=True, enable_thinking=False))
    from ninfer_rt.server.handlers import splitter
    want_r, want_c = expected_text(real.tok, solo_ids(real.ref, ids, 10), splitter(real.tok, ids))
    r = c.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=10, temperature=0, extra_body=off)
    m = r.choices[0].message
    assert (m.content, getattr(m, "reasoning_content", None) or "") == (want_c, want_r)
    assert r.usage.prompt_tokens == len(ids)
    chunks = list(c.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=10, temperature=0,
                                            stream=True, extra_body=off))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want_c
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].usage is None                      # no include_usage -> no usage chunk
    # thinking on (the template opens <think>): the tiny model never closes it, so all of it is reasoning
    t = c.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=10, temperature=0)
    assert t.choices[0].message.content == "" and t.choices[0].message.reasoning_content


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "stream"])
def test_stop_string_cuts_and_is_excluded(real, stream):
    c = real.srv.client()
    prompt = PROMPTS[2]
    full = c.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    cut = next(i for i in range(3, len(full)) if full[i] != "\ufffd" and not full[i].isspace())
    stop = full[cut]
    want = full[:full.index(stop)]
    kw = dict(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "never-there"])
    if stream:
        chunks = list(c.completions.create(stream=True, **kw))
        text = "".join(ch.choices[0].text for ch in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = c.completions.create(**kw)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert r.usage.completion_tokens < 24
    assert (text, finish) == (want, "stop")


def test_seeded_sampling_is_reproducible(real):
    c = real.srv.client()
    kw = dict(model=MODEL_ID, prompt=PROMPTS[4], max_tokens=16, temperature=1.0, top_p=0.95)
    a = c.completions.create(seed=7, **kw).choices[0].text
    b = "".join(ch.choices[0].text for ch in c.completions.create(seed=7, stream=True, **kw))
    other = c.completions.create(seed=8, **kw).choices[0].text
    assert a == b and a != other


def test_concurrent_requests_match_solo(real):
    from concurrent.futures import ThreadPoolExecutor
    c = real.srv.client()
    jobs = [(p, n) for p, n in zip(PROMPTS, (9, 17, 5, 12, 20, 7))]

    def one(job):
        p, n = job
        if len(p) % 2:
            return c.completions.create(model=MODEL_ID, prompt=p, max_tokens=n, temperature=0).choices[0].text
        s = c.completions.create(model=MODEL_ID, prompt=p, max_tokens=n, temperature=0, stream=True)
        return "".join(ch.choices[0].text for ch in s)
    with ThreadPoolExecutor(len(jobs)) as ex:
        got = list(ex.map(one, jobs))
    for (p, n), text in zip(jobs, got):
        assert text == expected_text(real.tok, solo_ids(real.ref, real.tok.encode(p), n))[1], p


def test_async_scheduling_server_matches_solo(real, tmp_path_factory):
    """Run-ahead decode steps (forced on, as on CUDA; no MTP) behind the server: concurrent greedy text equals
    each request served alone, a stop string still cuts, a disconnect mid-stream frees everything."""
    from concurrent.futures import ThreadPoolExecutor
    srv, rt = real_server(tiny_artifact(tmp_path_factory), draft_tokens=0, async_scheduling=True)
    try:
        assert rt.engine.async_scheduling
        c = srv.client()
        jobs = [(p, n) for p, n in zip(PROMPTS, (9, 17, 5, 12, 20, 7))]

        def one(job):
            s = c.completions.create(model=MODEL_ID, prompt=job[0], max_tokens=job[1], temperature=0, stream=True)
            return "".join(ch.choices[0].text for ch in s)
        with ThreadPoolExecutor(len(jobs)) as ex:
            got = list(ex.map(one, jobs))
        for (p, n), text in zip(jobs, got):
            assert text == expected_text(real.tok, solo_ids(real.ref, real.tok.encode(p), n))[1], p
        assert rt.engine._ahead_done > 0                  # steps were read back from the run-ahead path
        kw = dict(model=MODEL_ID, prompt=PROMPTS[2], max_tokens=24, temperature=0)
        full = c.completions.create(**kw).choices[0].text
        stop = next(ch for ch in full[3:] if ch != "\ufffd" and not ch.isspace())
        r = c.completions.create(stop=[stop], **kw).choices[0]
        assert (r.text, r.finish_reason) == (full[:full.index(stop)], "stop")
        body = {"model": MODEL_ID, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.Client(base_url=srv.url, timeout=30) as h:
            with h.stream("POST", "/v1/completions", json=body) as resp:
                assert [line for _, line in zip(range(6), resp.iter_lines()) if line.startswith("data:")]
        wait_idle(srv)
        assert _pool_is_whole(rt)
    finally:
        srv.close()
        rt.close()


def _pool_is_whole(rt) -> bool:
    m = rt.engine.model
    return m.kv_pool.free_pages() == m.kv_pool.num_pages and m.gdn_pool.free_slots() == m.gdn_pool.max_seqs


def test_tp2_server_matches_tp1(real, tmp_path_factory):
    """Rank 0 serves, rank 1 (a spawned process, gloo) mirrors its steps; greedy text equals TP1's."""
    from concurrent.futures import ThreadPoolExecutor
    srv, rt = real_server(tiny_artifact(tmp_path_factory, tp=2), tp=2)
    try:
        c = srv.client()
        jobs = [(p, n) for p, n in zip(PROMPTS[:3], (8, 14, 6))]
        with ThreadPoolExecutor(len(jobs)) as ex:
            got = list(ex.map(lambda j: c.completions.create(model=MODEL_ID, prompt=j[0], max_tokens=j[1],
                                                             temperature=0).choices[0].text, jobs))
        for (p, n), text in zip(jobs, got):
            assert text == expected_text(real.tok, solo_ids(real.ref, real.tok.encode(p), n))[1], p
        # logprobs of the prompt (echo: every prompt row's logits on every rank) and of the output
        kw = dict(model=MODEL_ID, prompt=PROMPTS[1], max_tokens=7, temperature=0, logprobs=3, echo=True)
        lp2, lp1 = (x.client().completions.create(**kw).choices[0].logprobs for x in (srv, real.srv))
        assert lp2.tokens == lp1.tokens and lp2.text_offset == lp1.text_offset       # the leader's, gathered vocab
        assert max(abs(a - b) for a, b in zip(lp2.token_logprobs[1:], lp1.token_logprobs[1:])) < 1e-4
        # a repeated prompt resumes from every rank's prefix cache (the leader sends where) and answers alike
        long = PROMPTS[3] * 3
        want = expected_text(real.tok, solo_ids(real.ref, real.tok.encode(long), 6))[1]
        for cached in (False, True, "reset"):
            if cached == "reset":                           # every rank empties its cache before the next step
                assert _post(srv, "/reset_prefix_cache").status_code == 200
            r = c.completions.create(model=MODEL_ID, prompt=long, max_tokens=6, temperature=0)
            assert r.choices[0].text == want and bool(r.usage.prompt_tokens_details) == (cached is True)
        wait_idle(srv)
        assert _pool_is_whole(rt)
    finally:
        srv.close()
        rt.close()
    assert all(not p.is_alive() for p in rt.launch.procs)


def test_disconnect_mid_stream_frees_kv_and_state(real):
    before = metric(real.srv, "ninfer_requests_total", 'finish_reason="abort"')
    body = {"model": MODEL_ID, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.Client(base_url=real.srv.url, timeout=30) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            got = [line for _, line in zip(range(6), r.iter_lines()) if line.startswith("data:")]
    assert got
    wait_idle(real.srv)
    assert _pool_is_whole(real.rt)
    assert metric(real.srv, "ninfer_requests_total", 'finish_reason="abort"') == before + 1


def test_metrics_and_request_log_account_for_requests(real):
    srv = real.srv
    names = ["ninfer_prompt_tokens_total", "ninfer_generation_tokens_total", "ninfer_time_to_first_token_seconds_count",
             "ninfer_spec_decode_drafted_tokens_total", "ninfer_spec_decode_accepted_tokens_total"]
    before = {n: metric(srv, n) for n in names}
    c = srv.client()
    rs = [c.completions.create(model=MODEL_ID, prompt=p, max_tokens=11, temperature=0) for p in PROMPTS[:2]]
    wait_idle(srv)
    after = {n: metric(srv, n) for n in names}
    assert after[names[0]] - before[names[0]] == sum(r.usage.prompt_tokens for r in rs)
    assert after[names[1]] - before[names[1]] == sum(r.usage.completion_tokens for r in rs)
    assert after[names[2]] - before[names[2]] == 2
    assert after[names[3]] > before[names[3]]             # MTP drafted during these greedy requests
    assert metric(srv, "ninfer_spec_decode_drafted_tokens_per_pos_total", 'position="0"') > 0
    assert metric(srv, "ninfer_requests_running") == 0 and metric(srv, "ninfer_requests_waiting") == 0
    assert metric(srv, "ninfer_kv_pages_used") == 0
    lines = [json.loads(x) for x in real.log_path.read_text().splitlines()]
    done = [x for x in lines if x["event"] == "request_done"]
    assert done and all(set(d) == {"event", "time", "id", "reply_id", "choice", "finish_reason", "prompt_tokens",
                                   "cached_tokens", "completion_tokens", "timings_seconds", "speculative"}
                        for d in done)
    assert [(d["reply_id"], d["choice"]) for d in done[-2:]] == [(r.id, 0) for r in rs]   # the ids clients see
    assert all(d["timings_seconds"]["total"] >= d["timings_seconds"]["ttft"] >= 0 for d in done
               if d["timings_seconds"]["ttft"] is not None)
    # per-request MTP stats (StepOutput.drafted / .accepted): these two requests' records add up to the counters
    mine = done[-2:]
    assert all(0 <= d["speculative"]["accepted"] <= d["speculative"]["drafted"] for d in mine)
    assert sum(d["speculative"]["drafted"] for d in mine) == after[names[3]] - before[names[3]]
    assert sum(d["speculative"]["accepted"] for d in mine) == after[names[4]] - before[names[4]]
    assert all(d["speculative"]["acceptance_rate"] == round(d["speculative"]["accepted"] /
                                                            d["speculative"]["drafted"], 4) for d in mine)


# ---- Engine follow-ups: per-request MTP counts, usable, grad mode ---------------------------------------

def _drive(engine, prompts: dict, max_tokens: int) -> tuple[dict, dict]:
    """Step to the end; -> ({rid: tokens}, {rid: [drafted, accepted]} summed over the StepOutputs)."""
    from ninfer_rt.sampling import SamplingParams
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    toks, spec = {rid: [] for rid in prompts}, {}
    while engine.has_work():
        for o in engine.step():
            toks[o.req_id] += o.new_token_ids
            if o.drafted is not None:
                d = spec.setdefault(o.req_id, [0, 0])
                d[0], d[1] = d[0] + o.drafted, d[1] + o.accepted
                assert 0 <= o.accepted <= o.drafted and len(o.new_token_ids) <= o.accepted + 1
    return toks, spec


def test_step_outputs_carry_per_request_mtp_counts(real, tmp_path_factory):
    rt = real_runtime(tiny_artifact(tmp_path_factory), max_concurrency=3, draft_tokens=3)
    try:
        prompts = {f"p{i}": real.tok.encode(p) for i, p in enumerate(PROMPTS[:3])}
        toks, spec = _drive(rt.engine, prompts, 12)
        st = rt.engine.stats.spec
        assert set(spec) == set(prompts) and all(len(t) == 12 for t in toks.values())
        assert sum(d for d, _ in spec.values()) == st.drafted > 0
        assert sum(a for _, a in spec.values()) == st.accepted
        plain, none = _drive(real.ref.engine, {"q": prompts["p0"]}, 12)   # no MTP: the counts stay None
        assert none == {} and plain["q"] == toks["p0"]
    finally:
        rt.close()


class _TwoRanks:
    """A stand-in TP group of size 2 that swallows rank 0's messages (no follower exists)."""

    rank, size = 0, 2

    def __init__(self):
        self.sent = []

    def broadcast_object(self, obj):
        self.sent.append(obj)
        return obj

    def broadcast(self, t):
        return t


def test_engine_usable_after_failed_steps_and_health(tmp_path_factory, monkeypatch):
    """A failed TP1 step leaves the Engine usable; a failed TP step (ranks out of step) does not: step()
    is refused, /health is 503 and new requests are 503, and shutdown sends the followers nothing more."""
    from ninfer_rt.engine import EngineError
    srv, rt = real_server(tiny_artifact(tmp_path_factory), max_concurrency=1, draft_tokens=0)
    eng = rt.engine
    try:
        real_execute = eng._execute

        def fail_once(plan):
            monkeypatch.setattr(eng, "_execute", real_execute)
            raise RuntimeError("injected step failure")
        monkeypatch.setattr(eng, "_execute", fail_once)
        r = _post(srv, "/v1/completions", {"model": MODEL_ID, "prompt": "x", "max_tokens": 3})
        assert r.status_code == 500 and "injected step failure" in r.json()["error"]["message"], r.text
        wait_idle(srv)
        assert eng.usable and httpx.get(srv.url + "/health").json() == {"status": "ok"}
        r = _post(srv, "/v1/completions", {"model": MODEL_ID, "prompt": "x", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text

        group = eng.tp = _TwoRanks()
        monkeypatch.setattr(eng, "_execute", fail_once)
        r = _post(srv, "/v1/completions", {"model": MODEL_ID, "prompt": "y", "max_tokens": 3})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error", r.text
        wait_idle(srv)
        assert not eng.usable
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "error"
        r = _post(srv, "/v1/completions", {"model": MODEL_ID, "prompt": "z", "max_tokens": 3})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unusable"
        with pytest.raises(EngineError, match="out of step"):
            eng.step()
        sent = len(group.sent)
    finally:
        srv.close()
        rt.close()
    assert len(group.sent) == sent                      # no "stop" broadcast into a broken group
    with pytest.raises(EngineError, match="shut down|out of step"):
        eng.step()


def test_runtime_and_generate_leave_the_callers_grad_mode_alone(tmp_path_factory):
    """Loading and stepping turn autograd off only inside their own calls (it is per thread); a later
    training step in the same process still records gradients."""
    import io

    import torch

    from ninfer_rt.cmd_generate import GenerateOptions, run_generate
    art = tiny_artifact(tmp_path_factory)
    assert torch.is_grad_enabled()
    rt = real_runtime(art, max_concurrency=1, draft_tokens=2)
    try:
        assert torch.is_grad_enabled()
        toks, _ = _drive(rt.engine, {"g": [5, 6, 7]}, 4)
        assert len(toks["g"]) == 4 and torch.is_grad_enabled()
    finally:
        rt.close()
    run_generate(GenerateOptions(artifact=art, prompt="hi", max_new=2, verify=False), out=io.StringIO(),
                 log=io.StringIO())
    assert torch.is_grad_enabled()
    w = torch.ones(2, requires_grad=True)
    (w * 3).sum().backward()
    assert w.grad is not None


def test_unknown_fields_ignored_and_max_completion_tokens(fake):
    srv, _, _ = fake
    body = {**CHAT, "max_tokens": 9, "max_completion_tokens": 3, "frobnicate": {"x": 1}, "user": "u1",
            "chat_template_kwargs": {"enable_thinking": False}}
    r = _post(srv, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    assert r.json()["choices"][0]["message"]["reasoning_content"] is None


def test_a_handler_bug_is_a_500_error_body(fake, monkeypatch):
    from ninfer_rt.server import handlers
    srv, _, _ = fake
    monkeypatch.setattr(handlers, "chat_prompt", lambda *a: 1 / 0)
    r = _post(srv, "/v1/chat/completions", CHAT)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    monkeypatch.undo()
    assert _post(srv, "/v1/chat/completions", CHAT).status_code == 200
