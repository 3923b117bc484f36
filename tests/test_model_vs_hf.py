"""ninfer_rt.model (torch backend) against transformers' Qwen3_5ForCausalLM and the hf_tiny MTP oracle."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from hf_tiny import artifact_weights, build_hf_model, model_config_from_hf
from transformers import GenerationConfig

from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.model import Model, MtpInput, SeqInput
from ninfer_rt.state import CacheConfig
from numerics import rel

# rel L2 of logits / hiddens vs the fp32 reference; bf16/fp16 runs keep their weights and activations in it
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 5e-3}
# our own batched vs one-sequence runs: same math, different packing
BATCH_TOL = 1e-5
PROMPT, DECODE, NONSPECIAL = 70, 32, 246
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
          pytest.param(torch.float16, id="fp16")]




def make_model(tiny, dtype=torch.float32, cache=CacheConfig(num_pages=64, page_size=16, max_seqs=8)):
    cfg = model_config_from_hf(tiny.text_config, mtp=tiny.mtp is not None)
    return Model(cfg, artifact_weights(tiny), TorchOps(), cache=cache, dtype=dtype)


@functools.lru_cache(maxsize=None)
def _case(dtype):
    """Our model in `dtype`, the fp32 HF reference with the same (dtype-rounded) weights, HF's own greedy
    continuation of a random prompt and HF's logits along it (prefill: full forward; then cached decode)."""
    tiny = build_hf_model(seed=3, dtype=dtype)
    ref = copy.deepcopy(tiny.causal_lm()).float()
    prompt = torch.randint(0, NONSPECIAL, (1, PROMPT), generator=torch.Generator().manual_seed(7))
    gc = GenerationConfig(max_new_tokens=DECODE + 1, min_new_tokens=DECODE + 1, do_sample=False,
                          eos_token_id=tiny.text_config.eos_token_id, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
    with torch.no_grad():
        full = ref(prompt, output_hidden_states=True)
        gen = ref.generate(prompt, generation_config=gc)
    return dict(dtype=dtype, tiny=tiny, model=make_model(tiny, dtype), prompt=prompt[0],
                prefill_logits=full.logits[0], hidden=full.hidden_states[-1][0],
                new_tokens=gen.sequences[0, PROMPT:], step_logits=torch.stack(gen.logits)[:, 0])


@pytest.fixture(scope="module", params=DTYPES)
def case(request):
    return _case(request.param)


@pytest.fixture(scope="module", autouse=True)
def drafts_from_lm_head(lm_head_drafts):
    """Every model here is built before its test (and cached): its MTP oracle reads the lm_head."""


@pytest.fixture(scope="module")
def case32():
    """fp32 only: the MTP oracle, state-equality and bookkeeping checks are specified in fp32."""
    return _case(torch.float32)


@pytest.mark.parametrize("chunk", [17, PROMPT], ids=["chunk17", "oneshot"])
def test_prefill_and_decode_match_hf(case, chunk):
    m, tol = case["model"], TOL[case["dtype"]]
    st = m.new_state()
    got = torch.cat([m.forward([SeqInput(case["prompt"][s:s + chunk], st)]).logits
                     for s in range(0, PROMPT, chunk)])
    assert rel(got, case["prefill_logits"]) <= tol
    steps = [m.forward([SeqInput(case["new_tokens"][i:i + 1], st)]).logits[0] for i in range(DECODE)]
    # HF logits[i + 1] come from its cached decode step fed with new_tokens[i]
    assert rel(torch.stack(steps), case["step_logits"][1:]) <= tol
    assert st.length == PROMPT + DECODE
    st.free()


def test_hidden_is_post_norm(case):
    m = case["model"]
    st = m.new_state()
    out = m.forward([SeqInput(case["prompt"], st, logits="none")])
    assert out.logits.shape[0] == 0
    assert rel(out.hidden, case["hidden"]) <= TOL[case["dtype"]]
    st.free()


def _oracle_run(tiny, ids, hidden):
    with torch.no_grad():
        d = tiny.mtp(tiny.embed, ids, hidden)
        return d, tiny.lm_head(d)


@pytest.mark.parametrize("pieces", [(23, 1, 1, 5, 39), (69,)], ids=["chunked", "oneshot"])
def test_mtp_matches_oracle(case32, pieces):
    """Prefill alignment (tokens shifted left by one, hiddens not) in chunks, then a rewind + re-run."""
    m, tiny = case32["model"], case32["tiny"]
    ids, hidden = case32["prompt"][1:], case32["hidden"][:-1]          # x_{t+1} paired with h_t
    st = m.new_state()
    d_parts, logit_parts, s = [], [], 0
    for n in pieces:
        out = m.mtp_forward([MtpInput(ids[s:s + n], hidden[s:s + n], st.mtp)])
        d_parts.append(out.hidden)
        logit_parts.append(out.logits)
        s += n
    d_ref, logits_ref = _oracle_run(tiny, ids, hidden)
    assert rel(torch.cat(d_parts), d_ref) <= TOL[torch.float32]
    assert rel(torch.cat(logit_parts), logits_ref) <= TOL[torch.float32]
    # rewind (MTP KV of a drafting round is discarded) and continue with other tokens
    st.mtp.rewind(40)
    alt = torch.randint(0, NONSPECIAL, (6,), generator=torch.Generator().manual_seed(1))
    out = m.mtp_forward([MtpInput(alt, hidden[40:46], st.mtp)])
    d_ref2, _ = _oracle_run(tiny, torch.cat([ids[:40], alt]), hidden[:46])
    assert rel(out.hidden, d_ref2[40:]) <= TOL[torch.float32]
    assert st.mtp.length == 46
    st.free()


def _gdn_state(m, st):
    return m.gdn_pool.conv[:, st.slot].clone(), m.gdn_pool.rec[:, st.slot].clone()


def _kv(m, st, n):
    pages = torch.tensor(st.pages, dtype=torch.long)
    k = m.kv_pool.k[:-1].index_select(1, pages).flatten(1, 2)[:, :n]   # main layers only (last = MTP)
    v = m.kv_pool.v[:-1].index_select(1, pages).flatten(1, 2)[:, :n]
    return k, v


K_DRAFT = 3


@pytest.mark.parametrize("n", range(K_DRAFT + 2), ids=lambda n: f"accept{n}")
def test_verify_snapshot_commit_equals_prefix_run(case32, n):
    m, prompt = case32["model"], case32["prompt"]
    verify = case32["new_tokens"][:K_DRAFT + 1]
    a, b = m.new_state(), m.new_state()
    for st in (a, b):
        m.forward([SeqInput(prompt[:20], st)])
    out_a = m.forward([SeqInput(verify, a, snapshot=True)])
    assert a.length == 20 and a.pending is not None
    with pytest.raises(RuntimeError, match="commit"):
        m.forward([SeqInput(verify[:1], a)])
    a.commit(n)
    if n:
        out_b = m.forward([SeqInput(verify[:n], b)])
        assert rel(out_a.logits[:n], out_b.logits) <= BATCH_TOL
    assert a.length == b.length == 20 + n
    for x, y in zip(_gdn_state(m, a), _gdn_state(m, b)):
        assert rel(x, y) <= BATCH_TOL
    for x, y in zip(_kv(m, a, 20 + n), _kv(m, b, 20 + n)):
        assert rel(x, y) <= BATCH_TOL
    nxt = prompt[30:31]           # both continue identically
    assert rel(m.forward([SeqInput(nxt, a)]).logits, m.forward([SeqInput(nxt, b)]).logits) <= BATCH_TOL
    a.free(), b.free()


def test_mixed_batch_equals_single_runs(case32):
    """One forward with a prefill chunk, a decode and a snapshot verify == each sequence alone."""
    m, p = case32["model"], case32["prompt"]
    solo, batch = [m.new_state() for _ in range(3)], [m.new_state() for _ in range(3)]
    for group in (solo, batch):
        m.forward([SeqInput(p[:9], group[1])])
        m.forward([SeqInput(p[:12], group[2])])
    inputs = [(p[:30], False), (p[9:10], False), (p[12:16], True)]
    alone = [m.forward([SeqInput(ids, st, snapshot=snap)]).logits for (ids, snap), st in zip(inputs, solo)]
    out = m.forward([SeqInput(ids, st, snapshot=snap) for (ids, snap), st in zip(inputs, batch)])
    for i, ref in enumerate(alone):
        assert rel(out.seq_logits(i), ref) <= BATCH_TOL
    solo[2].commit(2), batch[2].commit(2)
    for x, y in zip(solo, batch):
        assert x.length == y.length
        for u, v in zip(_gdn_state(m, x), _gdn_state(m, y)):
            assert rel(u, v) <= BATCH_TOL
    last = m.forward([SeqInput(p[:5], x, logits="last") for x in (m.new_state(), m.new_state())])
    assert last.logits.shape == (2, m.cfg.vocab_size) and last.logit_rows == [4, 9]
    for st in solo + batch:
        st.free()


def test_kv_pages_return_to_pool(case32):
    tiny = case32["tiny"]
    m = make_model(tiny, cache=CacheConfig(num_pages=6, page_size=4, max_seqs=2))
    pool = m.kv_pool
    assert pool.free_pages() == 6
    a, b = m.new_state(), m.new_state()
    m.forward([SeqInput(case32["prompt"][:9], a), SeqInput(case32["prompt"][:3], b)])
    assert pool.free_pages() == 6 - 3 - 1
    m.forward([SeqInput(case32["prompt"][:4], b, snapshot=True)])      # positions 3..6 -> 2 pages
    assert pool.free_pages() == 1
    b.mtp.rewind(0)                                                  # pending verify KV is kept
    assert pool.free_pages() == 1
    b.commit(1)                                                      # length 4 -> back to 1 page
    assert pool.free_pages() == 2
    with pytest.raises(Exception, match="slots"):
        m.new_state()
    from ninfer_rt.state import CapacityError
    with pytest.raises(CapacityError, match="KV cache full"):
        m.forward([SeqInput(case32["prompt"][:20], a)])
    a.free(), b.free()
    a.free()                                                         # idempotent
    assert pool.free_pages() == 6 and m.gdn_pool.free_slots() == 2
    with pytest.raises(RuntimeError, match="freed"):
        m.forward([SeqInput(case32["prompt"][:1], a)])
