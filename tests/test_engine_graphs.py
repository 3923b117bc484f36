"""The Engine over the CUDA-graph runner: on CPU the runner's eager mode (the very step bodies a graph captures,
over the static buffers, padded batches) gives the plain Engine's greedy tokens, with and without MTP, through
mixed prefill + decode steps; the split of a step into decode and prefill forwards; the graph layout (spare
slot and pages, batch sizes); `--eager` on both CLIs. On CUDA: captured graphs give the eager Engine's tokens.

Models: the HF-built tiny Qwen3.5 of tests/hf_tiny.py (CPU) and bench/synth_artifact.py's tiny nvfp4 artifact
through the real loader (GPU).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from greedy_close import TOP, assert_greedy_close, run_logprobs
from hf_tiny import build_hf_model, loaded_model

from ninfer_formats.errors import NinferError
from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.cli import main
from ninfer_rt.engine import GRAPH_MAX_BATCH, Engine, EngineError, engine_layout, graph_config
from ninfer_rt.engine_core import StepOut, forward_parts
from ninfer_rt.graphs import GraphConfig
from ninfer_rt.model import Output
from ninfer_rt.sampling import SamplingParams
from ninfer_rt.speculative import SpecConfig

NONSPECIAL = 246                  # hf_tiny: ids >= 246 are special tokens
PROMPT_LENS = (5, 19)             # with CHUNK = 7: r0 decodes while r1 is still prefilling (mixed steps)
CHUNK, NEW = 7, 20
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def loaded():
    return loaded_model(build_hf_model(seed=3))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, NONSPECIAL, (n,), generator=g).tolist() for n in PROMPT_LENS]


class MixedEngine(Engine):
    """Counts steps that ran prefill chunks and decode rounds together, and the runner steps they made."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.mixed_runner_steps = 0

    def _execute(self, plan):
        before = self.graphs.stats.eager_steps if self.graphs is not None else 0
        res = super()._execute(plan)
        if plan.prefill and plan.decode and self.graphs is not None:
            self.mixed_runner_steps += self.graphs.stats.eager_steps > before
        return res


def run(engine, prompts, params=GREEDY):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.req_id] += o.new_token_ids
    return out


def eager_graphs(k: int) -> GraphConfig:
    return GraphConfig(batch_sizes=(1, 2), tokens=tuple(range(1, k + 2)),
                       mtp_tokens=tuple(range(1, k + 2)) if k else (), kv_buckets=(64,), eager=True)


@pytest.mark.parametrize("k", [0, 2], ids=["no-mtp", "mtp-K2"])
def test_eager_runner_engine_equals_plain_engine(loaded, prompts, k):
    spec = SpecConfig(num_draft_tokens=k) if k else None
    want = run(MixedEngine(loaded, TorchOps(), spec=spec, prefill_chunk=CHUNK, max_batch=2), prompts)
    eng = MixedEngine(loaded, TorchOps(), spec=spec, prefill_chunk=CHUNK, max_batch=2, graphs=eager_graphs(k))
    got = run(eng, prompts)
    assert got == want
    st = eng.graphs.stats
    assert st.captured == 0 and st.replays == 0          # eager mode never captures
    assert st.eager_steps > NEW // (k + 1)                 # decode (and draft) steps went through the runner
    assert eng.mixed_runner_steps > 0                      # ... also the decode part of mixed steps
    d = eng.stats.to_dict()
    assert d["graph_eager_steps"] == st.eager_steps
    assert d["graph_fallbacks"] == st.fallbacks == sum(d["graph_fallback_reasons"].values())
    assert d["graph_fallback_reasons"] == st.reasons and d["graph_fallback_reasons"] is not st.reasons
    scratch = len(eng.graphs._scratch.pages)
    assert eng.model.kv_pool.free_pages() == eng.cache.num_pages - scratch      # only the scratch row holds pages
    eng.shutdown()
    assert eng.model.kv_pool.free_pages() == eng.cache.num_pages


@pytest.mark.parametrize("n_dec,n,graphs,want", [
    (0, 3, False, [(0, 3, False)]), (2, 3, False, [(0, 3, False)]), (0, 0, True, []),
    (2, 5, True, [(0, 2, True), (2, 5, False)]), (3, 3, True, [(0, 3, True)]), (0, 2, True, [(0, 2, False)])],
    ids=["plain-prefill", "plain-mixed", "empty", "mixed", "decode-only", "prefill-only"])
def test_forward_parts_splits_decode_rows_from_prefill(n_dec, n, graphs, want):
    assert forward_parts(n_dec, n, graphs) == want


@pytest.mark.parametrize("n_dec,n", [(-1, 2), (3, 2)], ids=["negative", "more-decode-than-rows"])
def test_forward_parts_rejects(n_dec, n):
    with pytest.raises(ValueError, match="forward_parts"):
        forward_parts(n_dec, n, True)


def test_step_out_addresses_sequences_across_parts():
    g = torch.Generator().manual_seed(0)
    h1, h2 = torch.randn(6, 4, generator=g), torch.randn(7, 4, generator=g)
    # part 1: two verify rows of 3 tokens, logits "all"; part 2: chunks of 4 ("none") and 3 ("last") tokens
    o1 = Output(logits=torch.randn(6, 5, generator=g), hidden=h1, logit_rows=list(range(6)), cu_seqlens=[0, 3, 6])
    o2 = Output(logits=torch.randn(1, 5, generator=g), hidden=h2, logit_rows=[6], cu_seqlens=[0, 4, 7])
    out = StepOut([(0, o1), (2, o2)])
    assert torch.equal(out.seq_logits(1), o1.logits[3:6])
    assert out.seq_logits(2).shape[0] == 0 and torch.equal(out.seq_logits(3), o2.logits)
    assert torch.equal(out.seq_hidden(0), h1[:3]) and torch.equal(out.seq_hidden(3), h2[4:])


class TritonOps:
    """Stand-in with the triton backend's class name (graph_config picks graphs by backend)."""


@pytest.mark.parametrize("max_batch,k,sizes", [(1, 0, (1,)), (6, 3, (1, 2, 4, 6)), (8, 1, (1, 2, 4, 8)),
                                               (200, 0, (1, 2, 4, 8, 16, 32, GRAPH_MAX_BATCH))],
                         ids=["b1", "b6-K3", "b8-K1", "b200-capped"])
def test_graph_config_shapes(max_batch, k, sizes):
    spec = SpecConfig(num_draft_tokens=k) if k else None
    g = graph_config("cuda", TritonOps(), spec, max_batch, 300)
    assert g.batch_sizes == sizes and g.tokens == tuple(range(1, k + 2)) and g.kv_buckets == (300,)
    assert g.mtp_tokens == (g.tokens if k else ()) and not g.eager
    assert graph_config("cuda", TritonOps(), spec, max_batch, 300, "eager").eager
    for device, ops, mode in (("cuda", TritonOps(), "off"), ("cpu", TritonOps(), "auto"), ("cuda", TorchOps(), "auto")):
        assert graph_config(device, ops, spec, max_batch, 300, mode) is None


def test_mtp_alignment_goes_through_the_runner(loaded, prompts):
    """After a round that emitted a + 1 tokens the MTP re-alignment runs a + 1 tokens: with MTP graphs of 1..K+1
    tokens that is a runner step too (not an eager model call each round); the tokens stay the plain engine's."""
    spec = SpecConfig(num_draft_tokens=2)
    want = run(MixedEngine(loaded, TorchOps(), spec=spec, prefill_chunk=CHUNK, max_batch=1), prompts[:1])

    class Rigged(MixedEngine):           # the random model drafts nothing useful: draft the known continuation
        def _device_drafts(self, j, items):
            super()._device_drafts(j, items)
            return torch.tensor([want[s.req_id][len(s.out) + j - 1] for s, _, _ in items])

    eng = Rigged(loaded, TorchOps(), spec=spec, prefill_chunk=CHUNK, max_batch=1, graphs=eager_graphs(2))
    assert run(eng, prompts[:1]) == want
    rounds = eng.stats.spec.rounds
    assert rounds > 0 and eng.stats.spec.accepted > 0       # some alignments ran 2 or 3 tokens
    assert "token count" not in eng.graphs.stats.reasons      # every decode, verify, draft and alignment step
    assert eng.graphs.stats.eager_steps >= 2 * rounds         # at least the verify and the alignment of each round
    eng.shutdown()


def test_ragged_alignment_at_batch_2_goes_through_the_runner(loaded, prompts):
    """Two sequences in one round, one accepting every draft and one none: their re-alignments run 3 and 1
    tokens, which the runner pads into one 3-token MTP graph (not the eager model); the tokens stay the plain
    engine's."""
    spec = SpecConfig(num_draft_tokens=2)
    want = run(MixedEngine(loaded, TorchOps(), spec=spec, prefill_chunk=CHUNK, max_batch=2), prompts)

    class Rigged(MixedEngine):           # r0 drafts its known continuation, r1 a token that is always wrong
        def _device_drafts(self, j, items):
            super()._device_drafts(j, items)
            nxt = [want[s.req_id][len(s.out) + j - 1] if len(s.out) + j - 1 < NEW else 0 for s, _, _ in items]
            return torch.tensor([t if s.req_id == "r0" else (t + 1) % NONSPECIAL
                                 for t, (s, _, _) in zip(nxt, items)])

    eng = Rigged(loaded, TorchOps(), spec=spec, prefill_chunk=CHUNK, max_batch=2, graphs=eager_graphs(2))
    runner, mtp_fallbacks = eng.graphs, []
    mtp_forward = runner.mtp_forward

    def counted(batch, **kw):            # the target's ragged verify near the end (r0 drafts fewer) may fall back
        before = runner.stats.fallbacks
        out = mtp_forward(batch, **kw)
        mtp_fallbacks.append(runner.stats.fallbacks - before)
        return out

    runner.mtp_forward = counted
    assert run(eng, prompts) == want
    assert runner.stats.padded_tokens > 0 and len(mtp_fallbacks) > 0 and sum(mtp_fallbacks) == 0
    eng.shutdown()


def test_graph_config_rejects_unknown_mode():
    with pytest.raises(EngineError, match="graphs: expected one of auto, eager, off"):
        graph_config("cpu", TorchOps(), None, 2, 64, "always")


def test_layout_adds_the_scratch_slot_and_pages(loaded):
    plain = engine_layout(loaded, TorchOps(), None, 3, 20, 16)
    assert plain.graphs is None and plain.cache.max_seqs == 3 and plain.cache.num_pages == 20
    lay = engine_layout(loaded, TorchOps(), None, 3, 20, 16, 100, eager_graphs(5))
    assert lay.cache.max_seqs == 4 and lay.cache.num_pages == 21 and lay.max_model_len == 100


@pytest.mark.parametrize("argv", [["generate", "ART", "--prompt", "hi", "--eager"], ["serve", "ART", "--eager"]],
                         ids=["generate", "serve"])
def test_eager_flag_reaches_the_runtime_options(monkeypatch, argv):
    from ninfer_rt.server import runtime, serve
    seen = []

    def fake_open(opts):
        seen.append(opts)
        raise NinferError("stop here")

    monkeypatch.setattr(runtime, "open_runtime", fake_open)
    monkeypatch.setattr(serve, "run_server", lambda opts: seen.append(opts.runtime) or 0)
    res = CliRunner().invoke(main, argv + ["--device", "cpu"])
    assert seen and seen[0].eager is True, res.output
    no_flag = CliRunner().invoke(main, [a for a in argv if a != "--eager"] + ["--device", "cpu"])
    assert seen[-1].eager is False, no_flag.output


@gpu
@pytest.mark.parametrize("k", [0, 3], ids=["no-mtp", "mtp-K3"])
def test_captured_engine_equals_eager_engine_gpu(tmp_path_factory, k):
    """bf16 Triton kernels: the Engine replaying captured graphs gives the eager Engine's greedy tokens."""
    sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))
    import synth_artifact as synth

    from ninfer_rt.backends.triton_ops import TritonOps as RealTritonOps
    from ninfer_rt.loader import load
    paths, _ = synth.build(str(tmp_path_factory.mktemp("nvfp4")), synth.TINY, "nvfp4", workers=1)
    spec = SpecConfig(num_draft_tokens=k) if k else None
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (9, 40, 23)]
    outs, engines = [], []
    for mode in ("eager", "auto"):
        lm = load(paths[0], device="cuda", dtype=torch.bfloat16)
        eng = Engine(lm, RealTritonOps(), spec=spec, max_batch=4, kv_pages=64, prefill_chunk=16, graphs=mode)
        outs.append(run_logprobs(eng, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                              logprobs=TOP)))
        engines.append(eng)
    # eager steps plan attention for the true KV lengths, graphs for the bucket: near ties may round apart
    assert assert_greedy_close(outs[0], outs[1]) <= 1
    assert engines[1].graphs.stats.captured > 0 and engines[1].graphs.stats.replays > 0
    assert engines[1].graphs.stats.prefill_chunks > 0                  # the 9-token chunk and the 23-token tail
    assert engines[0].graphs.stats.captured == 0 and engines[0].graphs.stats.eager_steps > 0
    for eng in engines:
        eng.shutdown()


@gpu
def test_captured_ragged_alignments_equal_eager_gpu(tmp_path_factory):
    """Verdicts rigged to acceptance 0.5 per position (bench/engine_mtp.py's rig), 3 sequences: most
    re-alignments are ragged and replay a padded MTP graph; the tokens equal the static bodies run eagerly."""
    sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))
    import synth_artifact as synth
    from engine_mtp import make_rigged

    from ninfer_rt.backends.triton_ops import TritonOps as RealTritonOps
    from ninfer_rt.loader import load
    paths, _ = synth.build(str(tmp_path_factory.mktemp("nvfp4")), synth.TINY, "nvfp4", workers=1)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (9, 17, 12)]
    outs, stats = [], []
    for mode in ("eager", "auto"):
        lm = load(paths[0], device="cuda", dtype=torch.bfloat16)
        eng = make_rigged(Engine)(lm, RealTritonOps(), spec=SpecConfig(num_draft_tokens=3), max_batch=4,
                                  kv_pages=64, prefill_chunk=64, graphs=mode)
        eng.rate = 0.5
        outs.append(run(eng, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
        stats.append(eng.graphs.stats)
        eng.shutdown()
    assert outs[0] == outs[1]
    assert stats[1].replays > 0 and stats[1].padded_tokens > 0 and stats[1].padded_tokens == stats[0].padded_tokens


def _caller() -> str:
    f = sys._getframe(2)
    return f"{f.f_code.co_filename}:{f.f_lineno}"


@gpu
@pytest.mark.parametrize("temperature,per_step", [(0, 1), (0.8, 2)], ids=["greedy", "sampled"])
def test_captured_mtp_round_syncs_once_gpu(tmp_path_factory, temperature, per_step):
    """A greedy MTP round on captured graphs waits for the GPU once: the drafts and the verdict's argmax come back
    in one transfer, and nothing else syncs (no pageable host->device copy, no device sync at the step's end), so
    the host plans the next round while the alignment runs. A sampled round (TP1) twice: its drafts are drawn on
    the device without a read-back per draft step (`sampling.sample` has no host check), then the drafts and the
    verdict come back one after the other."""
    import warnings
    sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))
    import synth_artifact as synth

    from ninfer_rt.backends.triton_ops import TritonOps as RealTritonOps
    from ninfer_rt.loader import load
    paths, _ = synth.build(str(tmp_path_factory.mktemp("nvfp4")), synth.TINY, "nvfp4", workers=1)
    eng = Engine(load(paths[0], device="cuda", dtype=torch.bfloat16), RealTritonOps(),
                 spec=SpecConfig(num_draft_tokens=3), max_batch=1, kv_pages=64, graphs="auto")
    eng.add_request("r", list(range(5, 20)), SamplingParams(temperature=temperature, seed=1, max_tokens=40,
                                                            ignore_eos=True))
    eng.step()                                                 # the prompt: eager (a fallback), it may sync
    fallbacks, explicit, real = eng.graphs.stats.fallbacks, [], torch.cuda.synchronize
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        # the caller's file:line, so a failure names who synchronized
        torch.cuda.synchronize = lambda *a, **kw: explicit.append(_caller()) or real(*a, **kw)
        try:
            steps = [eng.step() for _ in range(4)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize = real
    # torch's own message for a synchronizing op (set_sync_debug_mode may warn about itself too)
    syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
    assert all(o and o[0].drafted == 3 for o in steps) and eng.graphs.stats.fallbacks == fallbacks
    assert not explicit, explicit
    assert len(syncs) <= 4 * per_step, [f"{w.filename}:{w.lineno} {w.message}" for w in caught]
    eng.shutdown()


@gpu
def test_eager_engine_mixes_device_drafts_with_a_prompt_gpu(tmp_path_factory, monkeypatch):
    """Without graphs one forward serves a step's decode rounds and prompt chunks: chained drafts (device ids)
    and prompt ids (host) go into one embedding call. Same tokens as drafts read back to the host."""
    sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))
    import synth_artifact as synth

    from ninfer_rt.backends.triton_ops import TritonOps as RealTritonOps
    from ninfer_rt.loader import load
    paths, _ = synth.build(str(tmp_path_factory.mktemp("nvfp4")), synth.TINY, "nvfp4", workers=1)
    outs = []
    for chain in ("1", "0"):
        monkeypatch.setenv("NINFER_DRAFT_CHAIN", chain)
        eng = Engine(load(paths[0], device="cuda", dtype=torch.bfloat16), RealTritonOps(),
                     spec=SpecConfig(num_draft_tokens=2), max_batch=2, kv_pages=64, prefill_chunk=8, graphs="off")
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        eng.add_request("a", list(range(5, 14)), params)
        got = {"a": [], "b": []}
        for i in range(40):
            if i == 3:                      # "a" decodes while "b"'s prompt runs in chunks beside it
                eng.add_request("b", list(range(30, 50)), params)
            for o in eng.step():
                got[o.req_id] += o.new_token_ids
            if not eng.has_work():
                break
        outs.append(got)
        eng.shutdown()
    assert outs[0] == outs[1] and all(len(v) == 12 for v in outs[0].values())
