"""TorchOps pieces the model tests reach only partly: chunked vs recurrent GDN across chunk boundaries with
a non-zero initial state, snapshots, batched conv, MRoPE against HF's rotary embedding."""
from __future__ import annotations

import pytest
import torch
from hf_tiny import tiny_text_config
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding, apply_rotary_pos_emb

from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.batch import gdn_routing
from numerics import rel

# chunked and token-by-token forms of the same fp32 recurrence (HF observes ~3e-7 at T = 200)
FORM_TOL = 1e-5
ROPE_TOL = 1e-6
HK, HV, DK, DV = 2, 6, 16, 8
ops = TorchOps()




def _gdn_inputs(t, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, HK, DK, generator=g), torch.randn(t, HK, DK, generator=g)
    v = torch.randn(t, HV, DV, generator=g)
    a, b = torch.randn(t, HV, generator=g), torch.randn(t, HV, generator=g)
    gate, beta = ops.gdn_gates(a, b, torch.rand(HV, generator=g).log(), torch.randn(HV, generator=g))
    return q, k, v, gate, beta


def _pool(slots, seed):
    return torch.randn(slots, HV, DK, DV, generator=torch.Generator().manual_seed(seed)) * 0.3


@pytest.mark.parametrize("lens", [(1,), (63,), (64,), (150,), (9, 130, 64)], ids=lambda x: "T" + "+".join(map(str, x)))
def test_gdn_chunk_equals_recurrent(lens):
    full, _, _, _ = gdn_routing(list(lens), list(range(len(lens))), [False] * len(lens), "cpu")
    args = _gdn_inputs(sum(lens), seed=sum(lens))
    p_chunk, p_rec = _pool(len(lens), 1), _pool(len(lens), 1)
    o_chunk = ops.gdn_chunk(*args, p_chunk, full)
    o_rec = ops.gdn_recurrent(*args, p_rec, full)
    assert torch.isfinite(o_chunk).all()
    assert rel(o_chunk, o_rec) <= FORM_TOL
    assert rel(p_chunk, p_rec) <= FORM_TOL


def test_recurrent_snapshots_are_prefix_states():
    t = 5
    args = _gdn_inputs(t, seed=3)
    meta, _, snap, n_snap = gdn_routing([t], [0], [True], "cpu")
    pool = _pool(1, 2)
    before = pool.clone()
    snaps = torch.full((n_snap, HV, DK, DV), float("nan"))
    ops.gdn_recurrent(*args, pool, meta, snaps)
    assert torch.equal(pool, before)                       # snapshot mode leaves the slot alone
    for n in range(1, t + 1):
        ref_pool = before.clone()
        m, _, _, _ = gdn_routing([n], [0], [False], "cpu")
        ops.gdn_recurrent(*(x[:n] for x in args), ref_pool, m)
        assert torch.equal(snaps[n - 1], ref_pool[0])


def test_causal_conv_batched_and_snapshots():
    c, ck = 12, 4
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(10, c, generator=g), torch.randn(c, ck, generator=g)
    init = torch.randn(2, ck - 1, c, generator=g)
    meta, _, _, n_snap = gdn_routing([7, 3], [0, 1], [False, True], "cpu")
    pool, snaps = init.clone(), torch.full((n_snap, ck - 1, c), float("nan"))
    y = ops.causal_conv(x, w, pool, meta, snaps)
    for b, (lo, hi) in enumerate([(0, 7), (7, 10)]):
        window = torch.cat([init[b], x[lo:hi]])
        ref = torch.stack([(window[i:i + ck].t() * w).sum(-1) for i in range(hi - lo)])
        assert rel(y[lo:hi], torch.nn.functional.silu(ref)) <= ROPE_TOL
    assert torch.equal(pool[0], torch.cat([init[0], x[:7]])[-3:])
    assert torch.equal(pool[1], init[1])
    assert torch.equal(snaps[2], torch.cat([init[1], x[7:10]])[-3:])


@pytest.mark.parametrize("rows", ["text", "mrope"])
def test_rope_matches_hf(rows):
    cfg = tiny_text_config()
    t, d = 11, cfg.head_dim
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(t, 4, d, generator=g), torch.randn(t, 2, d, generator=g)
    pos = torch.arange(t) * 3 + 2
    pos3 = pos.expand(3, t).clone() if rows == "text" else torch.stack([pos, pos // 2, pos % 5])
    cos, sin = Qwen3_5TextRotaryEmbedding(cfg)(q, pos3[:, None, :])
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    rot = int(d * cfg.rope_parameters["partial_rotary_factor"])
    section = tuple(cfg.rope_parameters["mrope_section"])
    q_got, k_got = ops.rope(q, k, pos if rows == "text" else pos3, rot, cfg.rope_parameters["rope_theta"], section)
    assert rel(q_got, q_ref[0].transpose(0, 1)) <= ROPE_TOL
    assert rel(k_got, k_ref[0].transpose(0, 1)) <= ROPE_TOL
    assert torch.equal(q_got[..., rot:], q[..., rot:])
