"""Rank programs for tests/test_tp.py. Spawned ranks import this module, so it must not import transformers
(hf_tiny): a follower then starts in ~2 s instead of ~6 s on the shared CI cores."""
from __future__ import annotations

import torch

from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.engine import Engine, cache_config, engine_layout
from ninfer_rt.engine_follower import Follower
from ninfer_rt.graphs import GraphConfig
from ninfer_rt.loader import load
from ninfer_rt.model import Model, MtpInput, SeqInput
from ninfer_rt.sampling import SamplingParams
from ninfer_rt.speculative import SpecConfig

MAX_BATCH, KV_PAGES, CHUNK = 4, 64, 7
REQUESTS = (SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.8, top_k=50, seed=5, max_tokens=12, ignore_eos=True))


def fixed_calls(model: Model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Two prefill chunks, a snapshot verify + commit(2), one decode, MTP alignment and a draft step."""
    st = model.new_state()
    a = model.forward([SeqInput(ids[:11], st)])
    b = model.forward([SeqInput(ids[11:20], st)])
    ver = model.forward([SeqInput(ids[20:24], st, snapshot=True)])
    st.commit(2)
    dec = model.forward([SeqInput(ids[22:23], st)])
    mtp = model.mtp_forward([MtpInput(ids[1:21], torch.cat([a.hidden, b.hidden]), st.mtp)])
    draft = model.mtp_forward([MtpInput(ids[21:22], mtp.hidden[-1:], st.mtp)])
    st.free()
    return [a.logits, b.logits, ver.logits, dec.logits, mtp.logits, draft.logits, dec.hidden]


def run_engine(engine: Engine, prompts: list[list[int]], requests=REQUESTS) -> dict[str, list[int]]:
    out = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, requests[i % len(requests)])
        out[f"r{i}"] = []
    while engine.has_work():
        for o in engine.step():
            out[o.req_id] += o.new_token_ids
    return out


def rank_program(group, path, ids, prompts, k, rounds: str = ""):
    """Every rank: the fixed model calls, then the engine (rank 0) or its follower (others). Grad mode off only
    inside (rank 0 runs in the test process, whose later tests need it on). rounds: "greedy" (greedy requests) or
    "sampled" (greedy and sampled ones) on the graph runner's eager bodies with round graphs on every rank
    (`ninfer_rt.graph_round`, sampled ones `graph_round_sampled`); "": no graphs, both requests."""
    with torch.no_grad():
        return _rank_program(group, path, ids, prompts, k, rounds)


def round_graphs(k: int, sampled: bool = False) -> GraphConfig:
    return GraphConfig(batch_sizes=(1, 2, 4), tokens=tuple(range(1, k + 2)), mtp_tokens=tuple(range(1, k + 2)),
                       kv_buckets=(64,), eager=True, round_drafts=k, sampled_rounds=sampled)


def _rank_program(group, path, ids, prompts, k, rounds):
    loaded = load(path, rank=group.rank, tp_size=group.size)
    calls = fixed_calls(Model(loaded.config, loaded.weights, TorchOps(), group), ids)
    spec = SpecConfig(num_draft_tokens=k)
    graphs = round_graphs(k, rounds == "sampled") if rounds else None
    if group.rank == 0:
        eng = Engine(loaded, TorchOps(), group, spec, max_batch=MAX_BATCH, kv_pages=KV_PAGES, prefill_chunk=CHUNK,
                     graphs=graphs or "off")
        send, draws = eng._send_plan, []
        eng._send_plan = lambda plan: (draws.append(len(plan.draws)), send(plan))[1]
        tokens = run_engine(eng, prompts, REQUESTS[:1] if rounds == "greedy" else REQUESTS)
        eng.shutdown()
        g = eng.graphs.stats if eng.graphs is not None else None
        return calls, tokens, {**eng.stats.spec.to_dict(), "graph_rounds": g and g.rounds,
                               "sampled_rounds": g and g.sampled_rounds, "draw_steps": sum(map(bool, draws))}
    lay = engine_layout(loaded, TorchOps(), spec, MAX_BATCH, KV_PAGES, graphs=graphs or "off")
    Follower(loaded, TorchOps(), group, spec, lay.cache if rounds else cache_config(loaded.config, MAX_BATCH, KV_PAGES),
             graphs=lay.graphs).run()
    return None
