"""Decode-path Triton kernels against the torch backend (the one reference), through TritonOps.

Without CUDA the kernels run in the Triton interpreter on CPU tensors (TRITON_INTERPRET=1 is set here before
any kernel module is imported); with CUDA the same tests run on the GPU. Every output and workspace the
kernels allocate is NaN-poisoned (`poisoned()`), and cache entries / state rows a kernel must not read or
write are NaN too, so an unwritten or stray element shows up.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402

import pytest  # noqa: E402

from ninfer_kernels import gdn_ba_gates, rmsnorm_gates, sampling  # noqa: E402
from ninfer_rt.backends.torch_ops import TorchOps  # noqa: E402
from ninfer_rt.backends.triton_ops import TritonOps  # noqa: E402
from ninfer_rt.ops import Branch  # noqa: E402
from ninfer_rt.batch import attn_meta, gdn_routing  # noqa: E402
from numerics import rel

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# relative L2 vs the fp32-internal torch reference; bf16 allows a few ulps (the interpreter truncates casts)
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]
REF, TRI = TorchOps(), TritonOps()




def rnd(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


@contextlib.contextmanager
def poisoned():
    """torch.empty / empty_like return NaN (floats) or -7 (ints) while the kernels allocate their outputs."""
    real_empty, real_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    torch.empty = lambda *a, **k: fill(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: fill(real_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_like


def check(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.isfinite(got).all(), "unwritten (NaN) output elements"
    assert rel(got, want) <= TOL[dtype], rel(got, want)


# ---- norms and gated activations ----
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("plus_one", [True, False], ids=["1+w", "w"])
def test_rmsnorm_and_add_rmsnorm(dtype, plus_one):
    x, r, w = rnd(3, 5, 40, dtype=dtype), rnd(3, 5, 40, dtype=dtype, seed=1), rnd(40, seed=2, scale=0.3)
    with poisoned():
        y = TRI.rmsnorm(x, w, 1e-6, plus_one)
        y2, r2 = TRI.add_rmsnorm(x, r, w, 1e-6, plus_one)
    check(y, REF.rmsnorm(x, w, 1e-6, plus_one), dtype)
    want_y, want_r = REF.add_rmsnorm(x, r, w, 1e-6, plus_one)
    check(r2, want_r, dtype)
    check(y2, want_y, dtype)


@pytest.mark.parametrize("warps", ["auto", "32"])
def test_rmsnorm_warps_switch(warps, monkeypatch):
    """NINFER_NORM_WARPS picks the warps per row program (at most one per 32 elements of the block); the rows come
    out the same either way (on a GPU the launch really uses them)."""
    from ninfer_kernels.rmsnorm import norm_warps
    monkeypatch.setenv("NINFER_NORM_WARPS", warps)
    assert norm_warps(8192) == (8 if warps == "auto" else 32) and norm_warps(256) == (2 if warps == "auto" else 8)
    x, r, w = rnd(2, 1, 5120), rnd(2, 1, 5120, seed=1), rnd(5120, seed=2, scale=0.3)
    with poisoned():
        y, s = TRI.add_rmsnorm(x, r, w, 1e-6, True)
    want_y, want_s = REF.add_rmsnorm(x, r, w, 1e-6, True)
    check(s, want_s, torch.float32)
    check(y, want_y, torch.float32)


@pytest.mark.parametrize("preload", [0, 1], ids=["after-wait", "preload"])
def test_norms_gain_preload(preload, monkeypatch):
    """Both orders of the norms' gain load (`PRELOAD`, ninfer_kernels.pdl: before or after the PDL wait) give the
    reference rows; the launchers get the constexpr from pdl_kw(..., preload=True), forced here."""
    from ninfer_kernels import gated_rmsnorm, rmsnorm
    for mod in (rmsnorm, gated_rmsnorm):   # without PDL (CPU, sm_70) the wait is a no-op and either order runs
        monkeypatch.setattr(mod, "pdl_kw", lambda dev, real=mod.pdl_kw, **kw: {**real(dev), "PRELOAD": preload})
    x, r, w = rnd(2, 1, 5120), rnd(2, 1, 5120, seed=1), rnd(5120, seed=2, scale=0.3)
    o, z, wg = rnd(3, 4, 24, seed=3), rnd(3, 4, 24, seed=4), rnd(24, seed=5)
    with poisoned():
        y, s = TRI.add_rmsnorm(x, r, w, 1e-6, True)
        g = TRI.gated_rmsnorm(o, z, wg, 1e-6)
    want_y, want_s = REF.add_rmsnorm(x, r, w, 1e-6, True)
    check(s, want_s, torch.float32)
    check(y, want_y, torch.float32)
    check(g, REF.gated_rmsnorm(o, z, wg, 1e-6), torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU check of the script; on a GPU the benchmark runs")
def test_bench_norm_warps_smoke(tmp_path):
    """bench/norm_warps.py end to end on the interpreter: a record per (preload, warps) setting with the named
    fields."""
    from bench_smoke import bench_smoke
    recs, _ = bench_smoke("norm_warps.py", tmp_path, "--warps", "auto", "32")
    assert [(r["warps"], r["preload"]) for r in recs] == [("auto", 1), ("32", 1), ("auto", 0), ("32", 0)]
    for r in recs:
        assert r["us_per_norm"] > 0 and r["D"] == 5120 and r["T"] == 1
        assert r["over_floor_us"] == pytest.approx(r["us_per_norm"] - r["floor_us"], abs=2e-3)
        assert {"pdl", "gpu"} <= set(r)


def test_rmsnorm_strided_head_slice():
    """q half of the per-head [q | gate] projection, a view with row strides (total, 2D), normalised per head."""
    fused = rnd(3, 7 * 2 * 24 + 11)[:, : 7 * 2 * 24].view(3, 7, 48)
    q, w = fused[..., :24], rnd(24, seed=3, scale=0.2)
    with poisoned():
        y = TRI.rmsnorm(q, w, 1e-6, True)
    check(y, REF.rmsnorm(q, w, 1e-6, True), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rmsnorm_silu_mul_sigmoid_gate(dtype):
    zfull = rnd(3, 4 * 24 + 5, dtype=dtype)
    o, z, w = rnd(3, 4, 24, dtype=dtype, seed=1), zfull[:, 5:].view(3, 4, 24), rnd(24, seed=2)
    gu, g = rnd(3, 2 * 37, dtype=dtype, seed=4), rnd(3, 37, dtype=dtype, seed=5)
    qg = rnd(3, 4, 2 * 24, dtype=dtype, seed=6)         # per-head [q | gate]: the gate a strided head slice
    with poisoned():
        got = (TRI.gated_rmsnorm(o, z, w, 1e-6), TRI.silu_mul(gu), TRI.sigmoid_gate(gu[:, :37], g),
               TRI.sigmoid_gate(o, qg[..., 24:]))
    want = (REF.gated_rmsnorm(o, z, w, 1e-6), REF.silu_mul(gu), REF.sigmoid_gate(gu[:, :37], g),
            REF.sigmoid_gate(o, qg[..., 24:]))
    for a, b in zip(got, want):
        check(a, b, dtype)


# ---- rope / kv write / attention ----
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["text", "mrope", "full-rot"])
def test_rope(dtype, kind):
    t, d = 3, 32
    q, k = rnd(t, 3, d, dtype=dtype), rnd(t, 2 * d + 1, dtype=dtype, seed=1)[:, :2 * d].view(t, 2, d)
    rot, sec = (d, None) if kind == "full-rot" else (d // 4, (2, 1, 1))
    pos = torch.tensor([0, 77, 262_143], device=DEV)
    if kind == "mrope":
        pos = torch.tensor([[5, 6, 9], [5, 7, 8], [5, 3, 9]], device=DEV)
    with poisoned():
        got = TRI.rope(q, k, pos, rot, 1e7, sec)
    for a, b in zip(got, REF.rope(q, k, pos, rot, 1e7, sec)):
        check(a, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["text", "mrope"])
def test_qk_norm_rope(dtype, kind):
    """q/k (1 + w) norms fused into the rotation, q a strided head slice of [q | gate] as the model passes it;
    head dim 40 (a pass-through part that is no power of two)."""
    t, hq, hk, d = 3, 3, 2, 40
    q = rnd(t, hq, 2 * d, dtype=dtype, scale=3.0)[..., :d]
    k = rnd(t, hk, d, dtype=dtype, seed=1)
    qw, kw = rnd(d, seed=2, scale=0.3), rnd(d, seed=3, scale=0.3)
    pos = torch.tensor([0, 77, 262_143], device=DEV)
    if kind == "mrope":
        pos = torch.tensor([[5, 6, 9], [5, 7, 8], [5, 3, 9]], device=DEV)
    with poisoned():
        got = TRI.qk_norm_rope(q, k, qw, kw, 1e-6, pos, 16, 1e7, (4, 2, 2))
    for a, b in zip(got, REF.qk_norm_rope(q, k, qw, kw, 1e-6, pos, 16, 1e7, (4, 2, 2))):
        check(a, b, dtype)


def test_kv_write_exact_with_strided_v():
    cache_k, cache_v = rnd(5, 16, 2, 32), rnd(5, 16, 2, 32, seed=1)
    k, vfull = rnd(3, 2, 32, seed=2), rnd(3, 2 * 32 + 32 + 3, seed=3)
    v = vfull[:, 32:96].view(3, 2, 32)
    slots = torch.tensor([17, 3, 79], device=DEV)
    want_k, want_v = cache_k.clone(), cache_v.clone()
    REF.kv_write(want_k, want_v, k, v, slots)
    TRI.kv_write(cache_k, cache_v, k, v, slots)
    assert torch.equal(cache_k, want_k) and torch.equal(cache_v, want_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padded", [False, True], ids=["slots", "padding-slot"])
def test_qk_norm_rope_store(dtype, padded):
    """Norms + rotation + cache store in one launch against the unfused ops: the same q, and the caches hold
    the rotated k and the (strided) v at the slots; a negative slot (a padding token) stores nothing; head dim
    40, a cache slot of 16 x 2 heads."""
    t, hq, hk, d = 3, 3, 2, 40
    q = rnd(t, hq, 2 * d, dtype=dtype, scale=3.0)[..., :d]
    k = rnd(t, hk, d, dtype=dtype, seed=1)
    v = rnd(t, 2 * hk * d + 5, dtype=dtype, seed=4)[:, hk * d:2 * hk * d].view(t, hk, d)
    qw, kw = rnd(d, seed=2, scale=0.3), rnd(d, seed=3, scale=0.3)
    pos = torch.tensor([[5, 6, 9], [5, 7, 8], [5, 3, 9]], device=DEV)
    slots = torch.tensor([17, -1 if padded else 3, 79], device=DEV)
    caches = [torch.full((5, 16, hk, d), float("nan"), dtype=dtype, device=DEV) for _ in range(4)]
    ref = TRI if padded else REF         # the torch reference's index_copy_ takes no negative slot
    want = ref.qk_norm_rope(q, k, qw, kw, 1e-6, pos, 16, 1e7, (4, 2, 2))
    ref.kv_write(caches[0], caches[1], want[1], v, slots)
    with poisoned():
        got = TRI.qk_norm_rope_store(q, k, v, qw, kw, 1e-6, pos, 16, 1e7, (4, 2, 2), caches[2], caches[3], slots)
    check(got, want[0], dtype)
    for a, b in ((caches[2], caches[0]), (caches[3], caches[1])):
        assert torch.equal(torch.isnan(a), torch.isnan(b)), "a cache slot written that the unfused ops leave"
        assert rel(torch.nan_to_num(a), torch.nan_to_num(b)) <= TOL[dtype]


def _attn_case(dtype, seq_lens, kv_lens, seed=0, page=16, hq=6, hk=2, d=32):
    """Paged caches with out-of-order page tables; every slot not holding a live token is NaN."""
    n_pages = sum(-(-kv // page) for kv in kv_lens) + 3
    perm = torch.randperm(n_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    pages, used = [], 0
    for kv in kv_lens:
        n = -(-kv // page)
        pages.append(perm[used:used + n])
        used += n
    starts = [kv - t for kv, t in zip(kv_lens, seq_lens)]
    meta = attn_meta(pages, starts, list(seq_lens), page, DEV)
    k_cache = torch.full((n_pages, page, hk, d), float("nan"), dtype=dtype, device=DEV)
    v_cache = k_cache.clone()
    for b, kv in enumerate(kv_lens):
        ids = torch.tensor(pages[b], device=DEV)
        live = (ids[:, None] * page + torch.arange(page, device=DEV)[None, :]).flatten()[:kv]
        k_cache.view(-1, hk, d)[live] = rnd(kv, hk, d, dtype=dtype, seed=seed + 10 + b)
        v_cache.view(-1, hk, d)[live] = rnd(kv, hk, d, dtype=dtype, seed=seed + 20 + b)
    q = rnd(sum(seq_lens), hq, d, dtype=dtype, seed=seed + 1)
    return q, k_cache, v_cache, meta


def _paged_attention(q, kc, vc, meta, splits, min_split=None, max_kv=None):
    from ninfer_kernels.attention_decode import paged_attention
    return paged_attention(q, kc, vc, meta.cu_seqlens, meta.kv_lens_t, meta.block_tables, meta.page_size,
                           q.shape[-1] ** -0.5, meta.max_q_len, max_kv or meta.max_kv_len, num_splits=splits,
                           min_split=min_split)


@pytest.mark.parametrize("dtype", DTYPES[:2])
@pytest.mark.parametrize("seq_lens,kv_lens", [((1, 1), (1, 40)), ((3, 3), (17, 33)), ((3, 1), (40, 16))],
                         ids=["decode-kv1+40", "verify3-kv17+33", "mixed-kv40+16"])
@pytest.mark.parametrize("splits", [None, 3], ids=["auto", "split3"])
def test_paged_attention(dtype, seq_lens, kv_lens, splits):
    q, kc, vc, meta = _attn_case(dtype, seq_lens, kv_lens, seed=sum(kv_lens))
    want = REF.attention(q, torch.nan_to_num(kc), torch.nan_to_num(vc), meta, q.shape[-1] ** -0.5)
    with poisoned():
        got = _paged_attention(q, kc, vc, meta, splits)
    check(got, want, dtype)


@pytest.mark.parametrize("seq_lens,kv_lens,hq,d,splits", [
    ((1, 1), (1, 70), 12, 256, 3),     # decode at the real head size: four 64-column chunks, split-KV
    ((9, 2), (30, 51), 8, 160, 1),     # verify rows past one 32-row block; a ragged head (last chunk masked)
    ((3,), (45,), 4, 40, None),        # a head narrower than one chunk
], ids=["decode-d256-split3", "verify-2mblocks-d160", "d40"])
def test_paged_attention_fma_tiles(monkeypatch, seq_lens, kv_lens, hq, d, splits):
    """The sm_70 tiles (no tensor-core tl.dot: 16 keys per step, 64 head-dim columns per dot, 32 rows per
    program) against the reference, gated and not."""
    from ninfer_kernels import attention_decode as ad
    monkeypatch.setattr(ad, "tiles_for", lambda device: ad.FMA_TILES)
    q, kc, vc, meta = _attn_case(torch.float32, seq_lens, kv_lens, seed=11, hq=hq, hk=2, d=d)
    kc0, vc0 = torch.nan_to_num(kc), torch.nan_to_num(vc)
    with poisoned():
        check(_paged_attention(q, kc, vc, meta, splits), REF.attention(q, kc0, vc0, meta, q.shape[-1] ** -0.5),
              torch.float32)
    gate = rnd(q.shape[0], hq, d, dtype=torch.float32, seed=12, scale=2.0)
    with poisoned():
        got, _ = ad.gated_attention(q, kc, vc, meta.cu_seqlens, meta.kv_lens_t, meta.block_tables, meta.page_size,
                                    0.09, meta.max_q_len, meta.max_kv_len, gate, num_splits=splits)
    check(got, REF.gated_attention(q, kc0, vc0, meta, 0.09, gate), torch.float32)


@pytest.mark.parametrize("min_split", [32, 96], ids=["min32", "min96"])
def test_paged_attention_splits_sized_on_device(min_split):
    """Splits fixed on the host for a larger context (a graph's KV bucket), each sequence cutting its own keys
    into at most that many pieces of >= min_split keys: ragged lengths, some splits past every key."""
    q, kc, vc, meta = _attn_case(torch.float32, (1, 4, 2), (200, 75, 33), seed=3)
    want = REF.attention(q, torch.nan_to_num(kc), torch.nan_to_num(vc), meta, q.shape[-1] ** -0.5)
    with poisoned():
        got = _paged_attention(q, kc, vc, meta, 7, min_split=min_split, max_kv=4096)
    check(got, want, torch.float32)


@pytest.mark.parametrize("seq_lens,kv_lens,late", [((1, 1), (40, 33), ""), ((3, 1), (40, 16), "combine")],
                         ids=["decode", "verify"])
def test_attention_combine_triggers_late_in_verify_steps_only(seq_lens, kv_lens, late, monkeypatch):
    """The split-KV combine asks pdl_kw for NINFER_PDL_LATE's `combine` when a sequence has more than one query
    row (verify), not in decode steps, where the late trigger measured no gain (bench/NOTES.md §31)."""
    from ninfer_kernels import attention_decode
    asked = []
    monkeypatch.setattr(attention_decode, "pdl_kw", lambda device, **kw: asked.append(kw.get("late")) or {})
    q, kc, vc, meta = _attn_case(torch.float32, seq_lens, kv_lens, seed=3)
    want = REF.attention(q, torch.nan_to_num(kc), torch.nan_to_num(vc), meta, q.shape[-1] ** -0.5)
    with poisoned():
        check(_paged_attention(q, kc, vc, meta, 3), want, torch.float32)
    assert asked == [None, late]          # the forward kernel, then the combine


def test_paged_attention_combine_chunks():
    """More splits than the combine loads per chunk (attention_decode.COMBINE_SPLITS): the running maximum
    carried across chunks, rescaling the first chunk's sums (the last keys of sequence 0 score high, so the
    second chunk holds the largest log-sum-exps); a sequence whose keys end in the first chunk (its second
    chunk holds only keyless splits)."""
    from ninfer_kernels.attention_decode import COMBINE_SPLITS
    splits = COMBINE_SPLITS + 5
    kv0 = 1200        # cut into more than COMBINE_SPLITS BLOCK_N-aligned pieces (checked: a combine without
                      # the rescale fails here)
    q, kc, vc, meta = _attn_case(torch.float32, (1, 2), (kv0, 70), seed=6)
    pos = torch.arange(kv0 - 48, kv0, device=DEV)
    slots = meta.block_tables[0, pos // kc.shape[1]].long() * kc.shape[1] + pos % kc.shape[1]
    kc.view(-1, *kc.shape[2:])[slots] *= 6.0
    want = REF.attention(q, torch.nan_to_num(kc), torch.nan_to_num(vc), meta, q.shape[-1] ** -0.5)
    with poisoned():
        check(_paged_attention(q, kc, vc, meta, splits, min_split=32, max_kv=8192), want, torch.float32)


def test_attention_min_split_env(monkeypatch):
    """NINFER_ATTN_MIN_SPLIT reaches the kernel (7 host splits over a 4K bucket; 500 keys cut into 7 pieces of
    >= 32 keys or 4 of >= 128): the same output either way."""
    q, kc, vc, meta = _attn_case(torch.float32, (1, 2), (500, 300), seed=4)
    want = REF.attention(q, torch.nan_to_num(kc), torch.nan_to_num(vc), meta, q.shape[-1] ** -0.5)
    for keys in ("32", "128"):
        monkeypatch.setenv("NINFER_ATTN_MIN_SPLIT", keys)
        with poisoned():
            check(_paged_attention(q, kc, vc, meta, 7, max_kv=4096), want, torch.float32)


def test_attention_prefill_chunk_through_backend():
    """A prefill chunk (T = 20 > one row block of the GQA group) after 9 cached tokens, via TritonOps."""
    q, kc, vc, meta = _attn_case(torch.float32, (20, 2), (29, 5), seed=5)
    want = REF.attention(q, torch.nan_to_num(kc), torch.nan_to_num(vc), meta, 0.17)
    with poisoned():
        got = TRI.attention(q, kc, vc, meta, 0.17)
    check(got, want, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES[:2])
@pytest.mark.parametrize("seq_lens,kv_lens,splits", [((1, 1), (300, 140), 3), ((3, 1), (17, 33), 1)],
                         ids=["decode-combine", "verify-one-split"])
def test_gated_attention(dtype, seq_lens, kv_lens, splits):
    """The sigmoid output gate applied where the attention output is stored (the combine, or the single-split
    store) against attention then sigmoid_gate, the gate a strided head slice of [q | gate] as the model passes
    it; head dim 128: the combine also writes the prepared rows the o_proj GEMV reads (x16_ref of the output)."""
    from ninfer_kernels.attention_decode import gated_attention
    from ninfer_kernels.x16 import words_per_row, x16_ref
    hq, d = 4, 128
    q, kc, vc, meta = _attn_case(dtype, seq_lens, kv_lens, seed=7, hq=hq, hk=2, d=d)
    gate = rnd(q.shape[0], hq, 2 * d, dtype=dtype, seed=9, scale=2.0)[..., d:]
    want = REF.gated_attention(q, torch.nan_to_num(kc), torch.nan_to_num(vc), meta, 0.09, gate)
    xp = torch.full((q.shape[0], words_per_row(hq * d)), -7, dtype=torch.int32, device=DEV)
    with poisoned():
        got, wrote = gated_attention(q, kc, vc, meta.cu_seqlens, meta.kv_lens_t, meta.block_tables, meta.page_size,
                                     0.09, meta.max_q_len, meta.max_kv_len, gate, xp, num_splits=splits)
    check(got, want, dtype)
    assert (wrote is xp) == (splits > 1), "prepared rows: from the combine, and only from it"
    if splits > 1:
        assert torch.equal(xp, x16_ref(got.reshape(q.shape[0], hq * d)))
    with poisoned():       # through the backend, which picks the splits itself
        check(TRI.gated_attention(q, kc, vc, meta, 0.09, gate), want, dtype)


# ---- gated deltanet ----
HK, HV, DK, DV, C, CK = 2, 6, 16, 24, 40, 4


def _gdn_meta(lens, snapshot, slots):
    full, _, snap, n_snap = gdn_routing(list(lens), list(slots), list(snapshot), DEV)
    return full, n_snap


SNAP_CASES = [((3, 1), (False, False)), ((3, 1), (True, False)), ((1, 2), (True, True)), ((20, 2), (False, True)),
              ((1, 1), (False, False)), ((1, 1), (True, False)), ((6, 1), (True, False))]
SNAP_IDS = ["T3+1-inplace", "T3snap+1", "T1snap+2snap", "T20+2snap", "T1+1-inplace", "T1snap+1", "T6snap+1"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,snapshot", SNAP_CASES, ids=SNAP_IDS)
def test_causal_conv(dtype, lens, snapshot):
    _causal_conv_case(dtype, lens, snapshot)


def _causal_conv_case(dtype, lens, snapshot):
    """causal_conv against the reference: outputs, the pool (slots 1 and 3 are NaN rows nobody owns) and the
    snapshot rows (2 spare rows stay NaN)."""
    meta, n_snap = _gdn_meta(lens, snapshot, slots=(2, 0))
    x = rnd(sum(lens), C + 7, dtype=dtype)[:, :C]     # the qkv columns of the fused qkv|z projection: strided
    w = rnd(C, CK, seed=1, scale=0.5)
    pool = rnd(4, CK - 1, C, seed=2)
    pool[[1, 3]] = float("nan")                 # slots nobody owns: never read
    snaps = torch.full((n_snap + 2, CK - 1, C), float("nan"), device=DEV)   # 2 spare rows stay NaN
    want_pool, want_snaps = pool.clone(), snaps.clone()
    want = REF.causal_conv(x, w, want_pool, meta, want_snaps)
    with poisoned():
        got = TRI.causal_conv(x, w, pool, meta, snaps)
    check(got, want, dtype)
    assert torch.allclose(pool, want_pool, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert torch.allclose(snaps, want_snaps, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert torch.isnan(snaps[n_snap:]).all()


def _conv_step_case(dtype):
    """The one-token step kernel with a padded batch row (no new token, as a CUDA graph's spare row): nothing of
    its slot is read or written -- the slot here is a NaN row nobody owns -- and the others are unaffected."""
    meta, _ = _gdn_meta((1, 0, 1), (False, False, False), slots=(2, 3, 0))
    x = rnd(2, C, dtype=dtype)
    w = rnd(C, CK, seed=1, scale=0.5)
    pool = rnd(4, CK - 1, C, seed=2)
    pool[[1, 3]] = float("nan")
    want_pool = pool.clone()     # the reference has no empty sequences: the same batch without the padded row
    want = REF.causal_conv(x, w, want_pool, _gdn_meta((1, 1), (False, False), slots=(2, 0))[0], None)
    with poisoned():
        got = TRI.causal_conv(x, w, pool, meta, None)
    check(got, want, dtype)
    assert torch.allclose(pool, want_pool, rtol=1e-5, atol=1e-6, equal_nan=True) and torch.isnan(pool[3]).all()


def test_causal_conv_step_skips_a_sequence_without_tokens():
    _conv_step_case(torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_gates(dtype):
    ba = rnd(3, 2 * HV + 1, dtype=dtype, scale=8.0)          # strided b / a columns, softplus far into both tails
    b, a = ba[:, :HV], ba[:, HV + 1:]
    A_log, dt = rnd(HV, seed=1), rnd(HV, seed=2)
    with poisoned():
        g, beta = TRI.gdn_gates(a, b, A_log, dt)
    want_g, want_beta = REF.gdn_gates(a, b, A_log, dt)
    check(g, want_g, torch.float32)
    check(beta, want_beta, torch.float32)


@pytest.mark.parametrize("wdtype", [pytest.param(d, id=f"w-{n}") for d, n in
                                    ((torch.bfloat16, "bf16"), (torch.float16, "f16"), (torch.float32, "f32"))])
@pytest.mark.parametrize("t", [pytest.param(t, id=f"T{t}") for t in (1, 3, 16, 17)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_ba_gates(dtype, t, wdtype):
    """The fused b/a projection + gates (T <= 16; T = 17 takes the composed path) against linear + gates;
    K = 203 is no multiple of the kernel's K block."""
    from ninfer_rt.weights import QWeight
    x = rnd(t, 203, dtype=dtype, scale=2.0)
    w = QWeight.plain(rnd(2 * HV, 203, dtype=wdtype, seed=3, scale=0.5), "in_ba")
    A_log, dt = rnd(HV, seed=1), rnd(HV, seed=2)
    with poisoned():
        g, beta = TRI.gdn_ba_gates(x, w, A_log, dt)
    want_g, want_beta = REF.gdn_ba_gates(x, w, A_log, dt)
    check(g, want_g, dtype)
    check(beta, want_beta, dtype)


@pytest.mark.parametrize("res", [True, False], ids=["residual", "first-layer"])
@pytest.mark.parametrize("t", [pytest.param(t, id=f"T{t}") for t in (1, 3, 17)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_ba_gates(dtype, t, res, monkeypatch):
    """A GDN layer's input norm with its gates computed in the norm's kernel (NINFER_GATES_JOIN=norm: the backend
    takes it at T = 1, the kernel at T <= 16, called directly at T = 3; T = 17 only composed) against add_rmsnorm /
    rmsnorm, and the gates against linear + gates of the y it returned (a one-ulp difference in bf16 y moves g by a
    few per cent: the interpreter truncates casts); D = 203 is no power of two. The gates come as a plain Branch."""
    from ninfer_rt.weights import QWeight
    monkeypatch.setenv("NINFER_GATES_JOIN", "norm")
    calls = []
    monkeypatch.setattr(rmsnorm_gates, "add_rmsnorm_gates", lambda *a, real=rmsnorm_gates.add_rmsnorm_gates, **k:
                        calls.append(1) or real(*a, **k))
    x, r = rnd(t, 203, dtype=dtype, scale=2.0), (rnd(t, 203, dtype=dtype, seed=4) if res else None)
    w, w_ba = rnd(203, seed=5, scale=0.3), QWeight.plain(rnd(2 * HV, 203, dtype=dtype, seed=3, scale=0.5), "in_ba")
    A_log, dt = rnd(HV, seed=1), rnd(HV, seed=2)
    with poisoned():
        if t == 3:
            y, s, *gv = rmsnorm_gates.add_rmsnorm_gates(x, r, w, 1e-6, w_ba.data["w"], A_log, dt)
            gates = Branch(tuple(gv))
        else:
            y, s, gates = TRI.norm_ba_gates(x, r, w, 1e-6, w_ba, A_log, dt)
    want_y, want_s, _ = REF.norm_ba_gates(x, r, w, 1e-6, w_ba, A_log, dt)
    assert type(gates) is Branch and (s is None) == (not res) and len(calls) == (t <= 3)   # T = 17: composed
    check(y, want_y, dtype)
    if res:
        check(s, want_s, dtype)
    for got, want in zip(gates.join(), REF.gdn_ba_gates(y, w_ba, A_log, dt)):
        check(got, want, dtype)


def _gdn_inputs(t, dtype, seed=0):
    """q, k, v as the model hands them over: strided head views of one [T, q|k|v] conv output."""
    qkv = rnd(t, 2 * HK * DK + HV * DV, dtype=dtype, seed=seed)
    q, k, v = qkv.split((HK * DK, HK * DK, HV * DV), dim=-1)
    q, k, v = q.reshape(t, HK, DK), k.reshape(t, HK, DK), v.reshape(t, HV, DV)
    g, beta = REF.gdn_gates(rnd(t, HV, seed=seed + 3), rnd(t, HV, seed=seed + 4), rnd(HV, seed=seed + 5) * 0.5,
                            rnd(HV, seed=seed + 6))
    return q, k, v, g, beta


def _recurrent_case(dtype, lens, snapshot):
    """gdn_recurrent against the reference: outputs, the two live pool slots (slot 1 is a NaN row nobody owns) and
    the snapshot rows (a spare row stays NaN)."""
    meta, n_snap = _gdn_meta(lens, snapshot, slots=(0, 2))
    args = _gdn_inputs(sum(lens), dtype, seed=len(lens))
    pool = rnd(3, HV, DK, DV, seed=7, scale=0.3)
    pool[1] = float("nan")
    snaps = torch.full((n_snap + 1, HV, DK, DV), float("nan"), device=DEV)
    want_pool, want_snaps = pool.clone(), snaps.clone()
    want = REF.gdn_recurrent(*args, want_pool, meta, want_snaps)
    with poisoned():
        got = TRI.gdn_recurrent(*args, pool, meta, snaps)
    check(got, want, dtype)
    assert torch.isnan(pool[1]).all() and torch.isnan(snaps[n_snap:]).all()
    live = [0, 2]
    assert rel(pool[live], want_pool[live]) <= TOL[torch.float32]
    if n_snap:
        assert rel(snaps[:n_snap], want_snaps[:n_snap]) <= TOL[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,snapshot", SNAP_CASES, ids=SNAP_IDS)
def test_gdn_recurrent(dtype, lens, snapshot):
    _recurrent_case(dtype, lens, snapshot)


@pytest.mark.parametrize("preload", [0, 1], ids=["after-wait", "preload"])
def test_gdn_state_preload(preload, monkeypatch):
    """Both orders of the GDN kernels' state loads (`PRELOAD`, NINFER_PDL_STATE: before or after the PDL wait)
    give the reference: the decode conv step (window and taps early, the new row after), the verify conv (T > 1:
    taps and pool window early, the x rows after; with snapshot rows and in place) and the recurrence with snapshot
    rows (the state tile early, the token inputs after); pdl_kw(..., state=True) forced here."""
    from ninfer_kernels import gdn_conv, gdn_recurrent
    for mod in (gdn_conv, gdn_recurrent):   # without PDL (CPU, sm_70) the wait is a no-op and either order runs
        monkeypatch.setattr(mod, "pdl_kw", lambda dev, real=mod.pdl_kw, **kw: {**real(dev), "PRELOAD": preload}
                            if kw.get("state") else real(dev, **kw))
    _conv_step_case(torch.float16)
    _causal_conv_case(torch.float16, (4, 2), (True, False))
    _causal_conv_case(torch.float16, (3, 1), (False, False))
    _recurrent_case(torch.float16, (3, 1), (True, False))


@pytest.mark.parametrize("join", ["conv", "recurrence"])
def test_gdn_conv_recurrent_joins_the_gates_once(join, monkeypatch):
    """The composed conv + recurrence (NINFER_GDN_FUSED=0) joins the gates branch exactly once, in front of the
    conv or behind it (NINFER_GATES_JOIN), and gives the reference either way."""
    monkeypatch.setenv("NINFER_GDN_FUSED", "0")
    monkeypatch.setenv("NINFER_GATES_JOIN", join)
    qkv, w, g, beta, cpool, rpool, csnap, rsnap, meta = _convrec_case((3, 1), (True, False), torch.float32, False)
    want_c, want_r, want_cs, want_rs = cpool.clone(), rpool.clone(), csnap.clone(), rsnap.clone()
    want, _ = REF.gdn_conv_recurrent(qkv, w, want_c, Branch((g, beta)), want_r, meta, want_cs, want_rs)

    class Once(Branch):
        joins = 0

        def join(self):
            Once.joins += 1
            return super().join()
    with poisoned():
        got, done = TRI.gdn_conv_recurrent(qkv, w, cpool, Once((g, beta)), rpool, meta, csnap, rsnap)
        done.join()
    assert Once.joins == 1
    check(got, want, torch.float32)
    assert rel(torch.nan_to_num(rsnap), torch.nan_to_num(want_rs)) <= TOL[torch.float32]


def _convrec_case(lens, snapshot, dtype, alias):
    """qkv rows (a row-strided view, as the q|k|v columns of the fused projection), conv taps, gates and both
    state pools with NaN rows nobody owns; alias: the snapshot rows are rows of the pools themselves and the
    first sequence's committed state is one of its own snapshot rows (the graph runner's layout)."""
    c = 2 * HK * DK + HV * DV
    t = sum(lens)
    qkv = rnd(t, c + 5, dtype=dtype, seed=21)[:, :c]
    w = rnd(c, CK, seed=22, scale=0.5)
    g, beta = REF.gdn_gates(rnd(t, HV, seed=23), rnd(t, HV, seed=24), rnd(HV, seed=25) * 0.5, rnd(HV, seed=26))
    n_snap = sum(n for n, s in zip(lens, snapshot) if s)
    rows = 4 + (n_snap if alias else 0)
    cpool, rpool = rnd(rows, CK - 1, c, seed=27), rnd(rows, HV, DK, DV, seed=28, scale=0.3)
    cpool[1], rpool[1] = float("nan"), float("nan")
    slots = [0, 2]
    if alias:
        slots[0] = 4 + 1 if lens[0] > 1 else 4           # inside its own snapshot rows 4 .. 4 + T0 - 1
        csnap, rsnap = cpool, rpool
    else:
        csnap = torch.full((n_snap + 1, CK - 1, c), float("nan"), device=DEV)
        rsnap = torch.full((n_snap + 1, HV, DK, DV), float("nan"), device=DEV)
    full = gdn_routing(list(lens), slots, list(snapshot), DEV)[0]
    if alias:
        shifted = torch.where(full.snap_index >= 0, full.snap_index + 4, full.snap_index)
        full = type(full)(**{**full.__dict__, "snap_index": shifted,
                             "snap_index_host": tuple(s + 4 if s >= 0 else s for s in full.snap_index_host)})
    return qkv, w, g, beta, cpool, rpool, csnap, rsnap, full


CONVREC_CASES = [((1, 1), (False, False), False), ((3, 1), (True, False), False), ((1, 2), (True, True), False),
                 ((4, 1), (True, False), True), ((1,), (True,), True), ((20, 2), (False, True), False)]
CONVREC_IDS = ["T1+1-inplace", "T3snap+1", "T1snap+2snap", "T4snap-aliased+1", "T1snap-aliased", "T20+2snap"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,snapshot,alias", CONVREC_CASES, ids=CONVREC_IDS)
def test_gdn_conv_recurrent(dtype, lens, snapshot, alias, monkeypatch):
    """The fused conv + recurrence against the torch backend's causal_conv then gdn_recurrent: outputs, both pools
    and both snapshot sets, with value tiles that leave a partial last tile (dv 24, 16 columns) and three value
    heads per key head, whose q / k conv windows the window kernel advances after the fused one has read them."""
    monkeypatch.setenv("NINFER_GDN_FUSED", "1")
    qkv, w, g, beta, cpool, rpool, csnap, rsnap, meta = _convrec_case(lens, snapshot, dtype, alias)
    want_c, want_r = cpool.clone(), rpool.clone()
    want_cs, want_rs = (want_c, want_r) if alias else (csnap.clone(), rsnap.clone())
    want, done = REF.gdn_conv_recurrent(qkv, w, want_c, Branch((g, beta)), want_r, meta, want_cs, want_rs)
    assert done.join() is None
    with poisoned():
        got, done = TRI.gdn_conv_recurrent(qkv, w, cpool, Branch((g, beta)), rpool, meta, csnap, rsnap)
        done.join()
    check(got, want, dtype)
    for a, b in ((cpool, want_c), (rpool, want_r), (csnap, want_cs), (rsnap, want_rs)):
        assert torch.equal(torch.isnan(a), torch.isnan(b)), "a state row written that the reference leaves alone"
        assert rel(torch.nan_to_num(a), torch.nan_to_num(b)) <= TOL[dtype]


def test_gdn_chunk_matches_reference():
    """Prefill through the backend (CPU / fp32: the token-by-token kernel over the chunk)."""
    lens = (21, 5)
    meta, _ = _gdn_meta(lens, (False, False), slots=(1, 0))
    args = _gdn_inputs(sum(lens), torch.float32, seed=11)
    pool = rnd(2, HV, DK, DV, seed=8, scale=0.3)
    want_pool = pool.clone()
    want = REF.gdn_chunk(*args, want_pool, meta)
    with poisoned():
        got = TRI.gdn_chunk(*args, pool, meta)
    check(got, want, torch.float32)
    assert rel(pool, want_pool) <= 1e-5           # chunked vs token-by-token forms of the recurrence


# ---- argmax ----
def test_argmax_ties_offsets_and_rank_combine():
    v = 5000                                      # > one 4096-column block: the cross-block tie is exercised
    logits = rnd(3, 2 * v, seed=4)
    logits[0, [4097, 10, 7000]] = 50.0            # ties across blocks and shards -> lowest index 10
    logits[1, [v + 3, v + 4100]] = 60.0           # tie inside shard 1 only -> v + 3
    logits[2] = -3.0                              # all equal -> 0
    with poisoned():
        parts = [TRI.argmax_partial(logits[:, r * v:(r + 1) * v].contiguous(), r * v) for r in range(2)]
    want = torch.tensor([10, v + 3, 0], device=DEV)
    key = torch.maximum(parts[0][2], parts[1][2])            # what an all-reduce(MAX) over ranks gives
    val, idx = sampling.unpack_key(key)
    assert torch.equal(idx, want)
    assert torch.equal(val, logits.max(-1).values)
    for r, (pv, pi, pk) in enumerate(parts):
        shard = logits[:, r * v:(r + 1) * v]
        assert torch.equal(pi, shard.argmax(-1) + r * v)   # torch's argmax also takes the first maximum
        assert torch.equal(pv, shard.max(-1).values)
        assert torch.equal(pk, sampling.pack_key(pv, pi))


# ---- bad input: one-line KernelInputError (a NinferError) naming the op ----
def test_bad_shapes_raise_clear_errors():
    from ninfer_formats.errors import NinferError
    x = rnd(2, 8)
    cases = [(lambda: TRI.rmsnorm(x, rnd(7), 1e-6, True), "rmsnorm"),
             (lambda: TRI.silu_mul(rnd(2, 7)), "silu_mul"),
             (lambda: TRI.rope(rnd(2, 1, 8), rnd(2, 1, 8), torch.arange(3, device=DEV), 4, 1e4), "rope"),
             (lambda: TRI.kv_write(rnd(2, 4, 1, 8), rnd(2, 4, 1, 8), rnd(2, 2, 8), rnd(2, 2, 8),
                                   torch.arange(2, device=DEV)), "kv_write"),
             (lambda: TRI.qk_norm_rope_store(rnd(2, 1, 8), rnd(2, 1, 8), rnd(2, 1, 8), rnd(8), rnd(8), 1e-6,
                                             torch.arange(2, device=DEV), 4, 1e4, None, rnd(2, 4, 1, 8),
                                             rnd(2, 4, 1, 8), torch.arange(3, device=DEV)), "qk_norm_rope_store"),
             (lambda: TRI.gated_attention(rnd(2, 2, 8), *_attn_case(torch.float32, (1, 1), (3, 5))[1:], 0.3,
                                          rnd(2, 3, 8)), "attention: gate"),
             (lambda: TRI.gdn_gates(x, x, rnd(3), rnd(8)), "gdn_gates"),
             (lambda: gdn_ba_gates.gdn_ba_gates(x, rnd(5, 8), rnd(2), rnd(2)), "gdn_ba_gates"),
             (lambda: rmsnorm_gates.add_rmsnorm_gates(x, None, rnd(8), 1e-6, rnd(4, 8), rnd(3), rnd(2)),
              "add_rmsnorm_gates: .*A_log \\(3,\\)"),
             (lambda: rmsnorm_gates.add_rmsnorm_gates(rnd(17, 8), None, rnd(8), 1e-6, rnd(4, 8), rnd(2), rnd(2)),
              "add_rmsnorm_gates: .*T must be 1..16")]
    for fn, op in cases:
        with pytest.raises(NinferError, match=op) as e:
            fn()
        assert "\n" not in str(e.value)
