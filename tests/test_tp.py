"""Multi-process tensor parallelism over gloo: TP2/TP4 logits and engine tokens equal TP1; the startup
collective check refuses a broken transport."""
from __future__ import annotations

import pytest
import torch
from hf_tiny import build_hf_model, make_tiny_artifact
from tp_workers import rank_program

from ninfer_rt.tp import TPError, agree, check_collectives, launch
from ninfer_rt.tp_group import LocalGroup, TPGroup
from numerics import rel

# TP partial sums are added in another order than the TP1 GEMM reduction (fp32)
TP_TOL = 1e-5
# geometry legal for TP4: 4 KV heads, 4 GDN key heads
GEOMETRY = {"linear_num_key_heads": 4, "linear_num_value_heads": 8, "num_key_value_heads": 4,
            "num_attention_heads": 8, "head_dim": 16, "intermediate_size": 192}




pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, lm_head_drafts):
    tiny = build_hf_model(seed=11, **GEOMETRY)
    base = tmp_path_factory.mktemp("tp")
    for tp in (1, 2, 4):
        make_tiny_artifact(base / f"tp{tp}", tiny, tp=tp)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 246, (30,), generator=g)
    prompts = [torch.randint(0, 246, (n,), generator=g).tolist() for n in (9, 16)]
    ref = rank_program(LocalGroup(), base / "tp1", ids, prompts, 3)
    return base, ids, prompts, ref


@pytest.mark.parametrize("tp", [2, 4], ids=["tp2", "tp4"])
def test_tp_processes_match_tp1(setup, tp, lm_head_drafts):
    base, ids, prompts, (ref_calls, ref_tokens, ref_stats) = setup
    args = (base / f"tp{tp}", ids, prompts, 3)
    with launch(tp, rank_program, args) as lch:
        calls, tokens, stats = rank_program(lch.group, *args)
    for i, (got, want) in enumerate(zip(calls, ref_calls)):
        assert got.shape == want.shape, f"call {i}"
        assert rel(got, want) <= TP_TOL, f"call {i}: rel L2 {rel(got, want):.2e}"
    assert tokens == ref_tokens                 # greedy and seeded sampling, MTP K=3 rounds on every rank
    assert stats["drafted"] == ref_stats["drafted"] and stats["accepted"] == ref_stats["accepted"]
    # the sampled request's drafts stayed on the device: every rank drew them from the leader's generator states
    assert stats["draw_steps"] > 0
    assert all(p.exitcode == 0 for p in lch.procs)


@pytest.mark.parametrize("rounds", ["greedy", "sampled"])
def test_tp2_round_graphs_match_tp1(setup, rounds):
    """MTP rounds as one graph on every rank (the runner's eager bodies over gloo): TP2's tokens are TP1's, and
    the rounds went through the round graphs; "sampled": a seeded top-k request beside a greedy one, whose rounds
    every rank draws and decides in the sampled round graphs from the plan's generator states."""
    base, ids, prompts, _ = setup
    ref = rank_program(LocalGroup(), base / "tp1", ids, prompts, 3, rounds)
    args = (base / "tp2", ids, prompts, 3, rounds)
    with launch(2, rank_program, args) as lch:
        _, tokens, stats = rank_program(lch.group, *args)
    assert tokens == ref[1] and stats["graph_rounds"] == ref[2]["graph_rounds"] > 0
    assert stats["accepted"] == ref[2]["accepted"]
    assert stats["sampled_rounds"] == ref[2]["sampled_rounds"]
    assert (stats["sampled_rounds"] > 0) == (rounds == "sampled")
    assert (stats["draw_steps"] > 0) == (rounds == "sampled")
    assert all(p.exitcode == 0 for p in lch.procs)


class SimGroup(TPGroup):
    """Rank 0 of a simulated group: the other ranks' contributions are recomputed locally."""

    def __init__(self, size):
        self.size, self.rank = size, 0

    def all_reduce(self, x):
        out = x.float().clone()
        base = torch.arange(x.numel(), dtype=torch.float32)
        for r in range(1, self.size):     # what check_collectives has rank r contribute
            out += base * (r + 1) + 7 * r if x.dtype == torch.float32 else torch.remainder(base, 16) * (r + 1)
        return out.to(x.dtype)

    def all_gather_last(self, x):
        return torch.cat([x + r for r in range(self.size)], dim=-1)


@pytest.mark.parametrize("group", [SimGroup(4), LocalGroup()], ids=["sim-tp4", "local-tp1"])
def test_collective_check_accepts_a_correct_group(monkeypatch, group):
    """Returns quietly on a correct group, having exercised every collective the model uses."""
    seen = []
    for name in ("all_reduce", "all_gather_last"):
        real = getattr(group, name)
        monkeypatch.setattr(group, name, lambda x, real=real, name=name: seen.append((name, x.dtype)) or real(x))
    assert check_collectives(group) is None
    assert seen == [("all_reduce", torch.float32), ("all_reduce", torch.bfloat16),
                    ("all_gather_last", torch.float32)]


@pytest.mark.parametrize("fault", ["dropped_rank", "one_ulp", "nan", "gather_order", "gather_shape"])
def test_collective_check_refuses_a_broken_group(monkeypatch, fault):
    g = SimGroup(2)
    good_reduce, good_gather = g.all_reduce, g.all_gather_last
    if fault == "dropped_rank":
        monkeypatch.setattr(g, "all_reduce", lambda x: x)
    elif fault == "one_ulp":
        def reduce(x):
            y = good_reduce(x)
            y[-1] = torch.nextafter(y[-1], torch.tensor(float("inf"), dtype=y.dtype))
            return y
        monkeypatch.setattr(g, "all_reduce", reduce)
    elif fault == "nan":
        monkeypatch.setattr(g, "all_reduce", lambda x: good_reduce(x).index_fill_(0, torch.tensor([3]), float("nan")))
    elif fault == "gather_order":
        monkeypatch.setattr(g, "all_gather_last", lambda x: torch.cat([x + 1, x], dim=-1))
    else:
        monkeypatch.setattr(g, "all_gather_last", lambda x: good_gather(x)[..., :-1])
    with pytest.raises(TPError, match="self-check.*refusing to run"):
        check_collectives(g)


def test_agree_raises_on_any_rank_error():
    agree(LocalGroup(), None)
    with pytest.raises(TPError, match="shard broken"):
        agree(LocalGroup(), "shard broken")
