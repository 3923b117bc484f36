"""The graph runner's commit without a copy: a verify's GDN snapshots are rows of the pool itself, `commit` points
the sequence at its row (`SeqState.gdn_row`), and a state is moved home only when a later step would overwrite
its row. Every step is checked against the plain model (whose commit copies) on the same inputs."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))     # last: bench/ must not shadow anything
import synth_artifact as synth

from ninfer_rt.graphs import GraphConfig, GraphError, GraphRunner
from ninfer_rt.model import SeqInput
from ninfer_rt.state import GdnPool
from numerics import rel
from test_graphs import BF16_GRAPH_TOL, LOGIT_TOL, STATE_TOL, _model, gpu

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def nvfp4_path(tmp_path_factory):
    paths, _ = synth.build(str(tmp_path_factory.mktemp("nvfp4")), synth.TINY, "nvfp4", workers=1)
    return paths[0]


@pytest.fixture
def pair(nvfp4_path):
    return _model(nvfp4_path), _model(nvfp4_path)


def _states_match(ref, m, sa, sb, tol=STATE_TOL):
    assert sa.length == sb.length
    assert rel(m.gdn_pool.rec[:, sb.gdn_row], ref.gdn_pool.rec[:, sa.gdn_row]) <= tol
    assert rel(m.gdn_pool.conv[:, sb.gdn_row], ref.gdn_pool.conv[:, sa.gdn_row]) <= tol


class _Twin:
    """The plain model and a runner over a second copy, fed the same steps."""

    def __init__(self, ref, m, runner, n_seqs: int, gen, tols=(LOGIT_TOL, STATE_TOL)):
        self.ref, self.m, self.r, self.g, self.tols = ref, m, runner, gen, tols
        self.st = [[x.new_state() for _ in range(n_seqs)] for x in (ref, m)]
        for i in range(n_seqs):
            p = torch.randint(0, 1000, (5 + 3 * i,), generator=gen).to(m.device)
            for k, x in enumerate((ref, m)):
                x.forward([SeqInput(p, self.st[k][i])])

    def step(self, order, tokens: int, snapshot: bool, commit=None):
        ids = [torch.randint(0, 1000, (tokens,), generator=self.g).to(self.m.device) for _ in order]
        outs = [fwd([SeqInput(t, self.st[k][i], snapshot=snapshot) for t, i in zip(ids, order)])
                for k, fwd in enumerate((self.ref.forward, self.r.forward))]
        assert rel(outs[1].logits, outs[0].logits) <= self.tols[0]
        for i, n in zip(order, commit or ()):
            for k in (0, 1):
                self.st[k][i].commit(n)
        for i in order:
            _states_match(self.ref, self.m, self.st[0][i], self.st[1][i], self.tols[1])

    def rows(self):
        return [s.gdn_row for s in self.st[1]]


def _verify_rounds(tw, base):
    """Verifies at the same places, swapped places, another sequence over a lazy one's row, a decode step."""
    a, b, c = tw.st[1]
    home = tw.m.gdn_pool.rec[:, a.slot].clone()
    tw.step([0, 1], 3, True, commit=[2, 3])
    assert tw.rows()[:2] == [base + 1, base + 5] and torch.equal(tw.m.gdn_pool.rec[:, a.slot], home)  # no copy
    tw.step([0, 1], 3, True, commit=[3, 1])            # same places: each reads its own row, still no copy
    assert tw.rows()[:2] == [base + 2, base + 3]
    tw.step([1, 0], 3, True, commit=[1, 2])            # swapped: each row lies in the other's span -> home first
    assert tw.rows()[:2] == [base + 4, base + 0]
    tw.step([2], 3, True, commit=[3])                  # C writes span 0: B (row base) goes home, A stays
    assert tw.rows() == [base + 4, b.slot, base + 2]
    tw.step([0], 1, False)                             # a plain decode step reads and writes A's row in place
    assert tw.rows()[0] == base + 4


def test_commit_points_at_the_row_and_moves_home_only_when_overwritten(pair):
    ref, m = pair
    r = GraphRunner(m, GraphConfig(batch_sizes=(1, 2), tokens=(1, 3), mtp_tokens=(), kv_buckets=(64,), eager=True))
    tw = _Twin(ref, m, r, 3, torch.Generator().manual_seed(4))
    _verify_rounds(tw, r.snap_base)
    a, b, c = tw.st[1]
    ids = [torch.randint(0, 1000, (n,), generator=tw.g) for n in (2, 1)]
    outs = [x.forward([SeqInput(ids[0], tw.st[k][0]), SeqInput(ids[1], tw.st[k][2])])
            for k, x in enumerate((ref, r))]           # ragged: the model's own forward, which moves both home
    assert r.stats.reasons == {"token count": 1} and rel(outs[1].logits, outs[0].logits) <= LOGIT_TOL
    assert tw.rows() == [a.slot, b.slot, c.slot]
    for i in range(3):
        _states_match(ref, m, tw.st[0][i], tw.st[1][i])
    r.close()


def test_freed_state_in_a_row_is_forgotten(pair):
    ref, m = pair
    r = GraphRunner(m, GraphConfig(batch_sizes=(1,), tokens=(1, 2), mtp_tokens=(), kv_buckets=(64,), eager=True))
    tw = _Twin(ref, m, r, 2, torch.Generator().manual_seed(5))
    tw.step([0], 2, True, commit=[2])
    a = tw.st[1][0]
    assert a.gdn_row == r.snap_base + 1
    a.free()
    tw.step([1], 2, True, commit=[1])                  # writes A's old row: A is freed, nothing to move
    assert list(r._lazy) == [tw.st[1][1]] and tw.st[1][1].gdn_row == r.snap_base
    tw.st[0][0].free()
    r.close()


def test_pool_rows_are_appended_and_refused_while_pinned():
    pool = GdnPool(3, 2, 3, 8, 2, 4, 4, "cpu")
    pool.rec[:, 1] = 1.5
    assert pool.add_rows(4) == 3 and pool.rec.shape[1] == 7 and pool.conv.shape[1] == 7
    assert torch.all(pool.rec[:, 1] == 1.5) and torch.all(pool.rec[:, 3:] == 0) and pool.free_slots() == 3
    pool.pins = 1
    with pytest.raises(RuntimeError, match="before capturing"):
        pool.add_rows(1)


@gpu
def test_commit_without_copy_in_captured_graphs_gpu(nvfp4_path):
    """The same rounds replayed from captured graphs (Triton kernels, bf16) against the eager model: a state read
    from a row the same step overwrites (its own verify span) is read before it is written."""
    from ninfer_rt.backends.triton_ops import TritonOps
    ref, m = (_model(nvfp4_path, TritonOps(), "cuda", torch.bfloat16) for _ in range(2))
    r = GraphRunner(m, GraphConfig(batch_sizes=(1, 2), tokens=(1, 3), mtp_tokens=(), kv_buckets=(64,)))
    r.capture()
    tw = _Twin(ref, m, r, 3, torch.Generator().manual_seed(6), (BF16_GRAPH_TOL, BF16_GRAPH_TOL))
    _verify_rounds(tw, r.snap_base)
    assert r.stats.replays == 5 and r.stats.fallbacks == 0
    with pytest.raises(GraphError, match="before capturing"):
        GraphRunner(m, GraphConfig(batch_sizes=(1,), tokens=(1, 2), mtp_tokens=(), kv_buckets=(64,)))
    r.close()


def test_runner_refused_once_graphs_point_at_the_pool(pair):
    _, m = pair
    free = m.gdn_pool.free_slots()
    m.gdn_pool.pins = 1                                # as after another runner's capture
    with pytest.raises(GraphError, match="graphs: gdn pool: .*before capturing"):
        GraphRunner(m, GraphConfig(batch_sizes=(1,), tokens=(1, 2), mtp_tokens=(), kv_buckets=(64,), eager=True))
    assert m.gdn_pool.free_slots() == free             # the padding slot went back
