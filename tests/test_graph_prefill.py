"""Short prefill chunks as consecutive batch-1 graph steps (ninfer_rt.graph_prefill) against the model's own
forward: the same logits, hiddens and states; the cases that must stay eager; the engine with and without."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before any kernel is defined (the Triton test below)

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))     # last: bench/ must not shadow anything

import synth_artifact as synth
from hf_tiny import build_hf_model, loaded_model
from ninfer_rt import engine_layout
from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.engine import Engine, EngineError, graph_config
from ninfer_rt.graph_prefill import pieces
from ninfer_rt.graphs import PREFILL_MAX_T, GraphConfig, GraphRunner
from ninfer_rt.loader import load
from ninfer_rt.model import Model, SeqInput
from ninfer_rt.sampling import SamplingParams
from ninfer_rt.speculative import SpecConfig
from ninfer_rt.state import CacheConfig
from numerics import rel
from test_engine_graphs import run

LOGIT_TOL = 1e-5          # rel L2, fp32 torch backend: the same math in pieces (GEMM row counts differ)
STATE_TOL = 1e-5
TRITON_TOL = 1e-4         # the Triton kernels (interpreter on CPU, fp32): GEMV pieces against the prefill GEMM
NONSPECIAL = 246          # hf_tiny: ids >= 246 are special tokens

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def nvfp4_path(tmp_path_factory):
    paths, _ = synth.build(str(tmp_path_factory.mktemp("nvfp4")), synth.TINY, "nvfp4", workers=1)
    return paths[0]


def _model(path):
    lm = load(path, device="cpu", dtype=torch.float32)
    return Model(lm.config, lm.weights, TorchOps(), cache=CacheConfig(num_pages=48, page_size=8, max_seqs=5),
                 dtype=torch.float32, consume_weights=True)


def _runner(m, **kw):
    cfg = dict(batch_sizes=(1, 2), tokens=(1, 3), mtp_tokens=(), kv_buckets=(96,), eager=True, prefill_tokens=(4, 8))
    return GraphRunner(m, GraphConfig(**{**cfg, **kw}))


@pytest.mark.parametrize("n,sizes,most,want", [
    (15, (1, 2, 4, 8, 16), 6, [8, 4, 2, 1]), (32, (1, 2, 4, 8, 16), 6, [16, 16]), (7, (1, 3, 4, 8), 6, [4, 3]),
    (3, (1,), 6, [1, 1, 1]), (100, (1, 2, 4, 8, 16), 6, None), (0, (1, 16), 6, None), (9, (1, 8), 1, None)],
    ids=["binary", "two-full", "verify-sizes", "ones", "too-many", "empty", "one-allowed"])
def test_pieces(n, sizes, most, want):
    assert pieces(n, sizes, most) == want


def test_prefill_max_t_is_the_decode_kernels_widest_step():
    from ninfer_kernels.dispatch import DECODE_MAX_T
    assert PREFILL_MAX_T == DECODE_MAX_T


@pytest.mark.parametrize("kw,why", [({"prefill_tokens": (4, 17)}, "prefill_tokens"),
                                    ({"prefill_tokens": (8, 4)}, "prefill_tokens"),
                                    ({"batch_sizes": (2,), "prefill_tokens": (4,)}, "batch-1"),
                                    ({"prefill_pieces": 0}, "prefill_pieces")],
                         ids=["too-wide", "unsorted", "no-batch-1", "no-pieces"])
def test_graph_config_rejects_prefill_sizes(kw, why):
    with pytest.raises(ValueError, match=why):
        GraphConfig(**kw)


def test_graph_config_prefill_sizes_and_keys(nvfp4_path):
    cfg = GraphConfig(batch_sizes=(1, 2), tokens=(1, 3), mtp_tokens=(1,), kv_buckets=(96,), prefill_tokens=(3, 8))
    assert cfg.single_tokens == (1, 3, 8) and cfg.max_tokens == 8
    r = _runner(_model(nvfp4_path), prefill_tokens=(3, 8))
    assert ("target", 1, 8, 96) in r.keys() and ("target", 2, 8, 96) not in r.keys()
    assert r.keys().count(("target", 1, 3, 96)) == 1             # a verify size is not captured twice


@pytest.mark.parametrize("lens,modes", [((13,), ("last",)), ((13,), ("all",)), ((6, 9), ("none", "last")),
                                        ((17, 2), ("last", "all"))],
                         ids=["one-last", "one-all", "two", "three-pieces-and-a-verify-size"])
def test_prefill_pieces_equal_the_model(nvfp4_path, lens, modes):
    ref, m = _model(nvfp4_path), _model(nvfp4_path)
    r = _runner(m)
    g = torch.Generator().manual_seed(sum(lens))
    prompts = [torch.randint(0, 1000, (n,), generator=g) for n in lens]
    st = [[x.new_state() for _ in prompts] for x in (ref, m)]
    steps = r.stats.eager_steps
    a = ref.forward([SeqInput(p, s, logits=mo) for p, s, mo in zip(prompts, st[0], modes)])
    b = r.prefill([SeqInput(p, s, logits=mo) for p, s, mo in zip(prompts, st[1], modes)])
    assert r.stats.prefill_chunks == len(lens) and r.stats.fallbacks == 0
    assert r.stats.eager_steps - steps == sum(len(pieces(n, (1, 3, 4, 8), 6)) for n in lens)
    assert b.logit_rows == a.logit_rows and b.cu_seqlens == a.cu_seqlens
    assert tuple(b.logits.shape) == tuple(a.logits.shape) and tuple(b.hidden.shape) == tuple(a.hidden.shape)
    if a.logit_rows:
        assert rel(b.logits, a.logits) <= LOGIT_TOL
    assert rel(b.hidden, a.hidden) <= LOGIT_TOL
    for sa, sb in zip(*st):
        assert sa.length == sb.length
        assert rel(m.gdn_pool.rec[:, sb.gdn_row], ref.gdn_pool.rec[:, sa.gdn_row]) <= STATE_TOL
        assert rel(m.gdn_pool.conv[:, sb.gdn_row], ref.gdn_pool.conv[:, sa.gdn_row]) <= STATE_TOL
    tok = [torch.tensor([7]) for _ in prompts]                   # the KV the pieces wrote, read by a decode step
    a = ref.forward([SeqInput(t, s) for t, s in zip(tok, st[0])])
    b = r.forward([SeqInput(t, s) for t, s in zip(tok, st[1])])
    assert rel(b.logits, a.logits) <= LOGIT_TOL


@pytest.mark.parametrize("case", ["too-many-pieces", "positions", "snapshot", "past-the-bucket", "one-of-two"])
def test_prefill_falls_back_to_the_model(nvfp4_path, case):
    m = _model(nvfp4_path)
    r = _runner(m, prefill_pieces=2)
    g = torch.Generator().manual_seed(1)
    n = {"too-many-pieces": 15, "past-the-bucket": 40}.get(case, 8)
    st = m.new_state()
    if case == "past-the-bucket":
        m.forward([SeqInput(torch.randint(0, 1000, (60,), generator=g), st)])
    kw = {"positions": torch.arange(n)} if case == "positions" else {"snapshot": True} if case == "snapshot" else {}
    batch = [SeqInput(torch.randint(0, 1000, (n,), generator=g), st, logits="last", **kw)]
    if case == "one-of-two":           # a chunk that fits beside one that does not: the whole part goes eagerly
        batch.append(SeqInput(torch.randint(0, 1000, (15,), generator=g), m.new_state(), logits="last"))
    r.prefill(batch)
    assert r.stats.prefill_chunks == 0 and r.stats.eager_steps == 0


@pytest.mark.parametrize("k,prefix", [(0, 0), (2, 0), (2, 4)], ids=["no-mtp", "mtp-K2", "mtp-K2-prefix-cache"])
def test_engine_prefills_short_chunks_through_the_runner(k, prefix):
    loaded = loaded_model(build_hf_model(seed=3))
    g = torch.Generator().manual_seed(5)
    system = torch.randint(0, NONSPECIAL, (19,), generator=g).tolist()
    prompts = [system + torch.randint(0, NONSPECIAL, (n,), generator=g).tolist() for n in (3, 11)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    spec = SpecConfig(num_draft_tokens=k) if k else None
    common = dict(spec=spec, prefill_chunk=7, max_batch=2, prefix_cache=prefix)
    want = run(Engine(loaded, TorchOps(), **common), prompts, params)
    cfg = GraphConfig(batch_sizes=(1, 2), tokens=tuple(range(1, k + 2)), mtp_tokens=tuple(range(1, k + 2)) if k else (),
                      kv_buckets=(64,), eager=True, prefill_tokens=(4, 8))
    eng = Engine(loaded, TorchOps(), graphs=cfg, **common)
    assert run(eng, prompts, params) == want
    assert eng.graphs.stats.prefill_chunks > 0
    assert eng.stats.to_dict()["graph_prefill_chunks"] == eng.graphs.stats.prefill_chunks
    eng.shutdown()


def test_engine_graph_config_has_the_prefill_sizes(monkeypatch):
    class TritonOps:                   # graph_config captures only for the triton backend, by its class name
        pass
    monkeypatch.delenv(engine_layout.PREFILL_GRAPHS_ENV, raising=False)
    cfg = graph_config("cuda", TritonOps(), SpecConfig(num_draft_tokens=3), 4, 4096)
    assert cfg.prefill_tokens == engine_layout.PREFILL_GRAPH_TOKENS and cfg.single_tokens == (1, 2, 3, 4, 8, 16)
    monkeypatch.setenv(engine_layout.PREFILL_GRAPHS_ENV, "0")
    assert graph_config("cuda", TritonOps(), None, 4, 4096).prefill_tokens == ()
    monkeypatch.setenv(engine_layout.PREFILL_GRAPHS_ENV, "yes")
    with pytest.raises(EngineError, match="NINFER_PREFILL_GRAPHS='yes'"):
        graph_config("cuda", TritonOps(), None, 4, 4096)


BF16_TOL = 2e-2           # bf16 on the GPU: captured T = 16 / 8 / 1 steps against one eager forward (fla's chunked
                          # GDN there, split-K tiles per T)


def _token_by_token(model, prompts, states) -> torch.Tensor:
    """Each prompt's last logits row from one eager forward per token (another grouping of the same math)."""
    rows = []
    for p, s in zip(prompts, states):
        for j in range(p.numel()):
            out = model.forward([SeqInput(p[j:j + 1], s, logits="last")])
        rows.append(out.logits[-1])
    return torch.stack(rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lens", [(13,), (17, 2)], ids=["one", "two"])
def test_captured_prefill_pieces_equal_the_model_gpu(nvfp4_path, lens):
    from ninfer_rt.backends.triton_ops import TritonOps

    def model():
        lm = load(nvfp4_path, device="cuda", dtype=torch.bfloat16)
        return Model(lm.config, lm.weights, TritonOps(), cache=CacheConfig(num_pages=48, page_size=8, max_seqs=5),
                     dtype=torch.bfloat16, consume_weights=True)
    ref, m, one = model(), model(), model()
    r = GraphRunner(m, GraphConfig(batch_sizes=(1, 2), tokens=(1, 3), mtp_tokens=(), kv_buckets=(96,),
                                   prefill_tokens=(4, 8, 16)))
    r.capture()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1000, (n,), generator=g) for n in lens]
    st = [[x.new_state() for _ in prompts] for x in (ref, m, one)]
    a = ref.forward([SeqInput(p, s, logits="last") for p, s in zip(prompts, st[0])])
    b = r.prefill([SeqInput(p, s, logits="last") for p, s in zip(prompts, st[1])])
    c = _token_by_token(one, prompts, st[2])
    # bf16 regroupings of the same math drift apart: the pieces may differ from the chunk by twice what one eager
    # call per token does (s44's H100: 2.2-6.5 % for the pieces, never run against this yardstick before)
    tol = max(BF16_TOL, 2 * rel(c.float(), a.logits.float()))
    assert r.stats.prefill_chunks == len(lens) and r.stats.replays > 0
    assert rel(b.logits.float(), a.logits.float()) <= tol, (rel(b.logits.float(), a.logits.float()), tol)
    tok = [torch.tensor([7]) for _ in prompts]
    a = ref.forward([SeqInput(t, s) for t, s in zip(tok, st[0])])
    b = r.forward([SeqInput(t, s) for t, s in zip(tok, st[1])])
    assert rel(b.logits.float(), a.logits.float()) <= tol
    r.close()


def test_engine_prompt_logprobs_through_prefill_pieces():
    """Chunks whose every row's logits are asked for (vLLM's prompt_logprobs): the pieces' rows in order."""
    loaded = loaded_model(build_hf_model(seed=3))
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, NONSPECIAL, (n,), generator=g).tolist() for n in (13, 6)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=1, prompt_logprobs=2)

    def outputs(eng):
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params)
        got = {}
        while eng.has_work():
            for o in eng.step():
                if o.prompt_logprobs is not None:
                    got[o.req_id] = o.prompt_logprobs
        eng.shutdown()
        return got
    want = outputs(Engine(loaded, TorchOps(), prefill_chunk=7, max_batch=2))
    cfg = GraphConfig(batch_sizes=(1, 2), tokens=(1,), mtp_tokens=(), kv_buckets=(64,), eager=True,
                      prefill_tokens=(2, 4))
    eng = Engine(loaded, TorchOps(), prefill_chunk=7, max_batch=2, graphs=cfg)
    runner = eng.graphs
    got = outputs(eng)
    assert runner.stats.prefill_chunks > 0
    assert set(got) == set(want) == {"r0", "r1"}
    for rid in want:
        assert [t.token_id for t in got[rid]] == [t.token_id for t in want[rid]] == prompts[int(rid[1])][1:]
        assert [[i for i, _ in t.top[:2]] for t in got[rid]] == [[i for i, _ in t.top[:2]] for t in want[rid]]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got[rid], want[rid])) < 1e-4


def test_prefill_pieces_equal_the_model_triton(tmp_path):
    """The Triton backend (the interpreter on CPU): pieces of 16 / 8 / 4 / 1 tokens (the decode kernels at their
    widest step, the fused GDN conv + recurrence over 16 tokens) against one eager forward of the chunk (the
    prefill kernels)."""
    from small_triton import model_factory
    model, dev = model_factory(str(tmp_path), num_pages=48, max_seqs=5)
    ref, m = model(), model()
    r = _runner(m, tokens=(1,), prefill_tokens=(4, 8, 16))
    prompt = torch.randint(0, 250, (29,), generator=torch.Generator().manual_seed(4)).to(dev)
    st = [x.new_state() for x in (ref, m)]
    a = ref.forward([SeqInput(prompt, st[0], logits="last")])
    b = r.prefill([SeqInput(prompt, st[1], logits="last")])
    assert r.stats.prefill_chunks == 1 and r.stats.eager_steps == 4            # 16 + 8 + 4 + 1
    assert rel(b.logits, a.logits) <= TRITON_TOL and rel(b.hidden, a.hidden) <= TRITON_TOL
    assert rel(m.gdn_pool.rec[:, st[1].gdn_row], ref.gdn_pool.rec[:, st[0].gdn_row]) <= TRITON_TOL
    tok = a.logits.argmax(-1)
    a = ref.forward([SeqInput(tok, st[0])])
    b = r.forward([SeqInput(tok, st[1])])
    assert rel(b.logits, a.logits) <= TRITON_TOL
