"""vLLM's priority scheduling: `--scheduling-policy priority` queues requests by their `priority` (lower first,
then arrival); under the default fcfs a nonzero priority is a 400. The FakeEngine server checks the order in which
queued requests reach the engine; the CLI flag reaches the scheduler."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from test_server import (CHAT, MODEL_ID, FakeEngine, FakePool, _post, fake, fake_server,  # noqa: F401
                         tiny_tokenizer, wait_idle)

from ninfer_rt.sampling import SamplingParams
from ninfer_rt.server.app import ServerState
from ninfer_rt.server.scheduler import Scheduler, SchedulerConfig


def _queued_order(policy: str, priorities: list[int]) -> list[int]:
    """Submit one request per priority to a scheduler that is not stepping -> the waiting queue's priorities."""
    pool = FakePool(64, 4)
    sched = Scheduler(FakeEngine(pool), pool, tiny_tokenizer(), SchedulerConfig(max_context=32, policy=policy),
                      ServerState(model_id=MODEL_ID).metrics)

    async def submit():
        for i, p in enumerate(priorities):
            h = sched.handle([1, 2, 3], SamplingParams(max_tokens=4), priority=p)
            h.choice = i                     # its arrival, to tell equal priorities apart
            sched.submit_all([h])
    asyncio.run(submit())
    return [(h.priority, h.choice) for h in sched._waiting]


def test_priority_queue_orders_by_priority_then_arrival():
    got = _queued_order("priority", [5, 0, 5, -1, 0])
    assert got == [(-1, 3), (0, 1), (0, 4), (5, 0), (5, 2)]


def test_fcfs_queue_keeps_arrival_order():
    assert _queued_order("fcfs", [0, 0, 0]) == [(0, 0), (0, 1), (0, 2)]


def test_policy_is_validated():
    with pytest.raises(ValueError, match="scheduler.policy: expected one of fcfs, priority, got 'lifo'"):
        SchedulerConfig(policy="lifo")


def test_fcfs_server_refuses_a_priority(fake):
    srv, _, _ = fake
    r = _post(srv, "/v1/chat/completions", {**CHAT, "priority": -2})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "priority"
    assert "--scheduling-policy priority" in err["message"]
    assert _post(srv, "/v1/chat/completions", {**CHAT, "priority": 0}).status_code == 200


class OrderEngine(FakeEngine):
    """Records the order requests reach it."""

    def __init__(self, pool, **kw):
        super().__init__(pool, **kw)
        self.order: list[int] = []

    def add_request(self, rid, prompt_ids, params) -> None:
        super().add_request(rid, prompt_ids, params)
        self.order.append(params.max_tokens)


def test_priority_server_admits_the_lowest_value_first():
    srv, engine, pool = fake_server(max_concurrency=1, policy="priority", engine_cls=OrderEngine, step_s=0.02)
    try:
        def post(max_tokens, priority):
            body = {"model": MODEL_ID, "prompt": "abc", "max_tokens": max_tokens, "priority": priority}
            assert _post(srv, "/v1/completions", body).status_code == 200
        first = threading.Thread(target=post, args=(12, 0))       # occupies the one slot for ~12 steps
        first.start()
        while not engine.order:
            time.sleep(0.005)
        later = [threading.Thread(target=post, args=(mt, p)) for mt, p in ((5, 3), (6, 1), (7, -4), (8, 1))]
        for t in later:                  # queued one after another while the first runs
            t.start()
            time.sleep(0.05)
        for t in [first, *later]:
            t.join(30)
        assert engine.order == [12, 7, 6, 8, 5]                  # -4, then the two 1s in arrival order, then 3
        wait_idle(srv)
        assert pool.free_pages() == pool.num_pages
    finally:
        srv.close()
