"""Greedy tokens of two runs compared the way vLLM's tests compare runs of different kernels
(`check_logprobs_close`): equal up to their first divergence, and there each run's token is among the other's
top alternatives, within `GAP` nats of the other's choice in both runs. Random-weight models have near-tie logits,
and bf16 steps that group the same math differently (a captured graph against eager calls, pieces against one
chunk) may round past a tie; a wrong state or a wrong token fed back gives a far larger gap."""
from __future__ import annotations

GAP = 0.1           # nats between the two candidates at a divergence, in each run's own distribution
TOP = 3             # alternatives each run records per token


def run_logprobs(engine, prompts, params) -> dict[str, list]:
    """Every request's TokenLogprobs (params must ask for `TOP` logprobs)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.req_id] += o.logprobs or []
    return out


def assert_greedy_close(a: dict[str, list], b: dict[str, list]) -> int:
    """-> how many requests diverged (each only at a near tie, checked here)."""
    assert a.keys() == b.keys()
    diverged = 0
    for rid in a:
        x, y = a[rid], b[rid]
        assert len(x) == len(y), (rid, len(x), len(y))
        for i, (p, q) in enumerate(zip(x, y)):
            if p.token_id == q.token_id:
                continue
            tp, tq = dict(p.top), dict(q.top)
            where = f"{rid} token {i}: {p.token_id} ({p.logprob:.4f}) vs {q.token_id} ({q.logprob:.4f})"
            assert q.token_id in tp and p.token_id in tq, f"{where}: neither among the other's top {TOP}"
            assert p.logprob - tp[q.token_id] <= GAP and q.logprob - tq[p.token_id] <= GAP, \
                f"{where}: not a near tie (gaps {p.logprob - tp[q.token_id]:.4f}, {q.logprob - tq[p.token_id]:.4f})"
            diverged += 1
            break
    return diverged
