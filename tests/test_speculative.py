"""MTP speculative decoding in the engine: greedy losslessness, rigged full acceptance with rollbacks at every
position, draft alignment against the HF-built MTP oracle, context/max_tokens/stop cuts, abort, errors."""
from __future__ import annotations

import types

import pytest
import torch
from hf_tiny import build_hf_model, loaded_model, model_config_from_hf

from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.engine import Engine, EngineError
from ninfer_rt.sampling import SamplingParams
from ninfer_rt.speculative import SpecConfig, SpecError

NONSPECIAL = 246                  # hf_tiny: ids >= 246 are special tokens
PROMPT_LENS = (5, 19, 33)         # with CHUNK = 7: one chunk, and chunk boundaries inside the prompt
CHUNK, NEW = 7, 24
MTP_TOL = 1e-4                    # rel L2 of engine MTP logits vs the fp32 oracle
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    return build_hf_model(seed=3)


@pytest.fixture(scope="module")
def loaded(tiny):
    return loaded_model(tiny)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, NONSPECIAL, (n,), generator=g).tolist() for n in PROMPT_LENS]


def run(engine, prompts, params=GREEDY):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out, reasons = {f"r{i}": [] for i in range(len(prompts))}, {}
    while engine.has_work():
        for o in engine.step():
            out[o.req_id] += o.new_token_ids
            if o.finished:
                reasons[o.req_id] = o.finish_reason
    assert engine.model.kv_pool.free_pages() == engine.cache.num_pages       # everything returned
    return out, reasons


@pytest.fixture(scope="module")
def reference(loaded, prompts):
    return run(Engine(loaded, TorchOps(), prefill_chunk=CHUNK), prompts)[0]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5], ids=lambda k: f"K{k}")
def test_mtp_greedy_is_lossless(loaded, prompts, reference, k):
    eng = Engine(loaded, TorchOps(), spec=SpecConfig(num_draft_tokens=k), prefill_chunk=CHUNK)
    out, reasons = run(eng, prompts)
    assert out == reference
    assert set(reasons.values()) == {"length"}
    st = eng.stats.spec
    assert st.rounds > 0 and st.drafted >= st.rounds and 0 <= st.accepted <= st.drafted


def test_greedy_with_penalties_is_lossless(loaded, prompts):
    params = SamplingParams(temperature=0, max_tokens=NEW, presence_penalty=0.5, frequency_penalty=0.3,
                            ignore_eos=True)
    ref = run(Engine(loaded, TorchOps(), prefill_chunk=CHUNK), prompts, params)[0]
    got = run(Engine(loaded, TorchOps(), spec=SpecConfig(num_draft_tokens=3), prefill_chunk=CHUNK),
              prompts, params)[0]
    assert got == ref


class RiggedEngine(Engine):
    """Drafts the known greedy continuation for the first `pattern(round)` drafts, then a wrong token."""

    def __init__(self, *a, truth, pattern, **kw):
        super().__init__(*a, **kw)
        self.truth, self.pattern, self.rounds, self.n_acc_seen = truth, pattern, {}, set()

    def _rig(self, j, items):
        toks = []
        for s, _, prev in items:
            if j == 1:
                self.rounds[s.req_id] = self.rounds.get(s.req_id, -1) + 1
            good = self.pattern(self.rounds[s.req_id])
            right = self.truth[s.req_id][len(s.out) + j - 1]
            toks.append(right if j <= good else (right + 1) % NONSPECIAL)
        return toks

    def _decide_drafts(self, j, items):          # drafts read back after every draft step
        return self._rig(j, items)

    def _device_drafts(self, j, items):          # drafts kept on the device (NINFER_DRAFT_CHAIN=1, greedy)
        super()._device_drafts(j, items)
        return torch.tensor(self._rig(j, items), device=items[0][1].device)

    def _decide_verdicts(self, dec, drafts, pre, out):
        verdicts = super()._decide_verdicts(dec, drafts, pre, out)
        self.n_acc_seen.update(v.n_acc for v, (_, k) in zip(verdicts, dec) if k)
        return verdicts


@pytest.mark.parametrize("chain", ["1", "0"], ids=["chained", "read-back"])
@pytest.mark.parametrize("k,mode", [(3, "all"), (5, "all"), (2, "cycle"), (4, "cycle")],
                         ids=["K3-all", "K5-all", "K2-cycle", "K4-cycle"])
def test_rigged_drafts_accept_and_roll_back_exactly(loaded, prompts, reference, k, mode, chain, monkeypatch):
    """'all': every draft right (100% acceptance, K+1 tokens a round). 'cycle': round r gets r % (K+1) right
    drafts, so the target state is committed / rolled back at every position. Drafts kept on the device between
    the draft steps (NINFER_DRAFT_CHAIN=1) or read back after each."""
    monkeypatch.setenv("NINFER_DRAFT_CHAIN", chain)
    pattern = (lambda r: k) if mode == "all" else (lambda r: r % (k + 1))
    eng = RiggedEngine(loaded, TorchOps(), spec=SpecConfig(num_draft_tokens=k), prefill_chunk=CHUNK,
                       truth=reference, pattern=pattern)
    out, _ = run(eng, prompts)
    assert out == reference
    st = eng.stats.spec
    if mode == "all":
        assert st.accepted == st.drafted and st.tokens_per_round > 1 + 0.5 * k
    else:
        assert 0 < st.accepted < st.drafted
        assert eng.n_acc_seen == set(range(k + 1))         # commit(n) at every n = 1..K+1


def _hf_draft_logits(tiny, tokens):
    """Oracle logits of the first draft after committed `tokens` (x_0..x_L, x_L unfed by the target)."""
    lm = tiny.causal_lm()
    ids = torch.tensor(tokens)
    with torch.no_grad():
        h = lm(ids[None, :-1], output_hidden_states=True).hidden_states[-1][0]
        d = tiny.mtp(tiny.embed, ids[1:], h)
        return tiny.lm_head(d[-1])


def test_first_draft_matches_mtp_oracle_every_round(tiny, loaded, prompts, lm_head_drafts):
    """d_1 of every round comes from MTP KV rebuilt with target hiddens (prefill chunks, then rewind +
    re-alignment after each verify): its logits equal the oracle run over the whole committed sequence."""
    seen = []

    class Spy(Engine):
        def _spy(self, j, items):
            if j == 1:
                seen.extend((s.prompt + list(s.out), lg.clone()) for s, lg, _ in items)

        def _decide_drafts(self, j, items):
            self._spy(j, items)
            return super()._decide_drafts(j, items)

        def _device_drafts(self, j, items):
            self._spy(j, items)
            return super()._device_drafts(j, items)

    eng = Spy(loaded, TorchOps(), spec=SpecConfig(num_draft_tokens=3), prefill_chunk=CHUNK)
    run(eng, prompts[1:], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert len(seen) >= 6
    for tokens, lg in seen[::2]:
        want = _hf_draft_logits(tiny, tokens)
        assert ((lg - want).norm() / want.norm()).item() <= MTP_TOL


def test_context_limit_falls_back_to_single_steps(loaded, prompts, reference):
    max_len = PROMPT_LENS[1] + 8          # 1 (prefill) + 6 (K=5 round) + 1 (no room for a draft)
    truth = {"r0": reference["r1"]}
    eng = RiggedEngine(loaded, TorchOps(), spec=SpecConfig(num_draft_tokens=5), prefill_chunk=CHUNK,
                       max_model_len=max_len, truth=truth, pattern=lambda r: 5)
    out, reasons = run(eng, [prompts[1]])
    assert out["r0"] == reference["r1"][:8] and reasons["r0"] == "length"
    assert eng.stats.spec.fallback_steps >= 1


def test_max_tokens_and_stop_inside_a_round(loaded, prompts, reference):
    truth = {"r0": reference["r2"]}
    spec = SpecConfig(num_draft_tokens=5)
    eng = RiggedEngine(loaded, TorchOps(), spec=spec, prefill_chunk=CHUNK, truth=truth, pattern=lambda r: 5)
    out, reasons = run(eng, [prompts[2]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert out["r0"] == reference["r2"][:8] and reasons["r0"] == "length"
    # a stop token that first occurs mid-round: emitted up to and including it
    ref = reference["r2"]
    idx = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i] and i % 6 not in (0, 5))
    eng = RiggedEngine(loaded, TorchOps(), spec=spec, prefill_chunk=CHUNK, truth=truth, pattern=lambda r: 5)
    out, reasons = run(eng, [prompts[2]], SamplingParams(temperature=0, max_tokens=NEW,
                                                         stop_token_ids=[ref[idx]], ignore_eos=True))
    assert out["r0"] == ref[:idx + 1] and reasons["r0"] == "stop"


def test_sampling_with_mtp_is_seed_reproducible(loaded, prompts):
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, presence_penalty=0.2, seed=17, max_tokens=12,
                            ignore_eos=True)

    def go():
        return run(Engine(loaded, TorchOps(), spec=SpecConfig(num_draft_tokens=3), prefill_chunk=CHUNK),
                   prompts, params)[0]

    a, b = go(), go()
    assert a == b and all(len(v) == 12 for v in a.values())


def test_abort_frees_state_at_once(loaded, prompts, reference):
    eng = Engine(loaded, TorchOps(), spec=SpecConfig(num_draft_tokens=2), prefill_chunk=CHUNK)
    eng.add_request("a", prompts[2], GREEDY)
    eng.add_request("b", prompts[1], GREEDY)
    got = []
    for _ in range(6):
        got += [t for o in eng.step() if o.req_id == "b" for t in o.new_token_ids]
    before = eng.model.kv_pool.free_pages()
    assert eng.abort("a") and not eng.abort("a")
    assert eng.model.kv_pool.free_pages() > before
    while eng.has_work():
        got += [t for o in eng.step() for t in o.new_token_ids]
    assert got == reference["r1"]


def test_request_errors(loaded, tiny):
    eng = Engine(loaded, TorchOps(), max_model_len=40)
    with pytest.raises(EngineError, match="prompt has 40 tokens"):
        eng.add_request("x", [1] * 40, GREEDY)
    with pytest.raises(EngineError, match="token id 999"):
        eng.add_request("x", [1, 999], GREEDY)
    with pytest.raises(EngineError, match="stop strings"):
        eng.add_request("x", [1], SamplingParams(stop=["a"]))
    eng.add_request("x", [1, 2], GREEDY)
    with pytest.raises(EngineError, match="already in use"):
        eng.add_request("x", [1, 2], GREEDY)
    no_mtp = types.SimpleNamespace(config=model_config_from_hf(tiny.text_config, mtp=False),
                                   weights={k: v for k, v in loaded.weights.items() if not k.startswith("mtp.")},
                                   path="nomtp")
    with pytest.raises(SpecError, match="MTP"):
        Engine(no_mtp, TorchOps(), spec=SpecConfig(num_draft_tokens=2))
    with pytest.raises(SpecError, match="num_draft_tokens"):
        SpecConfig(num_draft_tokens=8)


def test_failed_step_then_abort_keeps_serving(loaded, prompts, reference):
    """TP1: a step that raises (after drafting moved the MTP cache) can be cleaned up with abort()."""
    eng = Engine(loaded, TorchOps(), spec=SpecConfig(num_draft_tokens=3), prefill_chunk=64)
    eng.add_request("a", prompts[1], GREEDY)
    eng.step()                                   # prefill + first token
    forward = eng.model.forward

    def boom(*a, **kw):
        raise RuntimeError("device lost")

    eng.model.forward = boom
    with pytest.raises(RuntimeError, match="device lost"):
        eng.step()
    eng.model.forward = forward
    assert eng.abort("a") and not eng.has_work()
    out, _ = run(eng, prompts[:1])
    assert out["r0"] == reference["r0"]


@pytest.mark.parametrize("tokens,stop_at,emitted", [([5, 5, 9], None, 3), ([5, 7, 5, 9], 7, 2)],
                         ids=["repeats", "cut-at-stop"])
def test_accept_counts_every_emitted_token_once(loaded, tokens, stop_at, emitted):
    """Penalty counts see repeated tokens in one round, and nothing past a stop."""
    from ninfer_rt.engine_core import Seq
    eng = Engine(loaded, TorchOps())
    stops = () if stop_at is None else (stop_at,)
    s = Seq("r", [1, 2], params=SamplingParams(temperature=0, presence_penalty=0.5, stop_token_ids=stops),
            counts=torch.zeros(loaded.config.vocab_size))
    assert eng._accept(s, tokens) == emitted and s.out == tokens[:emitted]
    want = torch.bincount(torch.tensor(tokens[:emitted]), minlength=loaded.config.vocab_size).float()
    assert torch.equal(s.counts, want)


def test_verify_rows_batches_plain_greedy_rows():
    """verify_rows == verify_on_device row by row: one argmax for plain greedy rows (ties: the first maximum),
    the per-row path once any row has drafts, penalties or sampling."""
    from ninfer_rt.speculative import RoundInput, verify_on_device, verify_rows
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1, 50, generator=g)
    logits[2, 0, [7, 30]] = 9.0                           # a tie
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    rows = [RoundInput(greedy, lg, [], [], None, None) for lg in logits]
    assert verify_rows(rows) == [verify_on_device(r).tolist() for r in rows]
    assert verify_rows(rows)[2] == [0, 7]
    pen = SamplingParams(temperature=0.0, max_tokens=4, frequency_penalty=1.0)
    counts = torch.zeros(50)
    counts[int(logits[0].argmax())] = 20.0
    mixed = [RoundInput(pen, logits[0], [], [], counts, None),
             RoundInput(greedy, torch.cat([logits[1], logits[3]]), [int(logits[1].argmax())], [], None, None)] + rows
    assert verify_rows(mixed) == [verify_on_device(r).tolist() for r in mixed]
    assert verify_rows(mixed)[0][1] != int(logits[0].argmax())    # the penalty moved the winner
    assert verify_rows([]) == []


def test_verify_rows_greedy_rounds_on_the_host():
    """Greedy rows with drafts (no penalties): one argmax for the batch, the prefix match on the host; the same
    verdicts as verify_on_device for every K, full / partial / no acceptance, and ties."""
    from ninfer_rt.speculative import RoundInput, verify_on_device, verify_rows
    g = torch.Generator().manual_seed(1)
    greedy = SamplingParams(temperature=0.0, max_tokens=9)
    rows = []
    for k, hits in [(0, 0), (1, 1), (3, 3), (3, 1), (4, 0), (5, 2), (2, 2)]:
        lg = torch.randn(k + 1, 40, generator=g)
        if k == 3 and hits == 1:
            lg[1, [3, 11]] = lg[1].max() + 1.0                  # a tie at the rejecting position
        best = lg.argmax(-1).tolist()
        drafts = best[:hits] + [(best[i] + 1) % 40 for i in range(hits, k)]
        rows.append(RoundInput(greedy, lg, drafts, [], None, None))
    got = verify_rows(rows)
    assert got == [verify_on_device(r).tolist() for r in rows]
    assert [n for n, _ in got] == [0, 1, 3, 1, 0, 2, 2] and got[3][1] == 3
    with pytest.raises(ValueError, match="3 logits rows for 1 drafts"):
        verify_rows([RoundInput(greedy, torch.randn(3, 40), [1], [], None, None)])
    # rows carrying their argmax (read back with the drafts) need no device work; a poisoned logits row shows
    # that verify_rows uses the carried argmax, not the logits
    carried = [RoundInput(greedy, torch.full_like(r.logits, float("nan")), r.drafts, [], None, None,
                          r.logits.argmax(-1).tolist()) for r in rows]
    assert verify_rows(carried) == got
    with pytest.raises(ValueError, match="3 argmax values for 1 drafts"):
        verify_rows([RoundInput(greedy, torch.randn(2, 40), [1], [], None, None, [0, 1, 2])])


def _sampled_rows(k: int, seeds: list, vocab: int = 60) -> list:
    """Sampled RoundInputs of k drafts: temperatures, top-p / top-k, a penalty row and a min_tokens ban; each row's
    drafts drawn from its own q, and its generator seeded (None: the default generator)."""
    from ninfer_rt.sampling import process
    from ninfer_rt.speculative import RoundInput
    g = torch.Generator().manual_seed(k)
    kinds = [dict(temperature=0.7), dict(temperature=1.0, top_p=0.9), dict(temperature=1.3, top_k=7),
             dict(temperature=0.9, frequency_penalty=0.5), dict(temperature=0.8, min_p=0.05)]
    rows = []
    for i, seed in enumerate(seeds):
        params = SamplingParams(max_tokens=9, **kinds[i % len(kinds)])
        q = list(process(torch.randn(k, vocab, generator=g), [params] * k))
        drafts = [int(torch.multinomial(qi, 1, generator=g)) for qi in q]
        counts = torch.bincount(torch.randint(0, vocab, (12,), generator=g), minlength=vocab).float() \
            if params.has_penalties else None
        ban = [(3,)] + [()] * k if i == 1 else None
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        rows.append(RoundInput(params, torch.randn(k + 1, vocab, generator=g), drafts, q, counts, gen, ban=ban))
    return rows


@pytest.mark.parametrize("k,seeds", [(0, [4, 5, 6]), (1, [4, 5]), (3, [1, 2, 3, 4, 5, 6]), (3, [None, None, 7])],
                         ids=["K0-plain-decoding", "K1", "K3-seeded", "K3-default-generator"])
def test_sampled_verdicts_in_one_pass_equal_row_by_row(k, seeds):
    """A batch of sampled rows with one draft count is verified in one pass (`verify_sampled`): the verdicts
    and every generator's position afterwards are `verify_on_device`'s row by row, over many draws (rejections
    at several positions, bonus tokens)."""
    import copy

    from ninfer_rt.speculative import _sampled_batch, decide_on_device, verify_on_device
    rows, seen = _sampled_rows(k, seeds), set()
    assert _sampled_batch(rows)
    for trial in range(40):
        twins = copy.deepcopy(rows)
        torch.manual_seed(trial)
        got = decide_on_device(rows).tolist()
        torch.manual_seed(trial)
        want = [verify_on_device(r).tolist() for r in twins]
        assert got == want
        seen.update(n for n, _ in got)
        assert all(r.generator is None or torch.equal(r.generator.get_state(), t.generator.get_state())
                   for r, t in zip(rows, twins))
    assert len(seen) >= min(k + 1, 3)                         # rejections at several positions, or a bonus


def test_plain_decoding_of_greedy_and_sampled_rows_in_two_passes(monkeypatch):
    """A plain decode step (no drafts) of greedy and sampled rows: the greedy rows' argmax in one pass and the
    sampled rows' draws in another (`verify_sampled`), equal to `verify_on_device` row by row, generators too."""
    import copy

    from ninfer_rt import speculative
    sampled = _sampled_rows(0, [8, 9, 10])
    greedy = [speculative.RoundInput(SamplingParams(temperature=0.0, max_tokens=4), torch.randn(1, 60), [], [],
                                     None, None) for _ in range(2)]
    rows = [greedy[0], sampled[0], sampled[1], greedy[1], sampled[2]]
    toks = set()
    for _ in range(20):
        twins = copy.deepcopy(rows)
        want = [speculative.verify_on_device(r).tolist() for r in twins]
        with monkeypatch.context() as m:
            m.setattr(speculative, "verify_on_device", None)      # two passes, never row by row
            got = speculative.decide_on_device(rows).tolist()
        assert got == want
        assert all(r.generator is None or torch.equal(r.generator.get_state(), t.generator.get_state())
                   for r, t in zip(rows, twins))
        toks.update(t for _, t in got[1:3])
    assert len(toks) > 2                                      # the sampled rows drew different tokens


def test_sampled_batch_only_for_uniform_sampled_rows():
    from ninfer_rt.speculative import RoundInput, _sampled_batch
    rows = _sampled_rows(2, [1, 2])
    greedy = RoundInput(SamplingParams(temperature=0.0, max_tokens=4), torch.randn(3, 60), [1, 2], [], None, None)
    masked = RoundInput(rows[0].params, rows[0].logits, rows[0].drafts, rows[0].q, None, None,
                        allow=torch.ones(3, 60, dtype=torch.bool))
    assert not _sampled_batch(rows[:1])                          # one row: verify_on_device
    assert not _sampled_batch(rows + [greedy])
    assert not _sampled_batch(rows + _sampled_rows(3, [3]))      # another draft count
    assert not _sampled_batch(rows + [masked])                   # a grammar's mask


@pytest.mark.parametrize("kind", ["device", "host", "host-and-argmax", "device-and-argmax"])
def test_read_back_one_transfer(kind):
    """The step's device drafts and the verdict's argmax come back together; host drafts pass through."""
    from ninfer_rt.engine_core import _read_back_drafts
    drafts = [[3, 1], [], [7]]
    dev = kind.startswith("device")
    arg = torch.tensor([5, 6, 7, 8, 9, 4]) if kind.endswith("argmax") else None
    got, ids = _read_back_drafts([torch.tensor(d, dtype=torch.long) for d in drafts] if dev else drafts, arg)
    assert got == drafts and ids == (None if arg is None else arg.tolist())


def test_greedy_draft_fast_path_equals_the_processed_argmax(loaded):
    """All-greedy rows without penalties skip the processed one-hot distributions: same tokens, ties included."""
    from ninfer_rt.sampling import sample
    from ninfer_rt.speculative import draft_distributions
    eng = Engine(loaded, TorchOps(), spec=SpecConfig(num_draft_tokens=2))
    vocab = eng.cfg.vocab_size
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(8))
    logits[1, 5] = logits[1, 9] = logits[1].max() + 1.0              # a tie: the first index wins either way
    seqs = [types.SimpleNamespace(params=GREEDY, counts=None, generator=None, q=None, out=[], grammar=None) for _ in range(3)]
    got = eng._decide_drafts(1, [(s, logits[i], []) for i, s in enumerate(seqs)])
    q = draft_distributions(logits, [GREEDY] * 3, [None] * 3, [[]] * 3, vocab)
    assert got == sample(q, [GREEDY] * 3, [None] * 3).tolist() and got[1] == 5
    assert all(s.q == [] for s in seqs)
    eng.shutdown()


class CountingEngine(Engine):
    """Counts the draft decisions each drafting path made."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = {"device": 0, "host": 0}

    def _device_drafts(self, j, items):
        self.calls["device"] += 1
        return super()._device_drafts(j, items)

    def _decide_drafts(self, j, items):
        self.calls["host"] += 1
        return super()._decide_drafts(j, items)


@pytest.mark.parametrize("k", [2, 4], ids=lambda k: f"K{k}")
def test_chained_drafts_equal_read_back_drafts(loaded, prompts, reference, k, monkeypatch):
    """Greedy TP1 drafts kept on the device between the draft steps (NINFER_DRAFT_CHAIN=1, the default) give
    the same tokens and the same acceptance, position by position, as drafts read back after each step."""
    got = {}
    for chain in ("1", "0"):
        monkeypatch.setenv("NINFER_DRAFT_CHAIN", chain)
        eng = CountingEngine(loaded, TorchOps(), spec=SpecConfig(num_draft_tokens=k), prefill_chunk=CHUNK)
        out, _ = run(eng, prompts)
        assert out == reference
        assert (eng.calls["device"] > 0, eng.calls["host"] > 0) == ((True, False) if chain == "1" else (False, True))
        got[chain] = eng.stats.spec.to_dict()
    assert got["1"] == got["0"]


def test_penalized_sampled_drafts_on_the_device_equal_read_back(loaded, prompts, monkeypatch):
    """Sampled requests with presence / frequency penalties (NInfer's presets) keep their drafts on the device with
    TP1: each draft step's counts add the round's earlier device drafts, so the tokens, the acceptance and every
    generator's draws are those of drafts read back after each step."""
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.95, presence_penalty=1.0, seed=3, max_tokens=NEW,
                             ignore_eos=True),
              SamplingParams(temperature=1.1, presence_penalty=1.5, frequency_penalty=0.3, seed=8, max_tokens=NEW,
                             ignore_eos=True)]
    got = {}
    for chain in ("1", "0"):
        monkeypatch.setenv("NINFER_DRAFT_CHAIN", chain)
        eng = CountingEngine(loaded, TorchOps(), spec=SpecConfig(num_draft_tokens=3), prefill_chunk=CHUNK)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            eng.add_request(f"r{i}", p, sp)
        out = {}
        while eng.has_work():
            for o in eng.step():
                out.setdefault(o.req_id, []).extend(o.new_token_ids)
        assert (eng.calls["device"] > 0, eng.calls["host"] > 0) == ((True, False) if chain == "1" else (False, True))
        got[chain] = (out, eng.stats.spec.to_dict())
    assert got["1"] == got["0"]
    assert 0 < got["1"][1]["accepted"] < got["1"][1]["drafted"]
    seqs = [types.SimpleNamespace(params=p, out=[], grammar=None) for p in params]
    eng.chain_drafts = True
    assert eng._chainable(seqs)
    eng.tp = types.SimpleNamespace(size=2)         # followers keep no counts: such rows are read back under TP
    assert not eng._chainable(seqs)


@pytest.mark.parametrize("params,chained", [
    (SamplingParams(temperature=0.8, seed=1, max_tokens=NEW, ignore_eos=True), True),
    (SamplingParams(temperature=0, presence_penalty=0.5, max_tokens=NEW, ignore_eos=True), False)],
    ids=["sampled", "penalties"])
def test_which_rows_keep_drafts_on_the_device(loaded, prompts, params, chained):
    """Penalized rows (their draft distributions count the earlier drafts) are decided on the host, for the whole
    step; sampled rows are drawn on the device, under TP too (every rank draws from the plan's generator states:
    tests/test_tp.py)."""
    eng = CountingEngine(loaded, TorchOps(), spec=SpecConfig(num_draft_tokens=3), prefill_chunk=CHUNK)
    eng.add_request("b", prompts[1], params)
    while eng.has_work():
        eng.step()
    assert (eng.calls["device"] > 0, eng.calls["host"] > 0) == (chained, not chained)
    seqs = [types.SimpleNamespace(params=p, out=[], grammar=None) for p in (GREEDY, params)]
    assert eng._chainable(seqs[:1]) and eng._chainable(seqs) == chained
    eng.tp = types.SimpleNamespace(size=2)
    assert eng._chainable(seqs[:1]) and eng._chainable(seqs) == chained


def test_draft_chain_switch_is_checked(loaded, monkeypatch):
    monkeypatch.setenv("NINFER_DRAFT_CHAIN", "yes")
    with pytest.raises(SpecError, match=r"^NINFER_DRAFT_CHAIN='yes': expected 1 or 0$"):
        Engine(loaded, TorchOps(), spec=SpecConfig(num_draft_tokens=2))
