"""Rank programs for tests/test_tp.py. Spawned ranks import this module, so it must not import transformers
(hf_tiny): a follower then starts in ~2 s instead of ~6 s on the shared CI cores."""
from __future__ import annotations

import torch

from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.engine import Engine, cache_config
from ninfer_rt.engine_core import Follower
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


def run_engine(engine: Engine, prompts: list[list[int]]) -> dict[str, list[int]]:
    out = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, REQUESTS[i % len(REQUESTS)])
        out[f"r{i}"] = []
    while engine.has_work():
        for o in engine.step():
            out[o.req_id] += o.new_token_ids
    return out


def rank_program(group, path, ids, prompts, k):
    """Every rank: the fixed model calls, then the engine (rank 0) or its follower (others). Grad mode off only
    inside (rank 0 runs in the test process, whose later tests need it on)."""
    with torch.no_grad():
        return _rank_program(group, path, ids, prompts, k)


def _rank_program(group, path, ids, prompts, k):
    loaded = load(path, rank=group.rank, tp_size=group.size)
    calls = fixed_calls(Model(loaded.config, loaded.weights, TorchOps(), group), ids)
    spec = SpecConfig(num_draft_tokens=k)
    if group.rank == 0:
        eng = Engine(loaded, TorchOps(), group, spec, max_batch=MAX_BATCH, kv_pages=KV_PAGES, prefill_chunk=CHUNK)
        tokens = run_engine(eng, prompts)
        eng.shutdown()
        return calls, tokens, eng.stats.spec.to_dict()
    Follower(loaded, TorchOps(), group, spec, cache_config(loaded.config, MAX_BATCH, KV_PAGES)).run()
    return None
