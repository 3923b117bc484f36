"""vLLM's `bad_words`: no output ends with a banned token sequence (one token: never drawn; longer: its last token
is banned where the others end the output so far), on target rows and MTP drafts alike; greedy output equals a
step-by-step reference over HF's logits; over the API the words are tokenized as vLLM does."""
from __future__ import annotations

import types

import pytest
import torch
from hf_tiny import build_hf_model, loaded_model
from test_engine_graphs import run as run_engine
from test_server import MODEL_ID, _post, real_srv, tiny_tokenizer  # noqa: F401

from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.engine import Engine
from ninfer_rt.sampling import SamplingError, SamplingParams, bad_word_ban, merged
from ninfer_rt.server import handlers as H
from ninfer_rt.speculative import SpecConfig

pytestmark = pytest.mark.usefixtures("one_thread")
NONSPECIAL = 246         # hf_tiny: ids >= 246 are special tokens


def test_bans_by_the_history_before_each_row():
    p = SamplingParams(bad_words_ids=[(5,), (7, 8), (1, 2, 3), (7, 8)])
    assert p.bad_words_ids == ((5,), (7, 8), (1, 2, 3))
    assert bad_word_ban(p, [1, 2], [7, 9], 3) == [(3, 5), (5, 8), (5,)]
    assert bad_word_ban(SamplingParams(), [1], [2], 2) == [(), ()]
    assert merged([(1, 4), ()], [(4, 2), ()]) == [(1, 2, 4), ()]
    with pytest.raises(SamplingError, match="^bad_words_ids: expected non-empty sequences"):
        SamplingParams(bad_words_ids=[()])
    assert not SamplingParams(temperature=0, bad_words_ids=[(1,)]).plain_greedy


@pytest.fixture(scope="module")
def tiny():
    return build_hf_model(seed=5)


PROMPTS = [[5, 9, 11, 60, 2], [100, 7, 7]]


def _greedy(tiny, prompt, n: int, words=()) -> list[int]:
    """HF's greedy continuation with the same bans, step by step."""
    lm, ids, out = tiny.causal_lm(), list(prompt), []
    p = SamplingParams(bad_words_ids=words) if words else SamplingParams()
    with torch.no_grad():
        for _ in range(n):
            logits = lm(input_ids=torch.tensor([ids])).logits[0, -1].float()
            logits[list(bad_word_ban(p, out, [], 1)[0])] = -float("inf")
            t = int(logits.argmax())
            out.append(t)
            ids.append(t)
    return out


def _words(tiny) -> tuple:
    """A one-token and a two-token word out of the free continuation of the first prompt."""
    free = _greedy(tiny, PROMPTS[0], 8)
    return ((free[2],), (free[4], free[5]))


def _engine(tiny, k: int):
    return Engine(loaded_model(tiny), TorchOps(), spec=SpecConfig(num_draft_tokens=k) if k else None, max_batch=2,
                  prefill_chunk=8)


@pytest.mark.parametrize("k", [0, 2, 3], ids=["plain", "mtp-2", "mtp-3"])
def test_greedy_equals_the_banned_reference(tiny, k):
    words = _words(tiny)
    eng = _engine(tiny, k)
    got = run_engine(eng, PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                   bad_words_ids=words))
    eng.shutdown()
    want = [_greedy(tiny, p, 10, words) for p in PROMPTS]
    assert [got["r0"], got["r1"]] == want and want[0] != _greedy(tiny, PROMPTS[0], 10)     # the bans bit


def _contains(toks: list[int], w: tuple) -> bool:
    return any(tuple(toks[i:i + len(w)]) == w for i in range(len(toks) - len(w) + 1))


@pytest.mark.parametrize("k", [0, 2], ids=["plain", "mtp"])
def test_sampled_output_never_holds_a_banned_word(tiny, k):
    g = torch.Generator().manual_seed(4)
    words = tuple((int(a),) for a in torch.randint(0, NONSPECIAL, (40,), generator=g)) + \
        tuple((int(a), int(b)) for a, b in torch.randint(0, NONSPECIAL, (60, 2), generator=g))
    eng = _engine(tiny, k)
    for seed in range(3):
        got = run_engine(eng, PROMPTS, SamplingParams(temperature=1.5, seed=seed, max_tokens=24, ignore_eos=True,
                                                       allowed_token_ids=tuple(range(0, 60)), bad_words_ids=words))
        for toks in got.values():
            assert len(toks) == 24 and not any(_contains(toks, w) for w in words), toks
    eng.shutdown()


def test_run_ahead_leaves_bad_words_to_the_host(tiny):
    eng = Engine(loaded_model(tiny), TorchOps(), max_batch=2, prefill_chunk=8)
    seq = dict(prefilling=False, vision=None, counts=None, grammar=None, out=[1, 2])
    ok = eng._ahead_eligible(types.SimpleNamespace(params=SamplingParams(), **seq))
    ruled = eng._ahead_eligible(types.SimpleNamespace(params=SamplingParams(bad_words_ids=[(1,)]), **seq))
    eng.shutdown()
    assert ok and not ruled


def test_words_are_tokenized_as_vllm_does():
    tok = tiny_tokenizer()
    got = H.bad_words_ids(tok, ["hello", " x"])
    assert tuple(tok.encode("hello")) in got and tuple(tok.encode("x")) in got
    spaced = tok.encode(" hello")
    assert (tuple(spaced) in got) == (len(spaced) == len(tok.encode("hello")) and spaced[0] != tok.encode("hello")[0])


def test_api_bad_words(real_srv):  # noqa: F811
    body = {"model": MODEL_ID, "prompt": "x", "max_tokens": 6, "temperature": 0}
    free = _post(real_srv, "/v1/completions", body).json()["choices"][0]["text"]
    word = next(ch for ch in free if ch.strip() and ch != "\ufffd")
    r = _post(real_srv, "/v1/completions", {**body, "bad_words": [word]})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] != free
    r = _post(real_srv, "/v1/completions", {**body, "bad_words": ["ok", " "]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "bad_words.1", err
