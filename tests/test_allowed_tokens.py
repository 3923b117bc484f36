"""vLLM's `allowed_token_ids`: the only tokens a request may draw, on target rows and MTP drafts alike; greedy
output equals the argmax over the allowed tokens of HF's logits, sampled output never leaves them; over the API
it is a field of both endpoints, checked against the vocabulary."""
from __future__ import annotations

import re

import pytest
import torch
from hf_tiny import build_hf_model, loaded_model
from test_engine_graphs import run as run_engine
from test_server import MODEL_ID, _post, real_srv  # noqa: F401

from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.engine import Engine
from ninfer_rt.sampling import SamplingError, SamplingParams, process
from ninfer_rt.speculative import SpecConfig

pytestmark = pytest.mark.usefixtures("one_thread")
ALLOWED = (3, 17, 40, 41, 99, 200)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_process_gives_other_tokens_no_mass(temperature):
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(2))
    logits[:, 7] = 40.0                       # the argmax, not allowed in row 0
    p = [SamplingParams(temperature=temperature, allowed_token_ids=(3, 9, 12)), SamplingParams(temperature=temperature)]
    got = process(logits, p)
    assert float(got[0, [3, 9, 12]].sum()) == pytest.approx(1.0) and got[1, 7] > 0.99
    assert logits[0, 7] == 40.0                                       # the caller's logits stay


def test_allowed_token_ids_are_checked():
    assert SamplingParams(allowed_token_ids=[5, 2, 5]).allowed_token_ids == (2, 5)
    with pytest.raises(SamplingError, match="^allowed_token_ids: expected non-negative integers"):
        SamplingParams(allowed_token_ids=(1, -2))
    assert not SamplingParams(temperature=0, allowed_token_ids=(1,)).plain_greedy


@pytest.fixture(scope="module")
def tiny():
    return build_hf_model(seed=5)


PROMPTS = [[5, 9, 11, 60, 2], [100, 7, 7]]


def _want(tiny, prompt: list[int], n: int) -> list[int]:
    lm, ids, out = tiny.causal_lm(), list(prompt), []
    allowed = torch.tensor(ALLOWED)
    with torch.no_grad():
        for _ in range(n):
            logits = lm(input_ids=torch.tensor([ids])).logits[0, -1].float()
            t = int(allowed[logits[allowed].argmax()])
            out.append(t)
            ids.append(t)
    return out


@pytest.mark.parametrize("k", [0, 2, 3], ids=["plain", "mtp-2", "mtp-3"])
def test_greedy_equals_the_allowed_argmax_of_hf_logits(tiny, k):
    eng = Engine(loaded_model(tiny), TorchOps(), spec=SpecConfig(num_draft_tokens=k) if k else None, max_batch=2,
                 prefill_chunk=8)
    got = run_engine(eng, PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                   allowed_token_ids=ALLOWED))
    eng.shutdown()
    for i, p in enumerate(PROMPTS):
        assert got[f"r{i}"] == _want(tiny, p, 10)


@pytest.mark.parametrize("k", [0, 2], ids=["plain", "mtp"])
def test_sampled_stays_in_the_allowed_tokens(tiny, k):
    eng = Engine(loaded_model(tiny), TorchOps(), spec=SpecConfig(num_draft_tokens=k) if k else None, max_batch=2,
                 prefill_chunk=8)
    for seed in range(3):
        got = run_engine(eng, PROMPTS, SamplingParams(temperature=1.5, seed=seed, max_tokens=12, ignore_eos=True,
                                                       allowed_token_ids=ALLOWED))
        assert all(set(t) <= set(ALLOWED) and len(t) == 12 for t in got.values()), got
    eng.shutdown()


def test_api_allowed_token_ids(real_srv):  # noqa: F811
    tok = real_srv.state.tokenizer
    allowed = sorted({tok.encode("a")[0], tok.encode("b")[0]})
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                 "chat_template_kwargs": {"enable_thinking": False}})):
        r = _post(real_srv, path, {"model": MODEL_ID, "max_tokens": 8, "temperature": 1.0, "seed": 1,
                                   "allowed_token_ids": allowed, **body})
        c = r.json()["choices"][0]
        text = c.get("text", c.get("message", {}).get("content"))
        assert r.status_code == 200 and set(text) <= {"a", "b"} and len(text) == 8, r.json()
    r = _post(real_srv, "/v1/completions", {"model": MODEL_ID, "prompt": "x", "max_tokens": 12, "temperature": 1.0,
                                            "seed": 2, "allowed_token_ids": tok.encode("12-ab"),
                                            "structured_outputs": {"regex": "[0-9]{2,3}-[a-z]{1,4}"}})
    c = r.json()["choices"][0]          # the grammar's stop token is not allowed: the grammar outranks at its end
    assert r.status_code == 200 and c["finish_reason"] == "stop", r.json()
    assert re.fullmatch(r"[12]{2,3}-[ab]{1,4}", c["text"]), c
    for ids, why in (([], "must not be empty"), ([10 ** 7], "outside the vocabulary")):
        r = _post(real_srv, "/v1/completions", {"model": MODEL_ID, "prompt": "x", "allowed_token_ids": ids})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "allowed_token_ids" and why in err["message"], err


def test_bans_that_empty_a_row_give_way_to_its_hard_restrictions():
    """A grammar row allowing only token 4 keeps it though a bad word bans it; allowed (3, 4) keeps its tokens
    though bans (a stop under min_tokens, a bad word) cover both."""
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(5))
    logits[:, 0] = 50.0                                          # the raw argmax: allowed nowhere
    grammar = torch.zeros(2, 30, dtype=torch.bool)
    grammar[0, 4] = True
    grammar[1] = True
    p = [SamplingParams(temperature=0), SamplingParams(temperature=0, allowed_token_ids=(3, 4))]
    got = process(logits, p, ban=[(4,), (3, 4)], allow=grammar)
    assert int(got[0].argmax()) == 4 and int(got[1].argmax()) in (3, 4)


def test_a_row_its_restrictions_empty_draws_from_the_raw_logits():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(3))
    grammar = torch.zeros(2, 30, dtype=torch.bool)                 # a mask with no token: no grammar's, but safe
    p = [SamplingParams(temperature=0, allowed_token_ids=(4, 5)), SamplingParams(temperature=1.0)]
    got = process(logits, p, ban=[(7,), ()], allow=grammar)
    assert torch.isfinite(got).all() and got[0].argmax() == logits[0].argmax()     # no token 0 by default
    assert torch.allclose(got[1], torch.softmax(logits[1], -1), atol=1e-6)


def test_the_grammar_outranks_the_allowed_tokens_where_together_they_leave_nothing():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(4))
    grammar = torch.zeros(2, 30, dtype=torch.bool)
    grammar[0, 4:7] = True                                       # meets the allowed tokens at 5 only
    grammar[1, 8:11] = True                                      # does not meet them
    p = [SamplingParams(temperature=0, allowed_token_ids=(3, 5)), SamplingParams(temperature=1.0,
                                                                                 allowed_token_ids=(3, 5))]
    got = process(logits, p, allow=grammar)
    assert int(got[0].argmax()) == 5
    assert torch.allclose(got[1], torch.softmax(logits[1].masked_fill(~grammar[1], float("-inf")), -1), atol=1e-6)


@pytest.mark.parametrize("k", [0, 3], ids=["plain", "mtp-3"])
def test_allowed_tokens_inside_a_grammar_equal_the_masked_hf_argmax(tiny, k):
    """A regex with allowed_token_ids that hold some of its tokens and not the stop token: greedy output is the
    argmax of HF's logits over grammar and allowed tokens, over the grammar's alone where they do not meet (its
    stop token at the end): xgrammar's matcher accepts every token."""
    xgr = pytest.importorskip("xgrammar")
    from test_server import tiny_tokenizer
    from test_structured import hf_eos

    from ninfer_rt.grammar import GrammarBackend, unpack
    tok, spec = tiny_tokenizer(), ("regex", r"[0-9]{2,3}-[a-z]{1,4}")
    allowed = tuple(tok.encode("12-ab"))
    backend = GrammarBackend(tok, 256, {hf_eos()} | tok.stop_ids)
    m = xgr.GrammarMatcher(backend.compile(spec))
    bits = xgr.allocate_token_bitmask(1, backend.words * 32)
    only = torch.zeros(256, dtype=torch.bool)
    only[list(allowed)] = True
    prompt, lm, want = tok.encode("x"), tiny.causal_lm(), []
    with torch.no_grad():
        while len(want) < 12:
            logits = lm(input_ids=torch.tensor([prompt + want])).logits[0, -1].float()
            m.fill_next_token_bitmask(bits)
            g = unpack(bits, 256)[0]
            keep = g & only if (g & only).any() else g
            want.append(int(logits.masked_fill(~keep, float("-inf")).argmax()))
            assert m.accept_token(want[-1])
            if m.is_terminated():
                break
    assert set(want[:-1]) <= set(allowed) and want[-1] not in allowed      # both restrictions were in play
    eng = Engine(loaded_model(tiny), TorchOps(), spec=SpecConfig(num_draft_tokens=k) if k else None, max_batch=2,
                 tokenizer=tok)
    eng.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=12, structured=spec,
                                                allowed_token_ids=allowed))
    got = []
    while eng.has_work():
        got += [t for o in eng.step() for t in o.new_token_ids]
    eng.shutdown()
    assert got == want


@pytest.mark.parametrize("kw,needle", [
    (dict(allowed_token_ids=(3, 4), bad_words_ids=((3,), (4,), (5, 6))), "every allowed token is banned"),
    (dict(allowed_token_ids=(3,), stop_token_ids=(3,), min_tokens=2, max_tokens=4), "every allowed token is banned"),
    (dict(allowed_token_ids=(3, 4), stop_token_ids=(4,), bad_words_ids=((3,),), min_tokens=1),
     "every allowed token is banned"),
], ids=["all-bad", "all-stops", "bad-and-stops"])
def test_requests_that_leave_no_token_are_refused(kw, needle):
    with pytest.raises(SamplingError, match=needle):
        SamplingParams(**kw)


def test_the_allowed_mask_is_built_once_per_request():
    import gc

    from ninfer_rt import sampling
    p = SamplingParams(allowed_token_ids=tuple(range(0, 20000, 3)))
    logits = torch.randn(3, 20000)
    first = process(logits, [p, SamplingParams(), p])
    key = (id(p), "cpu", 20000)
    before = len(sampling._MASKS)
    assert torch.equal(process(logits, [p, SamplingParams(), p]), first) and len(sampling._MASKS) == before
    assert key in sampling._MASKS
    del p
    gc.collect()
    assert key not in sampling._MASKS                             # dropped with its request
