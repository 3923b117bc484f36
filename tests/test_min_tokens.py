"""vLLM's `min_tokens`: the stop tokens (eos unless ignore_eos, stop_token_ids) cannot be drawn before that many
tokens, with and without MTP (target rows and drafts by output position), against HF's `min_new_tokens`; stop
strings only match text past them; over the API it is a field of both endpoints."""
from __future__ import annotations

import pytest
import torch
from hf_tiny import build_hf_model, loaded_model
from test_engine_graphs import run as run_engine
from test_server import _post, fake_server

from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.engine import Engine
from ninfer_rt.sampling import SamplingError, SamplingParams, process, stop_ban
from ninfer_rt.server.reasoning import OutputText
from ninfer_rt.speculative import SpecConfig
from ninfer_rt.tokenizer import TextStream
from test_server import tiny_tokenizer

NONSPECIAL = 246         # hf_tiny: ids >= 246 are special tokens
MIN = 6

pytestmark = pytest.mark.usefixtures("one_thread")


def test_stop_ban_by_output_position():
    p = SamplingParams(max_tokens=9, min_tokens=3, stop_token_ids=(7, 2))
    assert stop_ban(p, {5}, 1, 4) == [(2, 5, 7), (2, 5, 7), (), ()]
    assert stop_ban(SamplingParams(max_tokens=9, min_tokens=3, ignore_eos=True, stop_token_ids=(7,)), {5}, 0, 1) \
        == [(7,)]
    assert stop_ban(p, {5}, 3, 2) == [(), ()] and stop_ban(SamplingParams(), {5}, 0, 2) == [(), ()]


@pytest.mark.parametrize("bad", [-1, 10, 1.5, True], ids=["negative", "over-max", "float", "bool"])
def test_min_tokens_is_checked(bad):
    with pytest.raises(SamplingError, match=r"^min_tokens: expected an integer in \[0, max_tokens = 9\]"):
        SamplingParams(max_tokens=9, min_tokens=bad)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_process_gives_banned_tokens_no_mass(temperature):
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(1))
    logits[:, 4] = 50.0                       # the argmax, banned in rows 0 and 2
    p = [SamplingParams(temperature=temperature)] * 3
    got = process(logits, p, ban=[(4, 9), (), (4,)])
    assert got[0, 4] == 0 and got[2, 4] == 0 and got[0, 9] == 0 and got[1, 4] > 0.99
    assert torch.allclose(got.sum(-1), torch.ones(3)) and logits[0, 4] == 50.0      # the caller's logits stay


@pytest.fixture(scope="module")
def tiny():
    return build_hf_model(seed=5)


def _engine_run(tiny, k: int, params: SamplingParams, prompts) -> dict:
    eng = Engine(loaded_model(tiny), TorchOps(), spec=SpecConfig(num_draft_tokens=k) if k else None, max_batch=2,
                 prefill_chunk=8)
    toks = run_engine(eng, prompts, params)
    eng.shutdown()
    return toks


def _prompts_and_stop(tiny):
    """Two prompts and a stop id that HF's greedy continuation of the first emits as its second token."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, NONSPECIAL, (n,), generator=g).tolist() for n in (9, 5)]
    with torch.no_grad():
        free = tiny.causal_lm().generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)[0, len(prompts[0]):].tolist()
    return prompts, free[1]


@pytest.mark.parametrize("k", [0, 2, 3], ids=["plain", "mtp-2", "mtp-3"])
def test_greedy_equals_hf_min_new_tokens(tiny, k):
    prompts, stop = _prompts_and_stop(tiny)
    base = dict(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=(stop,))
    assert len(_engine_run(tiny, k, SamplingParams(**base), prompts[:1])["r0"]) <= 2     # the stop is early
    got = _engine_run(tiny, k, SamplingParams(**base, min_tokens=MIN), prompts)
    lm = tiny.causal_lm()
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = lm.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=MIN, do_sample=False,
                               eos_token_id=stop, pad_token_id=0)[0, len(p):].tolist()
        want = want[:want.index(stop) + 1] if stop in want else want
        assert got[f"r{i}"] == want and len(want) > MIN - (i == 0)     # the first one stops past MIN
        assert stop not in got[f"r{i}"][:MIN]


@pytest.mark.parametrize("k", [0, 2], ids=["plain", "mtp"])
def test_sampled_never_stops_early(tiny, k):
    prompts, stop = _prompts_and_stop(tiny)
    for seed in range(3):
        p = SamplingParams(temperature=1.5, seed=seed, max_tokens=10, min_tokens=MIN, ignore_eos=True,
                           stop_token_ids=(stop, *range(0, NONSPECIAL, 2)))      # half the vocabulary stops
        for toks in _engine_run(tiny, k, p, prompts).values():
            assert len(toks) > MIN and not set(toks[:MIN]) & set(p.stop_token_ids)


def test_run_ahead_waits_for_min_tokens_and_grammars(tiny):
    """Run-ahead decides on the device without the host's bans or masks: such sequences stay off it."""
    import types
    eng = Engine(loaded_model(tiny), TorchOps(), max_batch=2, prefill_chunk=8)
    seq = dict(prefilling=False, vision=None, counts=None, grammar=None, out=[1, 2])
    ok = eng._ahead_eligible(types.SimpleNamespace(params=SamplingParams(max_tokens=8, min_tokens=2), **seq))
    pending = eng._ahead_eligible(types.SimpleNamespace(params=SamplingParams(max_tokens=8, min_tokens=3), **seq))
    ruled = eng._ahead_eligible(types.SimpleNamespace(params=SamplingParams(max_tokens=8), **{**seq, "grammar": 1}))
    eng.shutdown()
    assert ok and not pending and not ruled


def test_text_stream_stops_only_past_its_arming():
    tok = tiny_tokenizer()
    s = TextStream(tok, ("ab",), armed=False)
    assert s.push(tok.encode("xa")) == "x"                           # 'a' may begin a stop that ends armed
    assert s.push(tok.encode("b")) == "ab" and not s.stopped         # not armed: no match
    s.arm()
    assert s.push(tok.encode("b")) == "b" and not s.stopped          # "xabb": its 'ab' ends before the arming
    assert s.push(tok.encode("a")) == "" and s.push(tok.encode("b")) == "" and s.stopped      # "xabbab"
    assert s.text == "xabb"


def test_a_stop_begun_before_the_arming_is_cut_whole():
    """vLLM: stop "xyz", min_tokens 2, output "qxyz" -> "q" (the stop ends with token 4, past min_tokens)."""
    tok = tiny_tokenizer()
    out = OutputText(tok, ("xyz",), None, min_tokens=2)
    sent = "".join(out.push([t])[1] for t in tok.encode("qxyz")) + out.flush()[1]
    assert sent == "q" and out.stopped


def test_output_text_arms_after_min_tokens_ids():
    tok = tiny_tokenizer()
    ids = tok.encode("stop here, then stop")      # the first "stop" ends with id 4: not past min_tokens = 4
    out = OutputText(tok, ("stop",), None, min_tokens=4)
    text = out.push(ids)[1] + out.flush()[1]
    assert text == "stop here, then " and out.stopped
    out = OutputText(tok, ("stop",), None, min_tokens=4)
    assert out.push(ids[:2])[1] == "" and out.push(ids[2:5])[1] == "stop "      # ids split at the arming


@pytest.mark.parametrize("path,prompt", [("/v1/completions", {"prompt": "hello"}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})],
                         ids=["completions", "chat"])
def test_api_min_tokens(path, prompt):
    srv, engine, _ = fake_server()
    try:
        r = _post(srv, path, {**prompt, "max_tokens": 8, "min_tokens": 5})
        assert r.status_code == 200
        assert engine.last_params.min_tokens == 5
        r = _post(srv, path, {**prompt, "max_tokens": 4, "min_tokens": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
        assert r.json()["error"]["message"].startswith("min_tokens: expected an integer in [0, max_tokens = 4]")
        r = _post(srv, path, {**prompt, "min_tokens": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    finally:
        srv.close()


def test_text_stream_keeping_its_stop_holds_nothing_back():
    """include_stop_str_in_output: text that may begin a stop string is released at once (it stays in the output
    either way), and a match ends the text right after the stop string, armed or not yet."""
    tok = tiny_tokenizer()
    held = TextStream(tok, ("abc",))
    kept = TextStream(tok, ("abc",), keep_stop=True)
    assert held.push(tok.encode("xab")) == "x" and kept.push(tok.encode("xab")) == "xab"
    assert kept.push(tok.encode("cyz")) == "c" and kept.stopped and kept.text == "xabc"
    late = TextStream(tok, ("abc",), armed=False, keep_stop=True)
    assert late.push(tok.encode("xab")) == "xab"
    late.arm()
    assert late.push(tok.encode("c!")) == "c" and late.stopped
