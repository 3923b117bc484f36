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

import httpx
import pytest

from ninfer_rt.server import ServerState, create_app
from ninfer_rt.server.scheduler import Scheduler, SchedulerConfig
from ninfer_rt.tokenizer import Tokenizer

import hf_tiny

MODEL_ID = "tiny-test"


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
        self.stats = {"drafted": 0, "accepted": 0, "drafted_per_pos": [0, 0], "accepted_per_pos": [0, 0]}

    def add_request(self, rid, prompt_ids, params) -> None:
        assert rid not in self.seqs
        self.seqs[rid] = dict(prompt=list(prompt_ids), done=0, out=[], params=params, pages=0)

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
            n = min(n, s["params"].max_tokens - len(s["out"]))
            new = [97 + (sum(s["prompt"]) + 7 * (len(s["out"]) + i)) % 26 for i in range(n)]
            s["out"] += new
            self._grow(s, len(s["prompt"]) + len(s["out"]))
            fin = len(s["out"]) >= s["params"].max_tokens
            outs.append(SimpleNamespace(req_id=rid, new_token_ids=new, finished=fin,
                                        finish_reason="length" if fin else None))
            if fin:
                self.abort(rid)
        return outs


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
                **engine_kw):
    pool = FakePool(pages, page_size)
    engine = FakeEngine(pool, **engine_kw)
    state = ServerState(model_id=MODEL_ID, api_key=api_key)
    tok = tiny_tokenizer()
    sched = Scheduler(engine, pool, tok, SchedulerConfig(max_concurrency=max_concurrency, max_context=max_context,
                                                         max_pending=max_pending), state.metrics)
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
    ("image-part", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.0.content"),
    ("n-3", "/v1/chat/completions", {**CHAT, "n": 3}, 400, "n"),
    ("wrong-model", "/v1/chat/completions", {**CHAT, "model": "gpt-9"}, 404, "model"),
    ("missing-prompt", "/v1/completions", {"model": MODEL_ID}, 400, "prompt"),
    ("token-out-of-vocab", "/v1/completions", {"model": MODEL_ID, "prompt": [1, 99999]}, 400, "prompt"),
    ("two-prompts", "/v1/completions", {"model": MODEL_ID, "prompt": ["a", "b"]}, 400, "prompt"),
    ("overlong-prompt", "/v1/completions", {"model": MODEL_ID, "prompt": "x" * 200}, 400, "prompt"),
    ("prompt-plus-max-tokens", "/v1/completions", {"model": MODEL_ID, "prompt": "x" * 50, "max_tokens": 60},
     400, "max_tokens"),
]


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


def test_huge_body_is_413_with_and_without_content_length(fake):
    srv, _, _ = fake
    big = json.dumps({**CHAT, "pad": "x" * (5 << 20)}).encode()
    assert _post(srv, "/v1/chat/completions", raw=big).status_code == 413

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
                             ("POST", "/v1/completions"), ("GET", "/nowhere")]:
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
        assert httpx.get(srv.url + "/health").status_code == 200
        assert _post(srv, "/v1/chat/completions", CHAT).status_code == 200
    finally:
        srv.close()


def test_queue_over_max_pending_is_429_and_kv_reservation_is_fifo():
    # 12 pages of 4 tokens: each request reserves ceil((prompt + 8) / 4) pages, so only a few fit at once
    srv, engine, pool = fake_server(pages=12, max_concurrency=4, max_pending=3, max_context=48, step_s=0.01)
    try:
        prompts = [{"model": MODEL_ID, "prompt": "abcdefghijklmnop"[:n], "max_tokens": 8} for n in (9, 10, 11, 12)]

        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
                rs = await asyncio.gather(*[c.post("/v1/completions", json=p) for p in prompts * 3])
            return [r.status_code for r in rs]
        codes = asyncio.run(run())
        assert set(codes) <= {200, 429} and 429 in codes and 200 in codes
        wait_idle(srv)
        assert pool.free_pages() == pool.num_pages
        assert metric(srv, "ninfer_requests_rejected_total", 'status="429"') == codes.count(429)
        assert metric(srv, "ninfer_kv_pages_reserved") == 0
    finally:
        srv.close()


def test_engine_failure_is_500_then_keeps_serving():
    srv, engine, pool = fake_server(fail_on=1)
    try:
        r = _post(srv, "/v1/chat/completions", CHAT)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert _post(srv, "/v1/chat/completions", CHAT).status_code == 200
        wait_idle(srv)
        assert not engine.seqs
    finally:
        srv.close()


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
