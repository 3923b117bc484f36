"""Run-ahead decode (ninfer_rt/engine_ahead.py): with `async_scheduling=True` the Engine launches step n+1 before
reading step n back. On CPU the overlap is nil, but every decision path runs: the tokens, finish reasons and
texts equal the synchronous engine's (greedy, seeded sampling, stop tokens, max_tokens, the context end), an
abort or an admission while a step is in flight, the eager graph runner; nothing runs past a request's end and
every page and slot comes back. What must not run ahead (MTP, penalties) never does.
"""
from __future__ import annotations


import pytest
import torch
from hf_tiny import build_hf_model, loaded_model

from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.engine import Engine, EngineError
from ninfer_rt.graphs import GraphConfig
from ninfer_rt.sampling import SamplingParams
from ninfer_rt.speculative import SpecConfig

NONSPECIAL = 246                  # hf_tiny: ids >= 246 are special tokens
PROMPT_LENS = (5, 9, 3)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def loaded():
    return loaded_model(build_hf_model(seed=5))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(17)
    return [torch.randint(0, NONSPECIAL, (n,), generator=g).tolist() for n in PROMPT_LENS]


class Probe(Engine):
    """Counts run-ahead launches and records each sequence's target length when it is dropped."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.launches, self.dropped_at = 0, {}

    def _launch(self, seqs, prev):
        self.launches += 1
        return super()._launch(seqs, prev)

    def _drop(self, s):
        if s.state is not None:
            self.dropped_at[s.req_id] = s.state.length
        super()._drop(s)


def make(loaded, ahead: bool, **kw) -> Probe:
    kw.setdefault("max_batch", 4)
    return Probe(loaded, TorchOps(), async_scheduling=ahead, prefill_chunk=64, **kw)


def run(eng, reqs, events=None):
    """reqs: (id, prompt, params); events: {step number: callable(eng)} run before that step. -> id -> (tokens,
    finish reason)."""
    for rid, p, params in reqs:
        eng.add_request(rid, p, params)
    out, reason, n = {}, {}, 0
    while eng.has_work():
        if events and n in events:
            events[n](eng)
        n += 1
        for o in eng.step():
            out.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finished:
                reason[o.req_id] = o.finish_reason
    assert not eng.running and not eng.seqs and eng._ahead is None
    return {r: (out.get(r, []), reason.get(r)) for r in out}


def assert_all_free(eng):
    assert eng.model.kv_pool.free_pages() == eng.cache.num_pages
    assert eng.model.gdn_pool.free_slots() == eng.cache.max_seqs


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_greedy_equals_sync_and_stops_at_max_tokens(loaded, prompts):
    reqs = [(f"r{i}", p, greedy(n)) for i, (p, n) in enumerate(zip(prompts, (12, 1, 7)))]
    want = run(make(loaded, False), reqs)
    eng = make(loaded, True)
    got = run(eng, reqs)
    assert got == want
    assert [len(t) for t, _ in got.values()] == [12, 1, 7] and {r for _, r in got.values()} == {"length"}
    assert eng.launches >= 10
    for rid, p, params in reqs:        # never fed past the last token it emits (max_tokens - 1 fed)
        assert eng.dropped_at[rid] == len(p) + params.max_tokens - 1
    assert_all_free(eng)


def test_stop_token_mid_flight_drops_the_step_ahead(loaded, prompts):
    base = run(make(loaded, False), [("r0", prompts[0], greedy(16))])["r0"][0]
    stop = base[6]                       # r0 stops there; the step already launched after it is discarded
    reqs = [("r0", prompts[0], greedy(16, stop_token_ids=[stop])), ("r1", prompts[1], greedy(16))]
    want = run(make(loaded, False), reqs)
    eng = make(loaded, True)
    got = run(eng, reqs)
    assert got == want and got["r0"][1] == "stop" and got["r0"][0][-1] == stop
    n0 = len(got["r0"][0])
    assert len(prompts[0]) + n0 - 1 <= eng.dropped_at["r0"] <= len(prompts[0]) + n0    # at most one step ahead
    assert_all_free(eng)


def test_seeded_sampling_equals_sync(loaded, prompts):
    reqs = [(f"r{i}", p, SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=100 + i, max_tokens=10,
                                        ignore_eos=True)) for i, p in enumerate(prompts)]
    want = run(make(loaded, False), reqs)
    eng = make(loaded, True)
    assert run(eng, reqs) == want and eng.launches > 0


def test_context_end_is_not_overrun(loaded, prompts):
    reqs = [(f"r{i}", p, greedy(100)) for i, p in enumerate(prompts)]
    want = run(make(loaded, False, max_model_len=16), reqs)
    eng = make(loaded, True, max_model_len=16)
    got = run(eng, reqs)
    assert got == want and all(len(p) + len(t) == 16 for p, (t, _) in zip(prompts, got.values()))
    assert all(eng.dropped_at[f"r{i}"] == 15 for i in range(len(prompts)))
    assert_all_free(eng)


def test_abort_and_admission_while_in_flight(loaded, prompts):
    alone = {rid: run(make(loaded, False), [(rid, p, greedy(n))])[rid]
             for rid, p, n in (("r0", prompts[0], 14), ("r2", prompts[2], 6))}
    eng = make(loaded, True)
    events = {4: lambda e: e.abort("r1"), 6: lambda e: e.add_request("r2", prompts[2], greedy(6))}
    got = run(eng, [("r0", prompts[0], greedy(14)), ("r1", prompts[1], greedy(14))], events)
    assert got["r0"] == alone["r0"] and got["r2"] == alone["r2"]
    assert 0 < len(got["r1"][0]) < 14 and got["r1"][1] is None
    assert_all_free(eng)


def test_eager_graph_runner_equals_sync(loaded, prompts):
    g = GraphConfig(batch_sizes=(1, 2, 4), tokens=(1,), mtp_tokens=(), kv_buckets=(64,), eager=True)
    reqs = [(f"r{i}", p, greedy(9)) for i, p in enumerate(prompts)]
    want = run(make(loaded, False), reqs)
    eng = make(loaded, True, graphs=g)
    assert run(eng, reqs) == want and eng.launches > 0 and eng.graphs.stats.eager_steps > 0
    eng.shutdown()
    assert eng.model.kv_pool.free_pages() == eng.cache.num_pages


def test_text_and_stop_strings_match_sync(loaded, prompts):
    from hf_tiny_tok import tokenizer_json

    from ninfer_rt.tokenizer import Tokenizer
    tok = Tokenizer(tokenizer_json())
    base = make(loaded, False, tokenizer=tok)
    base.add_request("x", prompts[0], greedy(12))
    text = "".join(o.text or "" for _ in range(30) if base.has_work() for o in base.step())
    stop = text[len(text) // 2:len(text) // 2 + 2]
    results = []
    for ahead in (False, True):
        eng = make(loaded, ahead, tokenizer=tok)
        eng.add_request("x", prompts[0], greedy(12, stop=[stop]))
        outs = [o for _ in range(30) if eng.has_work() for o in eng.step()]
        results.append(("".join(o.text or "" for o in outs), outs[-1].finish_reason))
    assert results[0] == results[1]


@pytest.mark.parametrize("what", ["mtp", "penalties"])
def test_what_must_not_run_ahead_never_does(loaded, prompts, what):
    spec = SpecConfig(num_draft_tokens=2) if what == "mtp" else None
    params = greedy(8, frequency_penalty=0.5) if what == "penalties" else greedy(8)
    reqs = [("r0", prompts[0], params)]
    want = run(make(loaded, False, spec=spec), reqs)
    eng = make(loaded, True, spec=spec)
    assert run(eng, reqs) == want and eng.launches == 0


def test_async_scheduling_is_validated(loaded):
    with pytest.raises(EngineError, match="async_scheduling"):
        Engine(loaded, TorchOps(), async_scheduling="yes")
    assert Engine(loaded, TorchOps()).async_scheduling is False          # auto: off on CPU


@pytest.mark.parametrize("argv", [["generate", "ART", "--prompt", "hi"], ["serve", "ART"]], ids=["generate", "serve"])
def test_no_async_scheduling_flag_reaches_the_runtime_options(monkeypatch, argv):
    from click.testing import CliRunner

    from ninfer_formats.errors import NinferError
    from ninfer_rt.cli import main
    from ninfer_rt.server import runtime, serve
    seen = []

    def fake_open(opts):
        seen.append(opts)
        raise NinferError("stop here")

    monkeypatch.setattr(runtime, "open_runtime", fake_open)
    monkeypatch.setattr(serve, "run_server", lambda opts: seen.append(opts.runtime) or 0)
    res = CliRunner().invoke(main, argv + ["--device", "cpu", "--no-async-scheduling"])
    assert seen and seen[-1].async_scheduling is False, res.output
    res = CliRunner().invoke(main, argv + ["--device", "cpu"])
    assert seen[-1].async_scheduling is None, res.output          # auto: the engine decides by device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_run_ahead_over_captured_graphs_equals_sync_gpu(tmp_path_factory):
    """bf16 Triton kernels, captured graphs: run-ahead steps (device tokens fed back, pinned read-backs) give the
    synchronous engine's tokens for requests of different lengths in one batch. (Only length limits here: a
    stop seen one step late changes the next step's batch size, and bf16 GEMVs of other sizes round
    differently; the CPU tests cover stops.)"""
    import sys
    from pathlib import Path
    sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))
    import synth_artifact as synth

    from ninfer_rt.backends.triton_ops import TritonOps
    from ninfer_rt.loader import load
    paths, _ = synth.build(str(tmp_path_factory.mktemp("nvfp4")), synth.TINY, "nvfp4", workers=1)
    g = torch.Generator().manual_seed(9)
    reqs = [(f"r{i}", torch.randint(0, 1000, (n,), generator=g).tolist(), greedy(m))
            for i, (n, m) in enumerate(zip((9, 40, 23, 5), (24, 3, 17, 30)))]
    outs, engines = [], []
    for ahead in (False, True):
        lm = load(paths[0], device="cuda", dtype=torch.bfloat16)
        eng = Probe(lm, TritonOps(), max_batch=4, kv_pages=64, prefill_chunk=16, async_scheduling=ahead)
        outs.append(run(eng, reqs))
        engines.append(eng)
    assert outs[1] == outs[0]
    assert engines[1].launches > 10 and engines[1].graphs.stats.replays > 0 and engines[0].launches == 0
    for eng in engines:
        eng.shutdown()
        assert eng.model.kv_pool.free_pages() == eng.cache.num_pages
