"""`n` choices per request: one engine request each, queued together (all or none), merged into one reply whose
choices (and streamed chunks) carry their `index`; usage counts the prompt once. The deterministic FakeEngine
checks the shapes, the queue and cancellation; the real Engine (MTP, tiny fp32 artifact) seeded sampling."""
from __future__ import annotations

import asyncio
import json
from contextlib import contextmanager

import httpx
import pytest
from test_server import CHAT, MODEL_ID, _post, fake, fake_server, metric, real_srv, wait_idle  # noqa: F401


@contextmanager
def _freed(**kw):
    """A FakeEngine server that must end idle with every KV page back in its pool."""
    srv, _, pool = fake_server(**kw)
    try:
        yield srv
        wait_idle(srv)
        assert pool.free_pages() == pool.num_pages
    finally:
        srv.close()


def _chunks(r: httpx.Response) -> list[dict]:
    lines = [ln[len("data: "):] for ln in r.text.split("\n\n") if ln.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", r.text
    return [json.loads(x) for x in lines[:-1]]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_blocking_and_streamed_choices_agree(fake, chat):
    srv, _, pool = fake
    path, body = ("/v1/chat/completions", {**CHAT, "max_tokens": 5}) if chat else \
        ("/v1/completions", {"model": MODEL_ID, "prompt": "hello", "max_tokens": 5})
    b = _post(srv, path, {**body, "n": 3}).json()
    assert [c["index"] for c in b["choices"]] == [0, 1, 2]
    one = _post(srv, path, body).json()
    assert b["usage"] == {**one["usage"], "completion_tokens": 15, "total_tokens": one["usage"]["prompt_tokens"] + 15}
    texts = [c["message"]["content"] if chat else c["text"] for c in b["choices"]]
    chunks = _chunks(_post(srv, path, {**body, "n": 3, "stream": True, "stream_options": {"include_usage": True}}))
    *rest, last = chunks
    assert last["choices"] == [] and last["usage"] == b["usage"]
    got, finish = ["", "", ""], [None] * 3
    for ch in rest:
        (c,) = ch["choices"]
        got[c["index"]] += (c["delta"].get("content") or "") if chat else c["text"]
        if c["finish_reason"]:
            assert finish[c["index"]] is None
            finish[c["index"]] = c["finish_reason"]
    assert got == texts and finish == ["length"] * 3
    if chat:                                   # every choice opens with its role chunk
        assert [ch["choices"][0]["index"] for ch in rest[:3]] == [0, 1, 2]
        assert all(ch["choices"][0]["delta"] == {"role": "assistant", "content": ""} for ch in rest[:3])
    wait_idle(srv)
    assert pool.free_pages() == pool.num_pages


def test_choices_are_queued_all_or_none():
    """max_pending 3: n = 4 can never fit (a 400, not a 429 to retry); with two requests waiting, n = 2 is a 429
    and leaves nothing queued; n = 3 fits an empty queue."""
    with _freed(max_pending=3, max_concurrency=1, step_s=0.05) as srv:
        body = {"model": MODEL_ID, "prompt": "abc", "max_tokens": 3}
        r = _post(srv, "/v1/completions", {**body, "n": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"

        async def busy():
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
                first = asyncio.ensure_future(c.post("/v1/completions", json={**body, "max_tokens": 20, "n": 3}))
                await asyncio.sleep(0.3)             # one choice runs, two wait
                second = await c.post("/v1/completions", json={**body, "n": 2})
                return (await first).status_code, second
        first, second = asyncio.run(busy())
        assert first == 200 and second.status_code == 429 and second.json()["error"]["code"] == "queue_full"
        wait_idle(srv)
        assert metric(srv, "ninfer_requests_waiting") == 0
        r = _post(srv, "/v1/completions", {**body, "n": 3})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3


def test_a_failed_step_fails_the_reply_and_frees_every_choice():
    with _freed(fail_on=2) as srv:
        r = _post(srv, "/v1/completions", {"model": MODEL_ID, "prompt": "abc", "max_tokens": 6, "n": 2})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


def test_disconnect_mid_stream_cancels_every_choice():
    with _freed(step_s=0.02) as srv:
        before = metric(srv, "ninfer_requests_total", 'finish_reason="abort"')
        body = {"model": MODEL_ID, "prompt": "abc", "max_tokens": 60, "n": 3, "stream": True}
        with httpx.Client(base_url=srv.url, timeout=30) as h:
            with h.stream("POST", "/v1/completions", json=body) as r:
                assert [ln for _, ln in zip(range(4), r.iter_lines()) if ln.startswith("data:")]
        wait_idle(srv)
        assert metric(srv, "ninfer_requests_total", 'finish_reason="abort"') == before + 3


def test_seeded_choices_differ_and_reproduce(real_srv):
    c = real_srv.client()
    kw = dict(model=MODEL_ID, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=7, n=3,
              extra_body={"ignore_eos": True})
    a = [ch.text for ch in c.completions.create(**kw).choices]
    b = [ch.text for ch in c.completions.create(**kw).choices]
    assert a == b and len(set(a)) > 1
    first = c.completions.create(**{**kw, "n": 1}).choices[0].text
    assert first == a[0]                       # choice 0 keeps the request's own seed
    greedy = [ch.text for ch in c.completions.create(**{**kw, "temperature": 0, "n": 2}).choices]
    assert greedy[0] == greedy[1]


def test_a_choice_that_breaks_ends_the_stream_with_an_error(fake, monkeypatch):
    """A bug under one choice's events (here: reading them raises) is an error event, then [DONE]; the stream
    does not wait for that choice forever, and the requests are freed."""
    from ninfer_rt.server.scheduler import Handle
    srv, _, pool = fake

    async def broken(self):
        raise RuntimeError("boom")
    monkeypatch.setattr(Handle, "next_event", broken)
    r = _post(srv, "/v1/completions", {"model": MODEL_ID, "prompt": "abc", "max_tokens": 4, "n": 2, "stream": True})
    (err,) = [c for c in _chunks(r) if "error" in c]
    assert err["error"]["code"] == "internal_error" and "RuntimeError" in err["error"]["message"]
    monkeypatch.undo()
    wait_idle(srv)
    assert pool.free_pages() == pool.num_pages


def test_a_stream_closed_early_cancels_every_choice():
    """Closed after its first chunk, before the choices' readers ever ran: every engine request is cancelled."""
    from ninfer_rt.server import bodies as B
    from ninfer_rt.server.replies import Choice, _stream

    class H:
        cancelled = 0

        def cancel(self):
            self.cancelled += 1

        async def next_event(self):
            await asyncio.sleep(10)

    async def run():
        hs = [H() for _ in range(3)]
        gen = _stream([Choice(h) for h in hs], B.Chunks("id", MODEL_ID, chat=True, include_usage=False), None)
        await gen.__anext__()
        await gen.aclose()
        return hs
    assert all(h.cancelled >= 1 for h in asyncio.run(run()))
