"""A greedy MTP round as one graph (ninfer_rt.graph_round) against the separate draft and verify steps: the same
drafts, verify logits, hiddens and GDN snapshots (torch backend, and the Triton kernels under the interpreter);
the Engine's tokens with round graphs equal the plain Engine's (a trained model, so drafts get accepted and
rejected); the cases that take the separate steps; the configuration and its variable."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before any kernel is defined (the Triton case below)

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))     # last: bench/ must not shadow anything

import synth_artifact as synth
from greedy_close import TOP, assert_greedy_close, run_logprobs
from hf_tiny import build_hf_model, loaded_model
from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.engine import Engine, EngineError, engine_layout
from ninfer_rt.graph_round import RoundRow
from ninfer_rt.graphs import GraphConfig, GraphRunner
from ninfer_rt.loader import load
from ninfer_rt.model import Model, MtpInput, SeqInput
from ninfer_rt.sampling import SamplingParams
from ninfer_rt.speculative import SpecConfig
from ninfer_rt.state import CacheConfig
from numerics import rel
from test_engine_graphs import run
from tiny_util import pack_tiny

TOL = 1e-5               # rel L2, fp32: the same kernels at the same shapes, the drafts fed on the device
NONSPECIAL = 246         # hf_tiny: ids >= 246 are special tokens
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(k: int, **kw) -> GraphConfig:
    cfg = dict(batch_sizes=(1, 2), tokens=tuple(range(1, k + 2)), mtp_tokens=tuple(range(1, k + 2)),
               kv_buckets=(64,), eager=True, round_drafts=k)
    return GraphConfig(**{**cfg, **kw})


def _prefilled(m: Model, prompts: list[list[int]], dev) -> list[RoundRow]:
    """Each prompt prefilled and aligned (MTP over it with the target hiddens) -> its first round's inputs."""
    rows = []
    for p in prompts:
        st, ids = m.new_state(), torch.tensor(p, device=dev)
        out = m.forward([SeqInput(ids, st)])
        last = int(out.logits[-1].argmax())
        nxt = torch.cat([ids[1:], torch.tensor([last], device=dev)])
        d = m.mtp_forward([MtpInput(nxt, out.hidden, st.mtp, logits="last")])
        rows.append(RoundRow(last, st, d.logits[-1], d.hidden[-1]))
    return rows


def _separate(m: Model, rows: list[RoundRow], k: int):
    """The reference round: draft steps and the verify as the model's own forwards -> (drafts, verify Output)."""
    drafts = []
    for r in rows:
        d, lg, h = [], r.logits, r.hidden[None]
        for j in range(k):
            d.append(int(lg.argmax()))
            if j < k - 1:
                o = m.mtp_forward([MtpInput(torch.tensor([d[-1]], device=h.device), h, r.state.mtp)])
                lg, h = o.logits[-1], o.hidden
        drafts.append(d)
    dev = rows[0].hidden.device
    out = m.forward([SeqInput(torch.tensor([r.last] + d, device=dev), r.state, snapshot=True)
                     for r, d in zip(rows, drafts)])
    return drafts, out


def _check_round(ref: Model, m: Model, prompts, k: int, tol: float) -> None:
    dev = ref.device
    a_rows, b_rows = _prefilled(ref, prompts, dev), _prefilled(m, prompts, dev)
    runner = GraphRunner(m, _config(k))
    want_drafts, want = _separate(ref, a_rows, k)
    got, packed = runner.round(b_rows, k)
    from ninfer_rt.graph_round import read_back
    drafts, am, _, tail = read_back(packed, len(prompts), runner._pad(len(prompts)), k)
    assert runner.stats.rounds == 1 and drafts == want_drafts and tail == []
    assert am == want.logits.argmax(-1).tolist()
    assert rel(got.logits, want.logits) <= tol and rel(got.hidden, want.hidden) <= tol
    assert got.cu_seqlens == want.cu_seqlens and got.logit_rows == want.logit_rows
    for a, b in zip(a_rows, b_rows):
        assert b.state.mtp.length == a.state.mtp.length and b.state.pending is not None
        a.state.commit(2)
        b.state.commit(2)
        assert rel(m.gdn_pool.rec[:, b.state.gdn_row], ref.gdn_pool.rec[:, a.state.gdn_row]) <= tol
        assert rel(m.gdn_pool.conv[:, b.state.gdn_row], ref.gdn_pool.conv[:, a.state.gdn_row]) <= tol


@pytest.mark.parametrize("k,n", [(1, 1), (3, 1), (2, 2)], ids=["K1", "K3", "K2-batch2"])
def test_round_graph_equals_separate_steps(k, n):
    loaded = loaded_model(build_hf_model(seed=3))

    def model():
        return Model(loaded.config, dict(loaded.weights), TorchOps(),
                     cache=CacheConfig(num_pages=40, page_size=8, max_seqs=4), dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, NONSPECIAL, (n_,), generator=g).tolist() for n_ in (9, 14)[:n]]
    _check_round(model(), model(), prompts, k, TOL)


def test_round_graph_equals_separate_steps_triton(tmp_path):
    """The Triton kernels (the interpreter on CPU, fp32): the drafts' ids written by the graph itself (the argmax
    into the draft step's ids, the drafts into the verify's ids) feed the same kernels the separate steps run."""
    from small_triton import model_factory
    model, _ = model_factory(str(tmp_path), num_pages=40, max_seqs=4)
    _check_round(model(), model(), [list(range(3, 14)), list(range(40, 47))], 2, 1e-4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The shipped trained ninfer-tiny: its MTP drafts are accepted part of the time (rollbacks of every length)."""
    return load(pack_tiny(tmp_path_factory.mktemp("tiny")), device="cpu", dtype=torch.float32)


PROMPTS = [list(range(40, 57)), list(range(100, 109))]       # with prefill_chunk 7: rounds beside prompt chunks


@pytest.mark.parametrize("k", [1, 3], ids=["K1", "K3"])
def test_engine_round_graphs_equal_plain_engine(tiny, k):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = SpecConfig(num_draft_tokens=k)
    want = run(Engine(tiny, TorchOps(), spec=spec, prefill_chunk=7, max_batch=2), PROMPTS, params)
    eng = Engine(tiny, TorchOps(), spec=spec, prefill_chunk=7, max_batch=2, graphs=_config(k))
    assert run(eng, PROMPTS, params) == want
    st, spec_st = eng.graphs.stats, eng.stats.spec
    assert st.rounds >= 5 and 0 < spec_st.accepted < spec_st.drafted      # accepted and rejected drafts
    assert eng.stats.to_dict()["graph_rounds"] == st.rounds
    # rounds near max_tokens draft fewer than K: those take the separate steps
    assert st.reasons.get("round: no round graph for this K", 0) >= 1
    eng.shutdown()
    assert eng.model.kv_pool.free_pages() == eng.cache.num_pages


def test_sampled_and_logprob_requests_beside_greedy_ones(tiny):
    """A sampled request in the batch: its steps are no chain, so no round graph; a greedy request asking for
    logprobs drafts by argmax and goes through the round graph. The tokens and logprobs of the Engine without
    round graphs."""
    k = 2
    outs = []
    for rd in (0, k):
        eng = Engine(tiny, TorchOps(), spec=SpecConfig(num_draft_tokens=k), prefill_chunk=7, max_batch=2,
                     graphs=_config(k, round_drafts=rd))
        eng.add_request("g", PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))
        got, lps = {"g": [], "s": []}, []
        for i in range(60):
            if i == 6:
                eng.add_request("s", PROMPTS[1], SamplingParams(temperature=0.8, seed=3, max_tokens=10,
                                                                ignore_eos=True))
            for o in eng.step():
                got[o.req_id] += o.new_token_ids
                lps += [(o.req_id, round(lp.logprob, 5)) for lp in (o.logprobs or [])]
            if not eng.has_work():
                break
        outs.append((got, lps, eng.graphs.stats.rounds))
        eng.shutdown()
    assert outs[0][:2] == outs[1][:2] and outs[0][2] == 0 and outs[1][2] >= 2


def test_round_graph_skips_what_it_cannot_serve():
    loaded = loaded_model(build_hf_model(seed=3))
    m = Model(loaded.config, dict(loaded.weights), TorchOps(),
              cache=CacheConfig(num_pages=40, page_size=8, max_seqs=4), dtype=torch.float32)
    rows = _prefilled(m, [list(range(5, 14))], "cpu")
    r = GraphRunner(m, _config(2, kv_buckets=(11,)))
    assert r.round(rows, 3) is None and r.round(rows, 2) is None          # another K; 9 + 3 tokens pass 11
    assert r.stats.reasons == {"round: no round graph for this K": 1, "round: context past the largest KV bucket": 1}
    r = GraphRunner(m, _config(2))
    assert r.round(rows, 2) is not None
    assert r.round(rows, 2) is None                      # the first round is not committed: its snapshot rows
    assert r.stats.reasons == {"round: snapshot buffers in use": 1}
    rows[0].state.commit(1)
    r.close()
    assert r.round(rows, 2) is None and r.stats.reasons["round: no round graph for this K"] == 1


@pytest.mark.parametrize("kw,msg", [
    (dict(round_drafts=3), "graphs.round_drafts"),                       # verify size 4 not captured
    (dict(round_drafts=-1), "graphs.round_drafts"),
    (dict(round_drafts=True), "graphs.round_drafts"),
    (dict(round_drafts=1, mtp_tokens=(2,)), "graphs.round_drafts")], ids=["no-verify-size", "negative", "bool",
                                                                          "no-draft-step"])
def test_graph_config_rejects_round_drafts(kw, msg):
    with pytest.raises(ValueError, match=msg):
        GraphConfig(**{**dict(tokens=(1, 2, 3), mtp_tokens=(1, 2, 3)), **kw})


def test_round_graphs_variable(monkeypatch):
    class TritonOps:                     # graph_config captures only for the triton backend, by its class name
        pass
    loaded = loaded_model(build_hf_model(seed=3))
    loaded.device = "cuda"
    spec = SpecConfig(num_draft_tokens=3)
    assert engine_layout(loaded, TritonOps(), spec, 2, 40).graphs.round_drafts == 3
    assert engine_layout(loaded, TritonOps(), None, 2, 40).graphs.round_drafts == 0
    monkeypatch.setenv("NINFER_ROUND_GRAPHS", "0")
    assert engine_layout(loaded, TritonOps(), spec, 2, 40).graphs.round_drafts == 0
    monkeypatch.setenv("NINFER_ROUND_GRAPHS", "yes")
    with pytest.raises(EngineError, match="NINFER_ROUND_GRAPHS='yes': expected 1"):
        engine_layout(loaded, TritonOps(), spec, 2, 40)


@gpu
def test_captured_round_graphs_equal_separate_graphs_gpu(tmp_path_factory, monkeypatch):
    """bf16 Triton kernels, captured: the Engine with round graphs gives the tokens of the Engine that replays the
    draft and verify graphs one by one (NINFER_ROUND_GRAPHS=0), at batch 1 and 2."""
    from ninfer_rt.backends.triton_ops import TritonOps as RealTritonOps
    paths, _ = synth.build(str(tmp_path_factory.mktemp("nvfp4")), synth.TINY, "nvfp4", workers=1)
    prompts = [list(range(5, 20)), list(range(30, 41))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=TOP)
    outs = []
    for v in ("0", "1"):
        monkeypatch.setenv("NINFER_ROUND_GRAPHS", v)
        eng = Engine(load(paths[0], device="cuda", dtype=torch.bfloat16), RealTritonOps(),
                     spec=SpecConfig(num_draft_tokens=3), max_batch=2, kv_pages=64, graphs="auto")
        outs.append((run_logprobs(eng, prompts[:1], params), run_logprobs(eng, prompts, params),
                     eng.graphs.stats.rounds))
        eng.shutdown()
    assert outs[0][2] == 0 and outs[1][2] > 0
    # the same kernels at the same shapes: equal, or apart only at a near tie (s44's H100 run: one request's
    # last token of 48 differed; the 27B artifact's 256-token runs hashed equal, bench/NOTES.md §45)
    assert assert_greedy_close(outs[0][0], outs[1][0]) + assert_greedy_close(outs[0][1], outs[1][1]) <= 1


def _steps(engine, prompts, params) -> tuple[dict, list]:
    """Tokens per request and every step's (request, drafted, accepted) reports."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    out, reports = {f"r{i}": [] for i in range(len(prompts))}, []
    while engine.has_work():
        for o in engine.step():
            out[o.req_id] += o.new_token_ids
            reports.append((o.req_id, o.drafted, o.accepted))
    return out, reports


@pytest.mark.parametrize("rounds", [0, 3], ids=["separate-steps", "round-graphs"])
def test_rounds_near_max_tokens_draft_the_batch_count(tiny, rounds):
    """Two requests ending at different max_tokens: with graphs, the one near its end drafts the batch's K anyway
    (`Engine._even_drafts`), so no verify step has mixed draft counts (which would run eagerly). Its extra drafts are
    never emitted: the tokens, the per-step drafted / accepted reports and the statistics are the plain Engine's,
    whose rounds there draft fewer."""
    k, spec = 3, SpecConfig(num_draft_tokens=3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (13, 22)]
    plain = Engine(tiny, TorchOps(), spec=spec, prefill_chunk=32, max_batch=2)
    want = _steps(plain, PROMPTS, params)
    eng = Engine(tiny, TorchOps(), spec=spec, prefill_chunk=32, max_batch=2, graphs=_config(k, round_drafts=rounds))
    got = _steps(eng, PROMPTS, params)
    assert got == want
    assert eng.stats.spec.to_dict() == plain.stats.spec.to_dict()
    assert "token count" not in eng.graphs.stats.reasons                  # no mixed verify step went eagerly
    assert any(d is not None and d < k for _, d, _ in want[1])             # ... where the plain Engine's did vary
    assert eng.graphs.stats.rounds >= (8 if rounds else 0)            # batch-2 rounds drafting K: round graphs
    eng.shutdown()
    assert eng.model.kv_pool.free_pages() == eng.cache.num_pages


def test_reservation_holds_the_drafts_past_max_tokens(tiny):
    """The KV reservation of a request holds K positions past prompt + max_tokens, for the drafts of its last
    rounds (capped at the context limit)."""
    eng = Engine(tiny, TorchOps(), spec=SpecConfig(num_draft_tokens=3), max_batch=2, max_model_len=64)
    plain = Engine(tiny, TorchOps(), max_batch=2, max_model_len=64)
    from ninfer_rt.engine_core import Seq
    s = Seq("r", list(range(20)), params=SamplingParams(max_tokens=12))
    ps = eng.model.kv_pool.page_size
    assert eng._reserve_pages(s) == -(-(20 + 12 + 3) // ps) and plain._reserve_pages(s) == -(-(20 + 12) // ps)
    s.params = SamplingParams(max_tokens=44)
    assert eng._reserve_pages(s) == -(-64 // ps)


@pytest.mark.parametrize("graphs", [False, True], ids=["no-graphs", "round-graphs"])
def test_sampled_drafts_stay_on_the_device(tiny, monkeypatch, graphs):
    """Seeded sampled requests (TP1): their drafts are drawn on the device and chained (no read-back per draft
    step) from the same distributions and generator streams as drafts read back one by one, so the tokens are the
    same; a round graph (argmax drafts) never serves them."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.6, top_k=20, seed=3, max_tokens=16, ignore_eos=True)]
    outs, chained = [], []
    for chain in ("0", "1"):
        monkeypatch.setenv("NINFER_DRAFT_CHAIN", chain)
        eng = Engine(tiny, TorchOps(), spec=SpecConfig(num_draft_tokens=3), prefill_chunk=32, max_batch=2,
                     graphs=_config(3) if graphs else "off")
        calls = []
        real = eng._draft_chained
        eng._draft_chained = lambda dec: calls.append(len(dec)) or real(dec)
        outs.append(_steps(eng, PROMPTS, params))
        chained.append(len(calls))
        assert not graphs or eng.graphs.stats.rounds == 0
        eng.shutdown()
    assert outs[0] == outs[1] and chained[0] == 0 and chained[1] >= 4
    assert 0 < sum(a or 0 for _, _, a in outs[1][1])                           # some drafts were accepted
