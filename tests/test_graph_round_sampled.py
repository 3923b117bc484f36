"""Sampled MTP rounds as one graph (ninfer_rt.graph_round_sampled) against the separate steps: seeded requests get
the same tokens and per-step reports with the drafts drawn and the verdicts decided inside the graph (torch
backend, eager static-buffer bodies); the sampling the graph does not hold takes the separate steps; the
configuration and its variable; the captured graphs on a GPU."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))     # last: bench/ must not shadow anything

from hf_tiny import build_hf_model, loaded_model
from ninfer_rt import graph_round_sampled
from ninfer_formats.errors import NinferError
from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.engine import Engine, EngineError, engine_layout
from ninfer_rt.graphs import GraphConfig
from ninfer_rt.loader import load
from ninfer_rt.sampling import SamplingParams
from ninfer_rt.sampling_rows import TOPK_GRAPH_WIDTH, holds
from ninfer_rt.speculative import SpecConfig
from test_graph_round import _steps
from tiny_util import pack_tiny

PROMPTS = [list(range(40, 57)), list(range(100, 109))]
UNHELD = "round: sampling the graph does not hold (top-p or min-p without top_k, or a top_k past its width)"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(k: int, sampled: bool) -> GraphConfig:
    return GraphConfig(batch_sizes=(1, 2), tokens=tuple(range(1, k + 2)), mtp_tokens=tuple(range(1, k + 2)),
                       kv_buckets=(64,), eager=True, round_drafts=k, sampled_rounds=sampled)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The shipped trained ninfer-tiny: its MTP drafts are accepted part of the time."""
    return load(pack_tiny(tmp_path_factory.mktemp("tiny")), device="cpu", dtype=torch.float32)


def _both(tiny, k: int, params) -> list:
    """(tokens and reports, graph stats, spec stats) with the separate steps, then with sampled round graphs."""
    got = []
    for sampled in (False, True):
        eng = Engine(tiny, TorchOps(), spec=SpecConfig(num_draft_tokens=k), prefill_chunk=32, max_batch=2,
                     graphs=_config(k, sampled))
        got.append((_steps(eng, PROMPTS, params), eng.graphs.stats, eng.stats.spec))
        eng.shutdown()
        assert eng.model.kv_pool.free_pages() == eng.cache.num_pages
    return got


MIXES = {
    "temperature": [dict(temperature=0.8, seed=7), dict(temperature=1.1, seed=3)],
    "chat-defaults": [dict(temperature=0.7, top_k=20, top_p=0.95, seed=5),
                      dict(temperature=0.9, top_k=40, top_p=0.8, min_p=0.05, seed=11)],
    "greedy-beside": [dict(temperature=0), dict(temperature=0.6, top_k=20, seed=2)],
    "one-row": [dict(temperature=1.0, top_k=TOPK_GRAPH_WIDTH, seed=4)],
    "presence": [dict(temperature=0.6, top_k=20, top_p=0.95, presence_penalty=1.0, seed=5),     # NInfer's presets
                 dict(temperature=0.7, top_k=20, top_p=0.8, presence_penalty=1.5, frequency_penalty=0.3, seed=9)],
}


@pytest.mark.parametrize("k", [1, 3], ids=["K1", "K3"])
@pytest.mark.parametrize("mix", list(MIXES), ids=list(MIXES))
def test_sampled_round_graphs_equal_separate_steps(tiny, k, mix, monkeypatch):
    """Every round through the sampled round graph draws what the separate steps draw (the same generator streams,
    distributions and rejection), so seeded requests give the same tokens and reports; drafts get accepted and
    rejected. Batches without a top_k take the graphs without the top-k selection ("tround")."""
    kinds, real = [], graph_round_sampled.kind
    monkeypatch.setattr(graph_round_sampled, "kind", lambda rows, v: kinds.append(real(rows, v)) or kinds[-1])
    params = [SamplingParams(max_tokens=24, ignore_eos=True, **kw) for kw in MIXES[mix]]
    (want, st0, _), (got, st1, spec) = _both(tiny, k, params)
    assert got == want
    assert set(kinds) == {"tround" if mix == "temperature" else "sround"}
    assert st0.sampled_rounds == 0 and st0.reasons.get("round: no sampled round graphs", 0) >= 3
    assert st1.sampled_rounds >= 3
    # a greedy request finishing alone has greedy rounds; the others are all sampled
    assert st1.sampled_rounds == st1.rounds or any(p.greedy for p in params)
    assert 0 < spec.accepted < spec.drafted


def test_sampling_the_graph_does_not_hold_takes_the_separate_steps(tiny):
    """top-p without top_k needs a sort of the vocabulary: such a batch runs as separate steps, with the same
    tokens, and the reason is counted."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, seed=2, max_tokens=16, ignore_eos=True)]
    (want, _, _), (got, st, _) = _both(tiny, 2, params)
    assert got == want and st.sampled_rounds == 0 and st.reasons[UNHELD] >= 3


def test_penalties_the_graph_does_not_hold(tiny):
    """A presence penalty without a top_k (the "tround" graphs apply none) runs as separate steps, its drafts still
    on the device, with the same tokens; the reason is counted."""
    params = [SamplingParams(temperature=0.8, presence_penalty=1.0, seed=1, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, seed=2, max_tokens=16, ignore_eos=True)]
    (want, _, _), (got, st, _) = _both(tiny, 2, params)
    why = "round: penalties the graph does not hold (a repetition penalty, a greedy row's, or none with a top_k)"
    assert got == want and st.sampled_rounds == 0 and st.reasons[why] >= 3


def test_penalize_is_process_arithmetic():
    """`penalize` (the graph's) gives `sampling.process`'s penalized logits bit for bit, and leaves a row without
    penalties unchanged."""
    from ninfer_rt.sampling import process
    from ninfer_rt.sampling_rows import param_rows, penalize, softmax_rows
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 50, generator=g) * 4
    counts = torch.randint(0, 3, (3, 50), generator=g).float()
    params = [SamplingParams(temperature=1.0, presence_penalty=1.5, frequency_penalty=0.3),
              SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, frequency_penalty=-0.7)]
    got = penalize(x, counts, param_rows(params, 50))
    assert torch.equal(got[1], x[1])
    assert not torch.equal(got[0], x[0]) and not torch.equal(got[2], x[2])
    # temperature 1 and no truncation: process's distribution is the softmax of its penalized logits
    assert torch.equal(process(x, params, list(counts)), softmax_rows(got))


@pytest.mark.parametrize("kw,held", [
    (dict(temperature=0.8), True), (dict(temperature=0.8, top_k=20, top_p=0.95, min_p=0.1), True),
    (dict(temperature=0.8, top_k=TOPK_GRAPH_WIDTH + 1), False), (dict(temperature=0.8, top_p=0.9), False),
    (dict(temperature=0.8, min_p=0.1), False), (dict(temperature=0.8, top_k=10**6, top_p=1.0), True)],
    ids=["temperature", "chat", "wide-top-k", "top-p-alone", "min-p-alone", "top-k-past-vocab"])
def test_holds(kw, held):
    assert holds(SamplingParams(**kw), 1000) is held


def test_graph_config_and_variable(monkeypatch):
    with pytest.raises(ValueError, match="graphs.sampled_rounds"):
        GraphConfig(tokens=(1, 2), mtp_tokens=(1, 2), sampled_rounds=True)

    class TritonOps:                     # graph_config captures only for the triton backend, by its class name
        pass
    loaded = loaded_model(build_hf_model(seed=3))
    loaded.device = "cuda"
    spec = SpecConfig(num_draft_tokens=2)
    assert engine_layout(loaded, TritonOps(), spec, 2, 40).graphs.sampled_rounds is True
    monkeypatch.setenv("NINFER_SAMPLED_ROUNDS", "0")
    assert engine_layout(loaded, TritonOps(), spec, 2, 40).graphs.sampled_rounds is False
    monkeypatch.setenv("NINFER_SAMPLED_ROUNDS", "1")
    monkeypatch.setenv("NINFER_ROUND_GRAPHS", "0")
    assert engine_layout(loaded, TritonOps(), spec, 2, 40).graphs.sampled_rounds is False
    monkeypatch.setenv("NINFER_SAMPLED_ROUNDS", "on")
    with pytest.raises(EngineError, match="NINFER_SAMPLED_ROUNDS='on': expected 1"):
        engine_layout(loaded, TritonOps(), spec, 2, 40)
    monkeypatch.setenv("NINFER_SAMPLED_ROUNDS", "1")
    monkeypatch.setenv("NINFER_TOPK_KERNEL", "2")            # checked when the engine is laid out
    with pytest.raises(NinferError, match="NINFER_TOPK_KERNEL='2': expected 0"):
        engine_layout(loaded, TritonOps(), spec, 2, 40)


@gpu
@pytest.mark.parametrize("kw", [dict(top_k=20, top_p=0.95), {}], ids=["chat-defaults", "temperature"])
def test_captured_sampled_rounds_equal_separate_graphs_gpu(tmp_path_factory, monkeypatch, kw):
    """bf16 Triton kernels, captured, batch 1 (the same tensor shapes on both paths): a seeded request gives the
    tokens of the Engine whose sampled rounds replay the draft and verify graphs one by one."""
    from ninfer_rt.backends.triton_ops import TritonOps
    loaded = load(pack_tiny(tmp_path_factory.mktemp("tiny")), device="cuda", dtype=torch.bfloat16)
    params = [SamplingParams(temperature=0.7, seed=5, max_tokens=48, ignore_eos=True, **kw)]
    got = []
    for v in ("0", "1"):
        monkeypatch.setenv("NINFER_SAMPLED_ROUNDS", v)
        eng = Engine(loaded, TritonOps(), spec=SpecConfig(num_draft_tokens=3), prefill_chunk=32, max_batch=2)
        got.append((_steps(eng, PROMPTS, params), eng.graphs.stats.sampled_rounds))
        eng.shutdown()
    assert got[0][0] == got[1][0] and got[0][1] == 0 and got[1][1] >= 5
