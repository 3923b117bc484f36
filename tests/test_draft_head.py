"""The MTP draft head (`ninfer_rt.draft_head`, NINFER_DRAFT_HEAD): the device-side NVFP4 quantizer equals the numpy
codec byte for byte; the model's draft logits come from the NVFP4 copy (-inf past a shortlist) while the target's
logits do not change; the CUDA-graph step bodies use the same head; greedy MTP stays lossless; TP ranks keep their
own vocab slice's rows; bad values are one-line errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_tiny import build_hf_model, loaded_model, make_tiny_artifact
from numerics import rel
from test_model_tp import run_ranks

from ninfer_formats import codecs
from ninfer_formats.errors import LoadError
from ninfer_rt import draft_head
from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.engine import Engine
from ninfer_rt.graphs import GraphConfig, GraphRunner
from ninfer_rt.loader import load
from ninfer_rt.model import Model, MtpInput, SeqInput
from ninfer_rt.sampling import SamplingParams
from ninfer_rt.speculative import SpecConfig
from ninfer_rt.state import CacheConfig
from ninfer_rt.weights import QWeight, dequantize

VOCAB = 256                       # hf_tiny's vocabulary
DRAFT_TOL = 0.15                  # rel L2 of NVFP4 draft logits vs the fp32 lm_head's (4-bit weights)
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    return build_hf_model(seed=7)


def _weights(case: str, rows: int, k: int) -> np.ndarray:
    g = np.random.default_rng(abs(hash(case)) % 2**32)
    w = g.standard_normal((rows, k)).astype(np.float32)
    if case == "zero-blocks":
        w[::3, :16] = 0.0
        w[1] = 0.0
    elif case == "wide-range":             # block scales from E4M3 subnormals to the top of the range
        w *= np.float32(2.0) ** g.integers(-20, 4, size=(rows, k // 16)).repeat(16, axis=1).astype(np.float32)
    elif case == "ties":                   # values on E2M1 rounding boundaries once scaled
        w = np.tile(np.array([6, -6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -2.5, 0, -0.0, 4, 3],
                             dtype=np.float32), (rows, k // 16))
    return w


@pytest.mark.parametrize("case", ["normal", "zero-blocks", "wide-range", "ties"])
@pytest.mark.parametrize("rows,k", [(7, 48), (33, 160)], ids=["7x48", "33x160"])
def test_quantize_equals_the_codec(case, rows, k):
    w = _weights(case, rows, k)
    want_codes, want_scales, want_s2 = codecs.nvfp4.quantize(w)
    s2 = draft_head.nvfp4_scale(torch.from_numpy(w))
    assert np.float32(s2) == want_s2
    codes, scales = draft_head.nvfp4_quantize(torch.from_numpy(w), s2)
    assert codes.dtype == scales.dtype == torch.uint8
    assert np.array_equal(scales.numpy(), want_scales)
    assert np.array_equal(codes.numpy(), want_codes)


def test_all_zero_weight_gets_scale_one():
    assert draft_head.nvfp4_scale(torch.zeros(4, 32)) == 1.0


@pytest.mark.parametrize("text,want", [("lm_head", draft_head.DraftHeadSpec()),
                                       ("auto", draft_head.DraftHeadSpec("auto")),
                                       ("nvfp4", draft_head.DraftHeadSpec("nvfp4")),
                                       (" nvfp4:131072 ", draft_head.DraftHeadSpec("nvfp4", 131072))])
def test_parse(text, want):
    assert draft_head.DraftHeadSpec.parse(text) == want


@pytest.mark.parametrize("text", ["", "q6_k", "nvfp4:", "nvfp4:0", "nvfp4:-3", "nvfp4:1e5", "lm_head:4", "nvfp4;9",
                                  "auto:8"])
def test_parse_rejects(text):
    with pytest.raises(LoadError, match=r"NINFER_DRAFT_HEAD=.*expected auto, lm_head, nvfp4 or nvfp4:N") as e:
        draft_head.DraftHeadSpec.parse(text)
    assert "\n" not in str(e.value)


def test_bad_env_fails_model_build(tiny, monkeypatch):
    monkeypatch.setenv(draft_head.ENV, "fp8")
    with pytest.raises(LoadError, match="NINFER_DRAFT_HEAD='fp8'"):
        _model(tiny)


@pytest.mark.parametrize("limit,lo,rows,want", [(None, 128, 128, 128), (100, 0, 128, 100), (100, 128, 128, 0),
                                                (200, 128, 128, 72), (999, 128, 128, 128)])
def test_local_rows(limit, lo, rows, want):
    assert draft_head.local_rows(draft_head.DraftHeadSpec("nvfp4", limit), lo, rows) == want


def _model(tiny, tp=None, weights=None):
    lm = loaded_model(tiny)
    return Model(lm.config, weights or lm.weights, TorchOps(), tp,
                 cache=CacheConfig(num_pages=32, page_size=8, max_seqs=3))


def _draft(model, ids):
    """Target prefill over ids, then the MTP alignment pass over it: (target logits, draft logits)."""
    st = model.new_state()
    out = model.forward([SeqInput(ids[:-1], st)])
    d = model.mtp_forward([MtpInput(ids[1:], out.hidden, st.mtp)])
    st.free()
    return out.logits, d.logits


@pytest.mark.parametrize("spec", ["nvfp4", "nvfp4:100"])
def test_model_draft_logits_from_the_nvfp4_copy(tiny, monkeypatch, spec):
    ids = torch.randint(0, 246, (17,), generator=torch.Generator().manual_seed(1))
    monkeypatch.setenv(draft_head.ENV, "lm_head")
    ref_target, ref_draft = _draft(_model(tiny), ids)
    monkeypatch.setenv(draft_head.ENV, spec)
    m = _model(tiny)
    keep = draft_head.local_rows(m.draft_spec, 0, VOCAB)
    dense = dequantize(m.lm_head)[:keep].numpy()
    assert m.draft_head.fmt == "nvfp4" and m.draft_head.shape == (keep, dense.shape[1])
    want = codecs.nvfp4.dequantize(*codecs.nvfp4.quantize(dense))
    assert np.array_equal(dequantize(m.draft_head).numpy(), want)        # the codec's bytes, so its values
    target, draft = _draft(m, ids)
    assert torch.equal(target, ref_target)                                # the verify side is untouched
    assert draft.shape == ref_draft.shape
    assert torch.isneginf(draft[:, keep:]).all() and torch.isfinite(draft[:, :keep]).all()
    assert 0 < rel(draft[:, :keep], ref_draft[:, :keep]) <= DRAFT_TOL


def test_lm_head_builds_nothing(tiny, monkeypatch):
    monkeypatch.setenv(draft_head.ENV, "lm_head")
    m = _model(tiny)
    assert m.draft_spec.kind == "lm_head" and m.draft_head is None


def test_default_is_auto_which_picks_nvfp4_where_the_lm_head_splits(tiny, monkeypatch):
    monkeypatch.delenv(draft_head.ENV, raising=False)
    m = _model(tiny)
    assert draft_head.spec_from_env() == draft_head.DraftHeadSpec("auto")
    assert str(m.draft_spec) == "nvfp4" and m.draft_head.fmt == "nvfp4"
    odd = QWeight("bf16", (VOCAB, 24), {"w": torch.zeros(VOCAB, 24)}, "lm_head")     # K = 24: no NVFP4 blocks
    assert draft_head.resolve(draft_head.DraftHeadSpec("auto"), odd) == draft_head.DraftHeadSpec()
    limited = draft_head.DraftHeadSpec("nvfp4", 100)
    assert draft_head.resolve(limited, odd) is limited and str(limited) == "nvfp4:100"


def test_graph_step_bodies_use_the_draft_head(tiny, monkeypatch):
    monkeypatch.setenv(draft_head.ENV, "nvfp4:150")
    ref, m = _model(tiny), _model(tiny)
    r = GraphRunner(m, GraphConfig(batch_sizes=(1,), tokens=(1,), mtp_tokens=(1,), kv_buckets=(32,), eager=True))
    ids = torch.randint(0, 246, (9,), generator=torch.Generator().manual_seed(2))
    st = [ref.new_state(), m.new_state()]
    outs = [x.forward([SeqInput(ids, s)]) for x, s in zip((ref, m), st)]
    a = ref.mtp_forward([MtpInput(ids[1:2], outs[0].hidden[:1], st[0].mtp)])
    b = r.mtp_forward([MtpInput(ids[1:2], outs[1].hidden[:1], st[1].mtp)])
    assert r.stats.eager_steps == 1
    assert torch.isneginf(b.logits[:, 150:]).all()
    assert rel(b.logits[:, :150], a.logits[:, :150]) <= 1e-5


@pytest.mark.parametrize("spec", ["nvfp4", "nvfp4:120"])
def test_greedy_mtp_stays_lossless(tiny, monkeypatch, spec):
    lm = loaded_model(tiny)
    prompts = [torch.randint(0, 246, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (6, 15)]

    def run(k):
        eng = Engine(lm, TorchOps(), spec=SpecConfig(num_draft_tokens=k) if k else None)
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, GREEDY)
        out = {str(i): [] for i in range(len(prompts))}
        while eng.has_work():
            for o in eng.step():
                out[o.req_id] += o.new_token_ids
        return out, eng.stats.spec

    ref, _ = run(0)
    monkeypatch.setenv(draft_head.ENV, spec)
    out, stats = run(3)
    assert out == ref
    assert stats.rounds > 0 and stats.drafted > 0


@pytest.mark.parametrize("limit", [None, 100, 200], ids=["full", "rank0-only", "both-ranks"])
def test_tp2_ranks_keep_their_vocab_slice(tiny, monkeypatch, tmp_path, limit):
    ids = torch.randint(0, 246, (11,), generator=torch.Generator().manual_seed(3))
    _, exact = _draft(_model(tiny), ids)                                   # the lm_head's draft logits
    monkeypatch.setenv(draft_head.ENV, "nvfp4" if limit is None else f"nvfp4:{limit}")
    _, tp1 = _draft(_model(tiny), ids)
    make_tiny_artifact(tmp_path, tiny, tp=2)

    def rank(r, group):
        lm = load(tmp_path, rank=r)
        m = Model(lm.config, lm.weights, TorchOps(), group, cache=CacheConfig(num_pages=32, page_size=8, max_seqs=3))
        keep = draft_head.local_rows(m.draft_spec, r * VOCAB // 2, VOCAB // 2)
        assert (m.draft_head is None) == (keep == 0)
        return _draft(m, ids)[1]

    results = run_ranks(2, rank)
    cut = VOCAB if limit is None else limit
    for got in results:
        assert torch.isneginf(got[:, cut:]).all() and torch.isfinite(got[:, :cut]).all()
        assert rel(got[:, :cut], exact[:, :cut]) <= DRAFT_TOL
        if limit == 100:       # rank 0 holds all kept rows: the same global scale and bytes as TP1
            assert rel(got[:, :cut], tp1[:, :cut]) <= 1e-5


def test_triton_backend_draft_logits_equal_torch(tiny, monkeypatch):
    """The NVFP4 draft head through TritonOps' GEMV (the interpreter on CPU) gives the torch backend's logits."""
    from ninfer_rt.backends.triton_ops import TritonOps
    monkeypatch.setenv(draft_head.ENV, "nvfp4:100")
    lm = loaded_model(tiny)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    models = [Model(lm.config, {n: t.to(dev) for n, t in lm.weights.items()}, ops,
                    cache=CacheConfig(num_pages=32, page_size=8, max_seqs=3)) for ops in (TorchOps(), TritonOps())]
    ids = torch.randint(0, 246, (9,), generator=torch.Generator().manual_seed(4)).to(dev)
    (_, a), (_, b) = (_draft(m, ids) for m in models)
    assert torch.isneginf(b[:, 100:]).all()
    assert rel(b[:, :100], a[:, :100]) <= 1e-4


def test_tiny_mtp_bench_rejects_a_bad_draft_head(capsys):
    import sys
    from pathlib import Path
    sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))   # last: bench/ must not shadow anything
    import tiny_mtp
    assert tiny_mtp.parse_args(["--draft-heads", "lm_head,nvfp4:64"]).draft_heads == ["lm_head", "nvfp4:64"]
    with pytest.raises(SystemExit) as e:
        tiny_mtp.parse_args(["--draft-heads", "lm_head,q4"])
    assert e.value.code == 2 and "NINFER_DRAFT_HEAD='q4'" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["q6_k", "nvfp4", "bf16"])
def test_cuda_build_equals_cpu_build(fmt):
    """On CUDA the lm_head is dequantized by the Triton kernels and quantized by torch on the GPU: the same
    bytes as the CPU build (numpy codecs), at a 27B-like K and more rows than one slab."""
    from ninfer_rt.weights import from_encoded
    w = np.random.default_rng(5).standard_normal((draft_head.SLAB_ROWS + 77, 512)).astype(np.float32)
    raw = codecs.encode(fmt, w)
    heads = [draft_head.build(draft_head.DraftHeadSpec("nvfp4", 9000), from_encoded(fmt, w.shape, raw, device=dev),
                              0) for dev in ("cpu", "cuda")]
    assert heads[0].data["gscale"] == heads[1].data["gscale"]
    for key in ("codes", "scales"):
        assert torch.equal(heads[0].data[key], heads[1].data[key].cpu())
