"""Bounded load test: 16 concurrent loopback clients for 20 s against the real Engine (tiny fp32, MTP K=2).

Random prompt and completion lengths, chat and completions, streaming and not, greedy and seeded
sampling, a few malformed requests, and about a quarter of the streams dropped mid-way. Afterwards: no
5xx, every KV page and GDN slot back in the pool, and /metrics agreeing with what the clients saw.
The KV pool is smaller than slots x context, so admission has to wait for reservations.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from test_server import MODEL_ID, metric, real_server, tiny_artifact, wait_idle

CLIENTS = 16
DURATION_S = 20.0
KV_TOKENS = 512                  # 32 pages: < 4 slots x 256 context, so reservations make requests wait
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


@dataclass
class Tally:
    status: Counter = field(default_factory=Counter)
    finished: Counter = field(default_factory=Counter)     # finish_reason of requests read to the end
    dropped: int = 0                                        # streams the client closed early
    bad_sent: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


def _request(rng: random.Random) -> tuple[str, dict]:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
    body = {"model": MODEL_ID, "max_tokens": rng.randint(1, 40), "stream": rng.random() < 0.6}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, top_p=0.9, seed=rng.randint(0, 1000))
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": text}]
        body["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
        return "/v1/chat/completions", body
    body["prompt"] = text
    return "/v1/completions", body


async def _stream(client, path, body, tally: Tally, drop_after: int | None) -> None:
    async with client.stream("POST", path, json=body) as r:
        tally.status[r.status_code] += 1
        if r.status_code != 200:
            await r.aread()
            return
        n, usage, finish = 0, None, None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            n += 1
            if drop_after is not None and n >= drop_after:
                tally.dropped += 1
                return                       # leaving the block closes the connection mid-stream
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                finish = ch.get("finish_reason") or finish
        assert usage is not None and finish in ("stop", "length")
        tally.finished[finish] += 1
        tally.prompt_tokens += usage["prompt_tokens"]
        tally.completion_tokens += usage["completion_tokens"]


async def _blocking(client, path, body, tally: Tally) -> None:
    r = await client.post(path, json=body)
    tally.status[r.status_code] += 1
    if r.status_code == 200:
        d = r.json()
        tally.finished[d["choices"][0]["finish_reason"]] += 1
        tally.prompt_tokens += d["usage"]["prompt_tokens"]
        tally.completion_tokens += d["usage"]["completion_tokens"]


async def _client(url: str, seed: int, deadline: float, tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        while time.monotonic() < deadline:
            path, body = _request(rng)
            if rng.random() < 0.05:
                tally.bad_sent += 1
                body["max_tokens"] = "many"          # a malformed request now and then
                r = await client.post(path, json=body)
                tally.status[r.status_code] += 1
                assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
            elif body["stream"]:
                drop = rng.randint(1, 4) if rng.random() < 0.25 else None
                await _stream(client, path, body, tally, drop)
            else:
                await _blocking(client, path, body, tally)


def test_load_sixteen_clients_with_disconnects(tmp_path_factory):
    srv, rt = real_server(tiny_artifact(tmp_path_factory), kv_capacity=KV_TOKENS)
    try:
        tally = Tally()
        deadline = time.monotonic() + DURATION_S

        async def run():
            await asyncio.gather(*[_client(srv.url, seed, deadline, tally) for seed in range(CLIENTS)])
        asyncio.run(run())
        wait_idle(srv, timeout=30)
        print(f"load: status {dict(tally.status)}, finished {dict(tally.finished)}, dropped {tally.dropped}, "
              f"{tally.completion_tokens} completion tokens")

        assert not [s for s in tally.status if s >= 500], tally.status
        assert tally.bad_sent >= 1 and tally.status[400] == tally.bad_sent and set(tally.status) <= {200, 400}
        done = sum(tally.finished.values())
        assert done >= CLIENTS and tally.dropped >= 1, tally
        pool, gdn = rt.engine.model.kv_pool, rt.engine.model.gdn_pool
        assert pool.free_pages() == pool.num_pages and gdn.free_slots() == gdn.max_seqs
        assert not rt.engine.has_work()

        def m(name, labels=""):
            return metric(srv, name, labels)
        for reason in ("stop", "length"):           # a dropped stream may still have finished normally
            assert tally.finished[reason] <= m("ninfer_requests_total", f'finish_reason="{reason}"')
        total = sum(m("ninfer_requests_total", f'finish_reason="{r}"') for r in ("stop", "length", "abort"))
        assert total == done + tally.dropped
        assert m("ninfer_requests_total", 'finish_reason="abort"') <= tally.dropped
        assert m("ninfer_request_errors_total", 'status="400"') == tally.bad_sent
        assert m("ninfer_prompt_tokens_total") >= tally.prompt_tokens
        assert m("ninfer_generation_tokens_total") >= tally.completion_tokens
        assert m("ninfer_time_to_first_token_seconds_count") >= done
        assert m("ninfer_requests_running") == m("ninfer_requests_waiting") == 0
        assert m("ninfer_kv_pages_used") == m("ninfer_kv_pages_reserved") == 0
        assert m("ninfer_spec_decode_accepted_tokens_total") <= m("ninfer_spec_decode_drafted_tokens_total")
        assert m("ninfer_kv_pages_total") == pool.num_pages
    finally:
        srv.close()
        rt.close()
