"""Tensor-parallel model math in one process: TP ranks run in threads over a barrier-based TPGroup, on
per-rank shards cut by the packer's TP table; logits (gathered) and hiddens must equal TP1."""
from __future__ import annotations

import threading

import pytest
import torch
from hf_tiny import build_hf_model, make_tiny_artifact

from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.loader import load
from ninfer_rt.model import Model, MtpInput, SeqInput
from ninfer_rt.tp_group import TPGroup
from numerics import rel

# partial sums are added in another order than the TP1 GEMM reduction
TP_TOL = 1e-5




class ThreadGroup(TPGroup):
    """All ranks in one process; collectives meet at a barrier and sum in rank order (same on every rank)."""

    def __init__(self, shared: dict, rank: int, size: int):
        self.shared, self.rank, self.size = shared, rank, size

    def _exchange(self, x):
        self.shared["buf"][self.rank] = x
        self.shared["barrier"].wait()
        parts = list(self.shared["buf"])
        self.shared["barrier"].wait()           # nobody overwrites buf before everyone has read it
        return parts

    def all_reduce(self, x):
        parts = self._exchange(x)
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out

    def all_gather_last(self, x):
        return torch.cat(self._exchange(x), dim=-1)


def run_ranks(tp: int, body) -> list:
    """body(rank, group) on `tp` threads joined in a ThreadGroup -> each rank's result; a rank's failure is
    raised here (and releases the others from the barrier)."""
    shared = {"buf": [None] * tp, "barrier": threading.Barrier(tp, timeout=60)}
    results, errors = [None] * tp, []

    def rank_main(r):
        try:
            results[r] = body(r, ThreadGroup(shared, r, tp))
        except BaseException as e:           # surface worker failures in the test thread
            errors.append(e)
            shared["barrier"].abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _run(model: Model, ids):
    """Prefill (two chunks), a snapshot verify with commit(2), two decodes, and MTP alignment + a draft."""
    st = model.new_state()
    outs = [model.forward([SeqInput(ids[:13], st)]), model.forward([SeqInput(ids[13:24], st)])]
    ver = model.forward([SeqInput(ids[24:28], st, snapshot=True)])
    st.commit(2)
    outs += [ver, model.forward([SeqInput(ids[26:27], st)]), model.forward([SeqInput(ids[27:28], st)])]
    hidden = torch.cat([o.hidden for o in outs[:2]])
    mtp = model.mtp_forward([MtpInput(ids[1:25], hidden, st.mtp)])
    draft = model.mtp_forward([MtpInput(ids[25:26], mtp.hidden[-1:], st.mtp)])
    return [o.logits for o in outs] + [mtp.logits, draft.logits, mtp.hidden]


@pytest.mark.parametrize("tp", [2, 4], ids=["tp2", "tp4"])
def test_tp_ranks_agree_with_tp1(tmp_path, tp, lm_head_drafts):
    tiny = build_hf_model(seed=11, linear_num_key_heads=4, linear_num_value_heads=8, num_key_value_heads=4,
                          num_attention_heads=8, head_dim=16, intermediate_size=192)
    ids = torch.randint(0, 246, (30,), generator=torch.Generator().manual_seed(4))
    make_tiny_artifact(tmp_path / "tp1", tiny)
    ref = _run(Model(load(tmp_path / "tp1").config, load(tmp_path / "tp1").weights, TorchOps()), ids)
    make_tiny_artifact(tmp_path / "tpn", tiny, tp=tp)

    def rank(r, group):
        lm = load(tmp_path / "tpn", rank=r)
        return _run(Model(lm.config, lm.weights, TorchOps(), group), ids)

    results = run_ranks(tp, rank)
    for r in range(tp):
        for got, want in zip(results[r], ref):
            assert got.shape == want.shape
            assert rel(got, want) <= TP_TOL
