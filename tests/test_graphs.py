"""CUDA-graph runner: static metadata equals the model's own, the runner's eager path (the exact bodies a graph
captures, over the static buffers, padded batches) gives the plain model's tokens and states, fallbacks, and
the synthetic 27B-shaped artifact builder of bench/. GPU capture/replay is tested only with CUDA.

Models come from bench/synth_artifact.py at tiny sizes (random but valid nvfp4 / q6_k / bf16 weights) through
the real loader.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))     # last: bench/ must not shadow anything
import decode_measure as M
import synth_artifact as synth
from ninfer_formats import codecs
from ninfer_formats.container import open_artifact, verify_paths

from ninfer_rt import batch as B
from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.graph_model import RowSpec, StaticMeta
from ninfer_rt.graphs import GraphConfig, GraphError, GraphRunner
from ninfer_rt.loader import load
from ninfer_rt.model import Model, MtpInput, SeqInput
from ninfer_rt.state import CacheConfig
from numerics import rel

LOGIT_TOL = 1e-5          # rel L2, fp32 torch backend: only the padded GEMM row count differs
STATE_TOL = 1e-5
TRITON_TOL = 1e-4         # the Triton kernels (interpreter on CPU) in two runners: padded rows change fp32 sums
BF16_GRAPH_TOL = 2e-2     # bf16 on the GPU: graph replay vs eager launches of the same kernels, split-K tiles
                          # chosen per padded batch size (different summation order), compounding over 40 steps
RMS_FACTOR = 1.5          # synthetic weights: decoded RMS within this factor of 0.5 / sqrt(K)
SMALL = {"hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "head_dim": 16, "gdn_k_heads": 2,
         "gdn_v_heads": 4, "gdn_head_dim": 16, "vocab": 256}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")




pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def nvfp4_path(tmp_path_factory):
    paths, _ = synth.build(str(tmp_path_factory.mktemp("nvfp4")), synth.TINY, "nvfp4", workers=1)
    return paths[0]


def _model(path, ops=None, device="cpu", dtype=torch.float32, max_seqs=5):
    lm = load(path, device=device, dtype=dtype)
    return Model(lm.config, lm.weights, ops or TorchOps(), cache=CacheConfig(num_pages=48, page_size=8,
                                                                             max_seqs=max_seqs),
                 dtype=dtype, consume_weights=True)


# ---- static metadata ----
@pytest.mark.parametrize("lens,starts,pad,page", [((1, 1, 1), (0, 9, 17), 4, 4), ((3, 3), (5, 16), 2, 8),
                                                  ((2,), (7,), 3, 16)], ids=["decode-pad4", "verify", "pad3-p16"])
def test_static_meta_matches_model_metadata(lens, starts, pad, page):
    g = torch.Generator().manual_seed(len(lens))
    t = lens[0]
    pages = [torch.randperm(40, generator=g)[:math.ceil((s + t) / page) + 1].tolist() for s in starts]
    scratch = [41, 42]
    meta = StaticMeta(4, 3, 12, page, scratch, scratch_slot=7, device="cpu")
    ids = [torch.randint(0, 100, (t,), generator=g) for _ in lens]
    snaps = [b * t if t > 1 else -1 for b in range(len(lens))]
    meta.fill([RowSpec(i, s, p, slot, sn) for i, s, p, slot, sn in zip(ids, starts, pages, (3, 1, 2), snaps)],
              pad, t)
    want = B.attn_meta(pages, list(starts), list(lens), page, "cpu")
    n = len(lens) * t
    assert torch.equal(meta.ids[:n], torch.cat(ids))
    assert torch.equal(meta.positions[:n], B.positions(list(starts), list(lens), [None] * len(lens), "cpu"))
    assert torch.equal(meta.slot_mapping[:n], want.slot_mapping)
    assert torch.equal(meta.kv_lens[:len(lens)], want.kv_lens_t)
    for b, p in enumerate(pages):
        used = math.ceil((starts[b] + t) / page)
        assert meta.block_tables[b, :used].tolist() == p[:used]
    assert meta.slots[:len(lens)].tolist() == [3, 1, 2][:len(lens)] and meta.snap[:len(lens)].tolist() == snaps
    assert torch.equal(meta.cu_seqlens(pad, t), torch.arange(0, (pad + 1) * t, t, dtype=torch.int32))
    for b in range(len(lens), pad):            # padding rows: scratch slot and pages, positions 0..t-1
        rows = slice(b * t, (b + 1) * t)
        assert meta.slots[b] == 7 and meta.snap[b] == -1 and meta.kv_lens[b] == t
        assert meta.positions[rows].tolist() == list(range(t))
        assert set((meta.slot_mapping[rows] // page).tolist()) <= set(scratch)


def test_static_meta_pads_a_short_row_at_its_end():
    """A row of 2 ids in a 4-token step: its 2 real tokens go to its pages, the 2 padding tokens' KV to the
    scratch pages; the table walks scratch pages past the row's own; `last` is each row's last real token."""
    page, scratch = 4, [41, 42]
    meta = StaticMeta(3, 4, 6, page, scratch, scratch_slot=7, device="cpu")
    short, full = torch.tensor([5, 6]), torch.tensor([1, 2, 3, 4])
    meta.fill([RowSpec(short, 6, [10, 11]), RowSpec(full, 2, [20, 21])], 3, 4)   # 6 + 2 fits 2 pages; 6 + 4 does not
    assert meta.ids[:8].tolist() == [5, 6, 0, 0, 1, 2, 3, 4]
    assert meta.positions[:4].tolist() == [6, 7, 8, 9]
    assert meta.slot_mapping[:2].tolist() == [11 * page + 2, 11 * page + 3]
    assert meta.slot_mapping[2:4].tolist() == [41 * page + 2, 41 * page + 3]
    assert meta.block_tables[0, :3].tolist() == [10, 11, 41] and meta.kv_lens[:2].tolist() == [10, 6]
    assert meta.last.tolist() == [1, 7, 11]
    with pytest.raises(ValueError, match="row 0 has 5 token ids for a step of 4"):
        meta.fill([RowSpec(torch.zeros(5, dtype=torch.long), 0, [10, 11])], 1, 4)


@pytest.mark.parametrize("rows,batch,tokens,why", [(0, 1, 1, "rows"), (2, 1, 1, "rows"), (1, 5, 1, "batch"),
                                                   (1, 1, 4, "tokens"), (1, 1, 2, "pages")],
                         ids=["empty", "more-rows-than-batch", "batch-too-big", "tokens-too-many", "no-pages"])
def test_static_meta_rejects_bad_fills(rows, batch, tokens, why):
    meta = StaticMeta(4, 3, 2, 4, [9], 0, "cpu")
    start = 7 if why == "pages" else 0            # 7 + 2 positions need 3 pages; the table holds 2
    spec = [RowSpec(torch.zeros(tokens, dtype=torch.long), start, [1, 2, 3]) for _ in range(rows)]
    with pytest.raises(ValueError, match="graphs:"):
        meta.fill(spec, batch, tokens)


@pytest.mark.parametrize("kw", [{"batch_sizes": (2, 1)}, {"tokens": (0,)}, {"tokens": (1, 9)},
                                {"kv_buckets": ()}, {"mtp_tokens": (1, 1)}, {"batch_sizes": (True,)}],
                         ids=["unsorted", "zero", "over-recurrent-max", "empty", "duplicate", "bool"])
def test_graph_config_rejects(kw):
    with pytest.raises(ValueError, match="graphs"):
        GraphConfig(**kw)


def test_capture_needs_cuda_and_a_spare_slot(nvfp4_path):
    m = _model(nvfp4_path, max_seqs=1)
    with pytest.raises(GraphError, match="CUDA"):
        GraphRunner(m, GraphConfig())
    held = m.new_state()
    with pytest.raises(GraphError, match="spare sequence slot"):
        GraphRunner(m, GraphConfig(eager=True))
    held.free()


# ---- the eager path equals the plain model ----
def _step(models, runner, make, tol=LOGIT_TOL):
    a = models[0].forward(make(0))
    b = runner.forward(make(1))
    assert rel(b.logits, a.logits) <= tol
    assert torch.equal(b.logits.argmax(-1), a.logits.argmax(-1))
    assert b.logit_rows == a.logit_rows and b.cu_seqlens == a.cu_seqlens
    return a, b


def test_eager_runner_equals_model(nvfp4_path):
    ref, m = _model(nvfp4_path), _model(nvfp4_path)
    r = GraphRunner(m, GraphConfig(batch_sizes=(1, 2, 4), tokens=(1, 3), mtp_tokens=(1,), kv_buckets=(40, 64),
                                   eager=True))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=g) for n in (13, 30, 5)]
    st = [[x.new_state() for _ in prompts] for x in (ref, m)]
    a, _ = _step([ref], r, lambda k: [SeqInput(p, s, logits="last") for p, s in zip(prompts, st[k])])
    assert r.stats.reasons == {"token count": 1}                   # ragged prefill: the model's own forward
    tok = a.logits.argmax(-1)
    for _ in range(3):                                              # 3 sequences padded to 4
        a, _ = _step([ref], r, lambda k, tok=tok: [SeqInput(tok[i:i + 1], s) for i, s in enumerate(st[k])])
        tok = a.logits.argmax(-1)
    ver = [torch.cat([tok[i:i + 1], torch.randint(0, 1000, (2,), generator=g)]) for i in range(2)]
    a, _ = _step([ref], r, lambda k: [SeqInput(ver[0], st[k][0], snapshot=True),
                                      SeqInput(ver[1], st[k][1], snapshot=True, logits="last")])
    for k in (0, 1):
        st[k][0].commit(2)
        st[k][1].commit(0)
    for sa, sb in zip(*st):
        assert sa.length == sb.length
        assert rel(m.gdn_pool.rec[:, sb.gdn_row], ref.gdn_pool.rec[:, sa.gdn_row]) <= STATE_TOL
        assert rel(m.gdn_pool.conv[:, sb.gdn_row], ref.gdn_pool.conv[:, sa.gdn_row]) <= STATE_TOL
    hid = a.hidden[1:2]
    da = ref.mtp_forward([MtpInput(ver[0][2:3], hid, st[0][0].mtp)])
    db = r.mtp_forward([MtpInput(ver[0][2:3], hid, st[1][0].mtp)])
    assert rel(db.logits, da.logits) <= LOGIT_TOL and rel(db.hidden, da.hidden) <= LOGIT_TOL
    assert st[1][0].mtp.length == st[0][0].mtp.length
    assert r.stats.eager_steps == 5 and r.stats.fallbacks == 1
    _step([ref], r, lambda k: [SeqInput(tok[1:2], st[k][1])])         # 33 + 1 <= 40: the small bucket
    long = torch.randint(0, 1000, (40,), generator=g)
    for k, x in enumerate((ref, m)):
        x.forward([SeqInput(long, st[k][2])])
    _step([ref], r, lambda k: [SeqInput(tok[2:3], st[k][2])])          # 8 + 40 + 1 = 49: the 64 bucket
    for k, x in enumerate((ref, m)):
        x.forward([SeqInput(long[:20], st[k][2])])
    _step([ref], r, lambda k: [SeqInput(tok[2:3], st[k][2])])          # 69 + 1 > 64: past the largest bucket
    assert r.stats.reasons["context past the largest KV bucket"] == 1 and r.stats.eager_steps == 7
    r.close()
    _step([ref], r, lambda k: [SeqInput(tok[1:2], st[k][1])])          # closed: the model's own forward
    assert r.stats.reasons["runner closed"] == 1


@pytest.mark.parametrize("modes", [("last", "last"), ("none", "last"), ("last", "none")],
                         ids=["both-last", "second-only", "first-only"])
def test_eager_mtp_alignment_keeps_last_rows(nvfp4_path, modes):
    """A t > 1 MTP graph (the re-alignment after a round) computes each sequence's last logits row only: the
    rows asked for equal the model's; `all` at t > 1 falls back to the model."""
    ref, m = _model(nvfp4_path), _model(nvfp4_path)
    r = GraphRunner(m, GraphConfig(batch_sizes=(2,), tokens=(1,), mtp_tokens=(1, 3), kv_buckets=(32,), eager=True))
    g = torch.Generator().manual_seed(4)
    ids = [torch.randint(0, 1000, (3,), generator=g) for _ in range(2)]
    hid = [torch.randn(3, m.cfg.hidden_size, generator=g) for _ in range(2)]
    st = [[x.new_state() for _ in range(2)] for x in (ref, m)]
    a = ref.mtp_forward([MtpInput(i, h, s.mtp, logits=md) for i, h, s, md in zip(ids, hid, st[0], modes)])
    b = r.mtp_forward([MtpInput(i, h, s.mtp, logits=md) for i, h, s, md in zip(ids, hid, st[1], modes)])
    assert r.stats.eager_steps == 1 and b.logit_rows == a.logit_rows and b.cu_seqlens == a.cu_seqlens
    assert b.logits.shape == a.logits.shape and rel(b.logits, a.logits) <= LOGIT_TOL
    assert rel(b.hidden, a.hidden) <= LOGIT_TOL
    r.mtp_forward([MtpInput(ids[0], hid[0], st[1][0].mtp, logits="all")])
    assert r.stats.reasons == {"position override / embeddings / logits mode": 1}
    r.close()


@pytest.mark.parametrize("lens,modes", [((3, 1, 2), ("last", "last", "last")), ((2, 3), ("none", "last")),
                                        ((1, 2), ("last", "last"))],
                         ids=["3-1-2-padded-batch", "none-last", "all-short"])
def test_eager_mtp_ragged_alignment_is_padded(nvfp4_path, lens, modes):
    """Sequences that emitted different counts share one MTP graph, each padded at its end to the graph's T: the
    rows asked for, the hidden rows and the lengths equal the model's. Two such steps and then a draft step over
    the cache they wrote still equal the model's: the real tokens' KV went where it belongs."""
    ref, m = _model(nvfp4_path), _model(nvfp4_path)
    r = GraphRunner(m, GraphConfig(batch_sizes=(4,), tokens=(1,), mtp_tokens=(1, 3), kv_buckets=(32,), eager=True))
    g = torch.Generator().manual_seed(6)
    st = [[x.new_state() for _ in lens] for x in (ref, m)]
    for step in (lens, lens[::-1], (1,) * len(lens)):
        ids = [torch.randint(0, 1000, (n,), generator=g) for n in step]
        hid = [torch.randn(n, m.cfg.hidden_size, generator=g) for n in step]
        md = modes if step != (1,) * len(lens) else ("all",) * len(lens)
        a, b = (x.mtp_forward([MtpInput(i, h, s.mtp, logits=d) for i, h, s, d in zip(ids, hid, st[k], md)])
                for k, x in enumerate((ref, r)))
        assert b.logit_rows == a.logit_rows and b.cu_seqlens == a.cu_seqlens
        assert b.logits.shape == a.logits.shape and rel(b.logits, a.logits) <= LOGIT_TOL
        assert b.hidden.shape == a.hidden.shape and rel(b.hidden, a.hidden) <= LOGIT_TOL
        assert [s.mtp.length for s in st[1]] == [s.mtp.length for s in st[0]]
    assert r.stats.fallbacks == 0 and r.stats.eager_steps == 3
    assert r.stats.padded_tokens == 2 * sum(3 - n for n in lens)
    r.mtp_forward([MtpInput(torch.tensor([1]), torch.zeros(1, m.cfg.hidden_size), st[1][0].mtp, logits="all"),
                   MtpInput(torch.tensor([1, 2]), torch.zeros(2, m.cfg.hidden_size), st[1][1].mtp)])
    assert r.stats.reasons == {"position override / embeddings / logits mode": 1}   # "all" rows at t = 3
    r.close()


@pytest.mark.parametrize("rows,t,view", [([0, 1, 2], 1, True), ([2, 5, 8], 3, True), ([1, 5], 3, False),
                                         ([], 2, True)], ids=["prefix", "every-last", "general", "none"])
def test_pick_rows(rows, t, view):
    from ninfer_rt.graphs import _pick_rows
    logits = torch.arange(9 * 5, dtype=torch.float32).view(9, 5)
    got, is_view = _pick_rows(logits, rows, t)
    assert is_view == view and torch.equal(got, logits[rows])


def test_snapshot_buffers_in_use_fall_back(nvfp4_path):
    ref, m = _model(nvfp4_path), _model(nvfp4_path)
    r = GraphRunner(m, GraphConfig(batch_sizes=(1,), tokens=(1, 2), mtp_tokens=(), kv_buckets=(32,), eager=True))
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 1000, (n,), generator=g) for n in (2, 2, 6)]
    st = [[x.new_state() for _ in range(2)] for x in (ref, m)]
    for k, x in enumerate((ref, m)):
        for s in st[k]:
            x.forward([SeqInput(ids[2], s)])
    outs = [[ref.forward([SeqInput(ids[i], st[0][i], snapshot=True)]) for i in (0, 1)],
            [r.forward([SeqInput(ids[i], st[1][i], snapshot=True)]) for i in (0, 1)]]   # A pending -> B eager
    assert r.stats.reasons == {"snapshot buffers in use": 1}
    for i in (0, 1):
        assert rel(outs[1][i].logits, outs[0][i].logits) <= LOGIT_TOL
        st[0][i].commit(i + 1)
        st[1][i].commit(i + 1)
        assert rel(m.gdn_pool.rec[:, st[1][i].gdn_row], ref.gdn_pool.rec[:, st[0][i].gdn_row]) <= STATE_TOL
    r.forward([SeqInput(ids[0], st[1][0], snapshot=True)])
    assert r.stats.eager_steps == 2                                   # committed: the buffers are free again
    r.close()


def test_eager_runner_equals_model_triton(tmp_path):
    """The Triton backend (the interpreter on CPU) reads only device metadata: same tokens as the model."""
    from ninfer_rt.backends.triton_ops import TritonOps
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    paths, _ = synth.build(str(tmp_path), dataclasses.replace(synth.TINY, **SMALL), "bf16", workers=1)
    ref, m = (_model(paths[0], TritonOps(), dev) for _ in range(2))
    r = GraphRunner(m, GraphConfig(batch_sizes=(2,), tokens=(1, 2), mtp_tokens=(1,), kv_buckets=(32,), eager=True))
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 250, (4,), generator=g).to(dev)
    st = [[x.new_state()] for x in (ref, m)]
    for k, x in enumerate((ref, m)):
        x.forward([SeqInput(prompt, st[k][0])])
    tok = prompt[-1:]
    for _ in range(2):
        a, _ = _step([ref], r, lambda k, tok=tok: [SeqInput(tok, st[k][0])], tol=TRITON_TOL)
        tok = a.logits.argmax(-1)
    ver = torch.cat([tok, tok])
    a, _ = _step([ref], r, lambda k: [SeqInput(ver, st[k][0], snapshot=True)], tol=TRITON_TOL)
    for k in (0, 1):
        st[k][0].commit(1)
    da = ref.mtp_forward([MtpInput(tok, a.hidden[:1], st[0][0].mtp)])
    db = r.mtp_forward([MtpInput(tok, a.hidden[:1], st[1][0].mtp)])
    assert rel(db.logits, da.logits) <= TRITON_TOL
    assert r.stats.eager_steps == 4


def _ragged_mtp_steps(ref, r, dev, tol):
    """Two ragged MTP steps (padded to the runner's 3-token graph) and a draft step over the cache they wrote:
    the runner's rows equal the model's own (unpadded) forward. -> the runner's stats."""
    g = torch.Generator().manual_seed(7)
    st = [[x.new_state() for _ in range(3)] for x in (ref, r.model)]
    h = r.model.cfg.hidden_size
    for lens in ((3, 1, 2), (2, 3, 1), (1, 1, 1)):
        ids = [torch.randint(0, 250, (n,), generator=g).to(dev) for n in lens]
        hid = [torch.randn(n, h, generator=g).to(dev, r.model.dtype) for n in lens]
        mode = "all" if lens == (1, 1, 1) else "last"
        a, b = (x.mtp_forward([MtpInput(i, y, s.mtp, logits=mode) for i, y, s in zip(ids, hid, st[k])])
                for k, x in enumerate((ref, r)))
        assert b.cu_seqlens == a.cu_seqlens and rel(b.logits, a.logits) <= tol and rel(b.hidden, a.hidden) <= tol
    assert r.stats.fallbacks == 0
    return r.stats


def test_eager_ragged_mtp_equals_model_triton(tmp_path):
    """The Triton attention (the interpreter on CPU) over rows padded at their end: the padding's keys sit after
    every real query (qpos = L - T + t), so the real rows equal the model's unpadded forward."""
    from ninfer_rt.backends.triton_ops import TritonOps
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    paths, _ = synth.build(str(tmp_path), dataclasses.replace(synth.TINY, **SMALL), "bf16", workers=1)
    ref, m = (_model(paths[0], TritonOps(), dev) for _ in range(2))
    r = GraphRunner(m, GraphConfig(batch_sizes=(4,), tokens=(1,), mtp_tokens=(1, 3), kv_buckets=(32,), eager=True))
    st = _ragged_mtp_steps(ref, r, dev, TRITON_TOL)
    assert st.eager_steps == 3 and st.padded_tokens == 3 + 3


@gpu
def test_captured_ragged_mtp_equals_model_gpu(nvfp4_path, monkeypatch):
    """The same over captured graphs (bf16 Triton kernels), against the model's own eager forward."""
    from ninfer_rt.backends.triton_ops import TritonOps
    monkeypatch.setenv("NINFER_GEMV_TUNE", "0")
    ref, m = (_model(nvfp4_path, TritonOps(), "cuda", torch.bfloat16) for _ in range(2))
    r = GraphRunner(m, GraphConfig(batch_sizes=(4,), tokens=(1,), mtp_tokens=(1, 3), kv_buckets=(32,)))
    assert r.capture() > 0
    st = _ragged_mtp_steps(ref, r, "cuda", BF16_GRAPH_TOL)
    assert st.replays == 3 and st.padded_tokens == 3 + 3


@gpu
@pytest.mark.parametrize("pdl", ["0", "1", "1-mma0"], ids=["plain", "pdl", "pdl-mma-plain"])
def test_graph_replay_equals_eager_gpu(nvfp4_path, pdl, monkeypatch):
    """Captured graphs replayed with fresh metadata give the eager runner's tokens (bf16, Triton kernels); also
    with every kernel of the graphed model launched programmatically dependent (NINFER_PDL=1: sm_90+,
    ninfer_kernels.pdl) against plain eager launches, where a kernel that read or wrote before its wait would
    race its predecessor. The captured steps hold the GDN gates and the q/k conv-window updates as side-stream
    branches (NINFER_BRANCH default), the eager ones run them in line."""
    from ninfer_rt.backends.triton_ops import TritonOps
    # the shipped ranking's tile per T bucket instead of timing every candidate: one compile per GEMV key (a cold
    # machine ran past 200 s tuning), and T = 3 takes the warp-MMA tile, which the mma0 case is about
    monkeypatch.setenv("NINFER_GEMV_TUNE", "0")
    if pdl.endswith("mma0"):             # NINFER_PDL_MMA=0: the warp-MMA GEMVs triggering but launched plainly
        monkeypatch.setenv("NINFER_PDL_MMA", "0")
        pdl = pdl[0]
    models = [_model(nvfp4_path, TritonOps(), "cuda", torch.bfloat16) for _ in range(2)]
    cfg = {"batch_sizes": (1, 2), "tokens": (1, 3), "mtp_tokens": (1,), "kv_buckets": (32, 64)}
    runners = [GraphRunner(models[0], GraphConfig(**cfg, eager=True)), GraphRunner(models[1], GraphConfig(**cfg))]

    def both(call):                      # the reference launches plainly, the graphed side in the mode under test
        out = []
        for k, mode in enumerate(("0", pdl)):
            monkeypatch.setenv("NINFER_PDL", mode)
            out.append(call(k))
        return out
    monkeypatch.setenv("NINFER_PDL", pdl)
    assert runners[1].capture() > 0 and runners[1].stats.captured == 2 * 2 * 2 + 2 * 2
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1000, (n,), generator=g).cuda() for n in (9, 20)]
    st = [[x.new_state() for _ in prompts] for x in models]
    both(lambda k: models[k].forward([SeqInput(p, s) for p, s in zip(prompts, st[k])]))
    tok = torch.stack([p[-1] for p in prompts])
    for i in range(40):                  # crosses the 32 bucket; batch 1 <-> 2 re-uses padded graphs
        sel = [0, 1] if i % 3 else [1]
        outs = both(lambda k: runners[k].forward([SeqInput(tok[j:j + 1], st[k][j], snapshot=False) for j in sel]))
        assert rel(outs[1].logits, outs[0].logits) <= BF16_GRAPH_TOL
        nxt = outs[0].logits.argmax(-1)
        for j, t in zip(sel, nxt):
            tok[j] = t
    ver = torch.cat([tok[1:2], tok[:1], tok[1:2]])
    outs = both(lambda k: runners[k].forward([SeqInput(ver, st[k][1], snapshot=True)]))
    assert rel(outs[1].logits, outs[0].logits) <= BF16_GRAPH_TOL
    for k in (0, 1):
        st[k][1].commit(2)
    assert rel(models[1].gdn_pool.rec[:, st[1][1].gdn_row], models[0].gdn_pool.rec[:, st[0][1].gdn_row]) <= BF16_GRAPH_TOL
    d = both(lambda k: runners[k].mtp_forward([MtpInput(tok[:1], outs[0].hidden[1:2], st[k][1].mtp)]))
    assert rel(d[1].logits, d[0].logits) <= BF16_GRAPH_TOL
    assert runners[1].stats.replays == 42 and runners[1].stats.fallbacks == 0


# ---- the benchmark's pieces ----
@pytest.mark.parametrize("recipe", ["nvfp4", "iq3_s"])
def test_synth_artifact_is_valid(tmp_path, recipe):
    paths, info = synth.build(str(tmp_path), synth.TINY, recipe, workers=2)
    assert not info["reused"] and verify_paths(paths) == []
    again, info2 = synth.build(str(tmp_path), synth.TINY, recipe)
    assert again == paths and info2["reused"]
    with open_artifact(paths[0], verify=True) as a:
        fmts = {n: e.fmt for n, e in a.tensors.items()}
        assert fmts["layers.0.mlp.down_proj.weight"] == recipe and fmts["lm_head.weight"] == "q6_k"
        assert fmts["layers.0.linear_attn.A_log"] == "f32" and fmts["embed_tokens.weight"] == "bf16"
        for name, e in a.tensors.items():
            w = codecs.decode(e.fmt, np.asarray(a.raw(name)), e.shape)
            assert np.isfinite(w).all(), name
            if len(e.shape) == 2 and not name.endswith("conv1d.weight"):
                want = 0.02 if name == "embed_tokens.weight" else 0.5 / math.sqrt(e.shape[1])
                got = float(np.sqrt(np.mean(w.astype(np.float64) ** 2)))
                assert want / RMS_FACTOR <= got <= want * RMS_FACTOR, (name, got, want)


def test_synth_tp2_ranks_load(tmp_path):
    shape = dataclasses.replace(synth.TINY, layers=2, full_every=2)
    paths, _ = synth.build(str(tmp_path), shape, "q6_k", tp=2, workers=2)
    assert len(paths) == 2 and verify_paths(paths) == []
    for r in (0, 1):
        lm = load(paths[r], rank=r, tp_size=2)
        assert tuple(lm.weights["layers.1.self_attn.o_proj.weight"].shape) == (256, 256)
        assert tuple(lm.weights["lm_head.weight"].shape) == (512, 256)


def test_bytes_accounting(nvfp4_path):
    m = _model(nvfp4_path)
    wb = M.weight_bytes(m)

    def loaded_bytes(e):            # what the (fp32) model holds: plain tensors as fp32, nvfp4 without header
        if e.fmt in ("bf16", "f16", "f32"):
            return math.prod(e.shape) * 4
        return e.length - (16 if e.fmt == "nvfp4" else 0)
    with open_artifact(nvfp4_path) as a:
        t = a.tensors
    assert wb["target"] == sum(loaded_bytes(e) for n, e in t.items()
                               if n != "embed_tokens.weight" and not n.startswith("mtp."))
    assert wb["mtp"] == sum(loaded_bytes(e) for n, e in t.items() if n.startswith("mtp."))
    assert M.layer_params(m) == sum(e.shape[0] * e.shape[1] for n, e in t.items()
                                    if n.startswith("layers.") and "_proj" in n)
    st = m.new_state()
    M.fill_context(m, st, 50)
    assert st.length == 50 and st.mtp.length == 50 and len(st.pages) == math.ceil(51 / 8)
    kv_tok = 2 * 2 * 64 * 4                     # K and V, 2 heads x 64, fp32, one attention layer
    per_slot = (8 * 64 * 64 + 3 * (2 * 128 + 512)) * 4
    assert M.state_bytes(m, 50) == kv_tok * 51 + 3 * per_slot * 2
    tokens, tok_s = M.spec_tok_s(4.0, 1.0, 3, 0.5)
    assert tokens == pytest.approx(1.875) and tok_s == pytest.approx(1.875 / 7e-3)
