"""Log-probabilities of emitted tokens (ninfer_rt.logprobs): the packing against torch's log_softmax / topk, and the
Engine's values against HF transformers' logits over the same text, with and without MTP, greedy and sampled;
requests that ask for logprobs leave the run-ahead path."""
from __future__ import annotations

import math

import pytest
import torch
from hf_tiny import build_hf_model, loaded_model

from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.engine import Engine
from ninfer_rt import logprobs as logprobs_mod
from ninfer_rt.logprobs import FLOOR, token_logprobs
from ninfer_rt.sampling import MAX_LOGPROBS, SamplingError, SamplingParams
from ninfer_rt.speculative import SpecConfig

LP_TOL = 1e-4            # fp32 engine against fp32 HF: absolute, in nats
NONSPECIAL = 246         # hf_tiny: ids >= 246 are special tokens

pytestmark = pytest.mark.usefixtures("one_thread")
MODES = pytest.mark.parametrize("k,temperature", [(0, 0.0), (2, 0.0), (2, 1.0)],
                                ids=["plain-greedy", "mtp-greedy", "mtp-sampled"])


# ---- the packing ----
@pytest.mark.parametrize("ks", [(0,), (3,), (0, 5, 2)], ids=["k0", "k3", "mixed-k"])
def test_token_logprobs_match_torch(ks, monkeypatch):
    monkeypatch.setattr(logprobs_mod, "SLICE", 2)        # sequences of up to 3 rows: one or two slices each
    g = torch.Generator().manual_seed(len(ks))
    vocab, width = 33, 37                        # logits wider than the vocabulary (padded heads)
    items = []
    for k in ks:
        n = int(torch.randint(1, 4, (1,), generator=g))
        lg = torch.full((n + 1, width), float("nan"))          # a row past the emitted ones: never read
        lg[:n] = torch.randn(n, width, generator=g) * 3
        items.append((lg, torch.randint(0, vocab, (n,), generator=g).tolist(), k))
    got = token_logprobs(items, vocab)
    for (lg, toks, k), seq in zip(items, got):
        want = torch.log_softmax(lg[:len(toks), :vocab].double(), -1)
        assert [t.token_id for t in seq] == toks
        for j, t in enumerate(seq):
            assert math.isclose(t.logprob, want[j, toks[j]].item(), abs_tol=1e-5)
            val, idx = want[j].topk(k) if k else (torch.zeros(0), torch.zeros(0, dtype=torch.long))
            assert [i for i, _ in t.top] == idx.tolist()
            assert all(math.isclose(a, b, abs_tol=1e-5) for (_, a), b in zip(t.top, val.tolist()))


def test_ruled_out_tokens_get_the_floor():
    lg = torch.tensor([[0.0, float("-inf"), 1.0]])
    (seq,) = token_logprobs([(lg, [1], 3)], 3)
    assert seq[0].logprob == FLOOR and seq[0].top[-1] == (1, FLOOR) and seq[0].top[0][0] == 2
    assert token_logprobs([], 3) == []


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, 1.5, True], ids=["negative", "too-many", "float", "bool"])
def test_sampling_params_reject_bad_logprobs(name, bad):
    with pytest.raises(SamplingError, match=rf"^{name}: expected an integer in \[0, 20\]"):
        SamplingParams(**{name: bad})


# ---- the Engine against HF ----
@pytest.fixture(scope="module")
def tiny():
    return build_hf_model(seed=5)


@pytest.fixture(scope="module")
def loaded(tiny):
    return loaded_model(tiny)


def _hf_logprobs(tiny, prompt: list[int], out: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at the positions that chose each output token."""
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = tiny.causal_lm()(input_ids=ids).logits[0].double()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:len(prompt) - 1 + len(out)]


def _run(loaded, k: int, params: SamplingParams, prompts, plps: dict | None = None):
    """-> (tokens, logprobs) per request; `plps` collects each request's prompt logprobs (they come once)."""
    eng = Engine(loaded, TorchOps(), spec=SpecConfig(num_draft_tokens=k) if k else None, max_batch=2,
                 prefill_chunk=8)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    toks = {f"r{i}": [] for i in range(len(prompts))}
    lps = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_work():
        for o in eng.step():
            toks[o.req_id] += o.new_token_ids
            assert (o.logprobs is None) == (params.logprobs is None)
            if o.logprobs is not None:
                assert [t.token_id for t in o.logprobs] == o.new_token_ids
                lps[o.req_id] += o.logprobs
            first = len(toks[o.req_id]) == len(o.new_token_ids)
            assert (o.prompt_logprobs is not None) == (first and params.prompt_logprobs is not None)
            if o.prompt_logprobs is not None:
                plps[o.req_id] = o.prompt_logprobs
    eng.shutdown()
    return toks, lps


@MODES
def test_engine_logprobs_equal_hf(tiny, loaded, k, temperature):
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, NONSPECIAL, (n,), generator=g).tolist() for n in (5, 13)]
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=9, ignore_eos=True, logprobs=4)
    toks, lps = _run(loaded, k, params, prompts)
    for i, p in enumerate(prompts):
        out, got = toks[f"r{i}"], lps[f"r{i}"]
        want = _hf_logprobs(tiny, p, out)
        assert len(got) == len(out) == 9
        for j, t in enumerate(got):
            assert abs(t.logprob - want[j, out[j]].item()) <= LP_TOL
            val, idx = want[j].topk(4)
            assert [x for x, _ in t.top] == idx.tolist()
            assert max(abs(a - b) for (_, a), b in zip(t.top, val.tolist())) <= LP_TOL
            if temperature == 0:
                assert t.top[0][0] == out[j]          # greedy: the chosen token is the most likely one


@pytest.mark.parametrize("k,cap", [(0, 128), (2, 128), (2, 3)], ids=["plain", "mtp", "mtp-chunks-of-3"])
def test_prompt_logprobs_equal_hf(tiny, loaded, k, cap, monkeypatch):
    """Prompts of 1, 5 and 13 tokens (13: two chunks of 8, or five of at most 3 under a smaller cap on such
    requests' chunks) return the logprobs of their tokens after the first, once, with the first output token;
    the output is what it is without them."""
    import ninfer_rt.engine as engine_mod
    monkeypatch.setattr(engine_mod, "PROMPT_LOGPROBS_CHUNK", cap)
    g = torch.Generator().manual_seed(10)
    prompts = [torch.randint(0, NONSPECIAL, (n,), generator=g).tolist() for n in (13, 5, 1)]
    base = dict(temperature=0, max_tokens=5, ignore_eos=True)
    plain, _ = _run(loaded, k, SamplingParams(**base), prompts)
    plps: dict = {}
    toks, _ = _run(loaded, k, SamplingParams(**base, prompt_logprobs=2), prompts, plps)
    assert toks == plain
    for i, p in enumerate(prompts):
        got = plps[f"r{i}"]
        assert [t.token_id for t in got] == p[1:]
        if len(p) > 1:
            want = _hf_logprobs(tiny, p[:1], p[1:])
            for j, t in enumerate(got):
                assert abs(t.logprob - want[j, p[j + 1]].item()) <= LP_TOL
                assert [x for x, _ in t.top] == want[j].topk(2).indices.tolist()


@pytest.mark.parametrize("logprobs", [None, 0], ids=["off-runs-ahead", "on-stays-in-step"])
def test_logprobs_leave_the_run_ahead_path(loaded, logprobs):
    """Run-ahead emits tokens read back from a step launched before the previous one was read: it has no logits
    rows to take logprobs from, so a request that asks for them keeps every step synchronous."""
    eng = Engine(loaded, TorchOps(), max_batch=1, async_scheduling=True)
    eng.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=logprobs))
    outs = []
    while eng.has_work():
        outs += eng.step()
    assert sum(len(o.new_token_ids) for o in outs) == 6
    if logprobs is None:
        assert eng.stats.ahead_steps > 0 and all(o.logprobs is None for o in outs)
    else:
        assert eng.stats.ahead_steps == 0
        assert [t.token_id for o in outs for t in o.logprobs] == [t for o in outs for t in o.new_token_ids]
        assert all(t.top == () and t.logprob <= 0 for o in outs for t in o.logprobs)
    eng.shutdown()


# ---- logit_bias (it shapes the choice; logprobs stay the model's own) ----
@MODES
def test_logit_bias_steers_the_choice_not_the_logprobs(tiny, loaded, k, temperature):
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, NONSPECIAL, (n,), generator=g).tolist() for n in (6, 11)]
    base = dict(temperature=temperature, seed=4, max_tokens=6, ignore_eos=True, logprobs=1)
    plain, _ = _run(loaded, k, SamplingParams(**base), prompts)
    forced, lps = _run(loaded, k, SamplingParams(**base, logit_bias={65: 100.0}), prompts)
    for i, p in enumerate(prompts):
        assert forced[f"r{i}"] == [65] * 6
        want = _hf_logprobs(tiny, p, forced[f"r{i}"])
        assert max(abs(t.logprob - want[j, 65].item()) for j, t in enumerate(lps[f"r{i}"])) <= LP_TOL
    if temperature == 0:                     # a bias against the plain first token moves the first choice
        first = plain["r0"][0]
        banned, _ = _run(loaded, k, SamplingParams(**base, logit_bias={first: -100.0}), prompts[:1])
        assert banned["r0"][0] != first and first not in banned["r0"]


def test_logit_bias_is_checked():
    with pytest.raises(SamplingError, match=r"^logit_bias: expected distinct token ids >= 0 mapped to numbers"):
        SamplingParams(logit_bias={3: 101})
    assert SamplingParams(logit_bias={5: 1, 2: -3.5}).logit_bias == ((2, -3.5), (5, 1.0))
    assert not SamplingParams(temperature=0, logit_bias={1: 1}).plain_greedy


def test_engine_refuses_a_bias_outside_the_vocabulary(loaded):
    from ninfer_rt.engine import EngineError
    eng = Engine(loaded, TorchOps(), max_batch=1)
    with pytest.raises(EngineError, match=r"request 'r': logit_bias token id 256 outside the vocabulary \(0..255\)"):
        eng.add_request("r", [1, 2], SamplingParams(logit_bias={256: 1.0}))
    eng.shutdown()


def test_logit_bias_on_the_run_ahead_path(loaded):
    """Run-ahead decides on the device (`decide_on_device`): a biased row takes the processed distribution."""
    eng = Engine(loaded, TorchOps(), max_batch=1, async_scheduling=True)
    eng.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                   logit_bias={66: 100.0}))
    toks = []
    while eng.has_work():
        toks += [t for o in eng.step() for t in o.new_token_ids]
    assert toks == [66] * 6 and eng.stats.ahead_steps > 0
    eng.shutdown()


# ---- repetition_penalty (HF / vLLM semantics: prompt and output tokens) ----
def test_repetition_penalty_matches_hf_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    from ninfer_rt.sampling import process
    g = torch.Generator().manual_seed(13)
    logits = torch.randn(3, 40, generator=g) * 4
    prompt, out = [3, 7, 7, 11], [[5, 5], [], [3, 39]]
    params = [SamplingParams(temperature=1.0, repetition_penalty=rp) for rp in (1.3, 0.7, 2.0)]
    counts = [torch.bincount(torch.tensor(o, dtype=torch.long), minlength=40).float() for o in out]
    seen = torch.zeros(40, dtype=torch.bool)
    seen[prompt] = True
    got = process(logits, params, counts, [seen] * 3)
    for r, p in enumerate(params):
        ids = torch.tensor([prompt + out[r]])
        want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, logits[r:r + 1].clone())
        assert torch.allclose(got[r], torch.softmax(want[0], -1), atol=1e-6)


@pytest.mark.parametrize("k", [0, 2], ids=["plain", "mtp"])
def test_repetition_penalty_greedy_equals_hf_generate(tiny, loaded, k):
    """Greedy with repetition_penalty = 1.5: the tokens of HF's `generate(repetition_penalty=1.5)`."""
    g = torch.Generator().manual_seed(14)
    prompts = [torch.randint(0, NONSPECIAL, (n,), generator=g).tolist() for n in (7, 12)]
    toks, _ = _run(loaded, k, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.5),
                   prompts)
    lm = tiny.causal_lm()
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = lm.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, repetition_penalty=1.5,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert toks[f"r{i}"] == want


def test_repetition_penalty_is_checked():
    for bad in (0, -1.0, 11.0, float("inf")):
        with pytest.raises(SamplingError, match=r"^repetition_penalty: expected a number in \(0, 10\]"):
            SamplingParams(repetition_penalty=bad)
    assert SamplingParams(repetition_penalty=1.1).has_penalties and not SamplingParams().has_penalties
