"""The Model on TritonOps gives the torch backend's logits and greedy tokens.

CPU: the Triton interpreter, fp32, the tiny hf_tiny model (a batched mixed prefill, decodes, a snapshot
verify + commit, MTP). CUDA (skipped without it): the same run in bf16 at a larger model, and the kernels at
the real model's head sizes (head_dim 256, GQA 24/4, GDN 48/16 x 128) against the torch backend.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hf_tiny import artifact_weights, build_hf_model, model_config_from_hf  # noqa: E402

from ninfer_rt.backends import get_ops  # noqa: E402
from ninfer_rt.backends.torch_ops import TorchOps  # noqa: E402
from ninfer_rt.backends.triton_ops import TritonOps  # noqa: E402
from ninfer_rt.ops import Branch  # noqa: E402
from ninfer_rt.batch import attn_meta, gdn_routing  # noqa: E402
from ninfer_rt.model import Model, MtpInput, SeqInput  # noqa: E402
from ninfer_rt.state import CacheConfig  # noqa: E402
from numerics import rel

# rel L2 of logits between the two backends running the same model
MODEL_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
# greedy tokens must agree wherever the reference's top-2 logit gap exceeds this fraction of the row's RMS
# logit (bf16: rounding-order noise; the random models' logits are ~0.3 RMS, so an absolute margin misfits)
ARGMAX_MARGIN = {torch.float32: 0.0, torch.bfloat16: 0.15}
# kernels vs the torch backend at the real sizes on the GPU; fla's chunked form rounds through 16-bit matmuls
GPU_KERNEL_TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}
GPU_CHUNK_TOL = {torch.float16: 1e-2, torch.bfloat16: 4e-2}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")




def _models(dtype, device, **size):
    tiny = build_hf_model(seed=5, **size)
    cfg = model_config_from_hf(tiny.text_config, mtp=True)
    w = artifact_weights(tiny)
    cache = CacheConfig(num_pages=32, page_size=16, max_seqs=4)
    return [Model(cfg, {n: t.to(device) for n, t in w.items()}, ops, cache=cache, dtype=dtype)
            for ops in (TorchOps(), TritonOps())]


def same_tokens(got, want, dtype) -> tuple[int, int]:
    """Asserts equal argmax on the rows with a clear winner; -> (rows checked, rows)."""
    w = want.float()
    top2 = w.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > ARGMAX_MARGIN[dtype] * w.pow(2).mean(-1).sqrt()
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    return int(clear.sum()), clear.numel()


def _script(models, dtype, prompt_lens=(11, 5)):
    """Drive both models through the same steps (tokens teacher-forced from the torch model); compare."""
    tol = MODEL_TOL[dtype]
    dev = models[0].device
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 240, (n,), generator=g).to(dev) for n in prompt_lens]
    states = [[m.new_state() for _ in prompts] for m in models]
    checked = []

    def step(make):
        outs = [m.forward(make(st)) for m, st in zip(models, states)]
        assert rel(outs[1].logits, outs[0].logits) <= tol
        checked.append(same_tokens(outs[1].logits, outs[0].logits, dtype))
        return outs

    # mixed batch: a prefill chunk (chunked GDN path) + a short one (recurrent path)
    outs = step(lambda st: [SeqInput(p, s) for p, s in zip(prompts, st)])
    nxt = outs[0].logits[[prompt_lens[0] - 1, sum(prompt_lens) - 1]].argmax(-1)
    for _ in range(2):       # batched decode
        outs = step(lambda st: [SeqInput(nxt[i:i + 1], s) for i, s in enumerate(st)])
        nxt = outs[0].logits.argmax(-1)
    verify = torch.cat([nxt[:1], torch.randint(0, 240, (3,), generator=g).to(dev)])
    outs = step(lambda st: [SeqInput(verify, st[0], snapshot=True), SeqInput(nxt[1:2], st[1])])
    for st in states:
        st[0].commit(2)
    outs = step(lambda st: [SeqInput(verify[2:3], st[0]), SeqInput(nxt[1:2], st[1])])
    for a, b in zip(states[0], states[1]):
        assert rel(models[1].gdn_pool.rec[:, b.gdn_row], models[0].gdn_pool.rec[:, a.gdn_row]) <= tol
    hid = outs[0].hidden[:1]
    d = [m.mtp_forward([MtpInput(verify[3:4], hid, st[0].mtp)]) for m, st in zip(models, states)]
    assert rel(d[1].logits, d[0].logits) <= tol
    checked.append(same_tokens(d[1].logits, d[0].logits, dtype))
    n_clear, n_rows = map(sum, zip(*checked))
    assert n_clear >= 0.5 * n_rows, (n_clear, n_rows)     # the token check must bite on most rows


@pytest.mark.parametrize("join", ["recurrence", "norm"])
def test_model_triton_equals_torch_interpreter(join, monkeypatch):
    """fp32 tiny model (hidden 64, 3 GDN + 1 attention layer, MTP); the GDN gates from their own kernel or from the
    input norm's (NINFER_GATES_JOIN)."""
    monkeypatch.setenv("NINFER_GATES_JOIN", join)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    _script(_models(torch.float32, dev), torch.float32)


def test_get_ops_triton():
    assert isinstance(get_ops("triton"), TritonOps)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_triton_backend_refuses_cpu_without_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from ninfer_rt.backends import get_ops\ntry:\n    get_ops('triton')\nexcept Exception as e:\n    print(type(e).__name__, e)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.stdout.startswith("LoadError --backend triton: needs a CUDA device"), r.stdout + r.stderr[-500:]


@gpu
def test_model_triton_equals_torch_gpu_bf16():
    _script(_models(torch.bfloat16, "cuda", hidden=256, layers=8), torch.bfloat16, prompt_lens=(300, 7))


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("t", [1, 4, 16], ids=lambda t: f"T{t}")
def test_attention_real_heads_gpu(dtype, t):
    ref, tri = TorchOps(), TritonOps()
    kv = [3000, 700, t]
    pages = [list(range(s, s + -(-n // 16))) for s, n in zip((0, 400, 600), kv)]
    meta = attn_meta(pages, [n - t for n in kv], [t] * 3, 16, "cuda")
    kc = torch.randn(700, 16, 4, 256, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    q = torch.randn(3 * t, 24, 256, device="cuda", dtype=dtype)
    got = tri.attention(q, kc, vc, meta, 256 ** -0.5)
    assert rel(got, ref.attention(q, kc, vc, meta, 256 ** -0.5)) <= GPU_KERNEL_TOL[dtype]


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("t", [1, 4], ids=lambda t: f"T{t}")
def test_gated_attention_and_store_real_heads_gpu(dtype, t):
    """The attention layer's fused ops at the real head sizes (24 q / 4 kv heads of 256, partial rotation 64):
    q/k norms + rotation + cache store, then attention with the output gate (split-KV combine, prepared rows),
    against the unfused Triton ops and the torch reference."""
    from ninfer_kernels.x16 import x16_ref
    ref, tri = TorchOps(), TritonOps(xpre=True)
    kv = [3000, 700, t]
    pages = [list(range(s, s + -(-n // 16))) for s, n in zip((0, 400, 600), kv)]
    meta = attn_meta(pages, [n - t for n in kv], [t] * 3, 16, "cuda")
    caches = [torch.randn(700, 16, 4, 256, device="cuda", dtype=dtype) for _ in range(2)]
    fused = [c.clone() for c in caches]
    qg = torch.randn(3 * t, 24, 512, device="cuda", dtype=dtype)
    k, v = (torch.randn(3 * t, 4, 256, device="cuda", dtype=dtype) for _ in range(2))
    w = [torch.randn(256, device="cuda") * 0.2 for _ in range(2)]
    pos = torch.tensor([n - t + i for n in kv for i in range(t)], device="cuda")
    qr, kr = tri.qk_norm_rope(qg[..., :256], k, w[0], w[1], 1e-6, pos, 64, 1e7)
    tri.kv_write(caches[0], caches[1], kr, v, meta.slot_mapping)
    q = tri.qk_norm_rope_store(qg[..., :256], k, v, w[0], w[1], 1e-6, pos, 64, 1e7, None, fused[0], fused[1],
                               meta.slot_mapping)
    assert torch.equal(q, qr) and torch.equal(fused[0], caches[0]) and torch.equal(fused[1], caches[1])
    got = tri.gated_attention(q, *fused, meta, 256 ** -0.5, qg[..., 256:])
    want = tri.sigmoid_gate(tri.attention(q, *caches, meta, 256 ** -0.5), qg[..., 256:])
    assert torch.equal(got, want)          # the same roundings in the same order
    assert rel(got, ref.gated_attention(q, *caches, meta, 256 ** -0.5, qg[..., 256:])) <= GPU_KERNEL_TOL[dtype]
    xp = tri._memo.find(got.reshape(3 * t, 24 * 256))
    assert xp is not None and torch.equal(xp, x16_ref(got.reshape(3 * t, 24 * 256)))


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gdn_real_heads_gpu(dtype):
    ref, tri = TorchOps(), TritonOps()
    lens, hk, hv, d = [4, 4], 16, 48, 128
    meta, _, _, n_snap = gdn_routing(lens, [1, 3], [True, False], "cuda")
    q, k = (torch.randn(8, hk, d, device="cuda", dtype=dtype) for _ in range(2))
    v = torch.randn(8, hv, d, device="cuda", dtype=dtype)
    g, beta = ref.gdn_gates(torch.randn(8, hv, device="cuda"), torch.randn(8, hv, device="cuda"),
                            torch.zeros(hv, device="cuda"), torch.zeros(hv, device="cuda"))
    pools = [torch.randn(4, hv, d, d, device="cuda") * 0.1 for _ in range(2)]
    pools[1].copy_(pools[0])
    snaps = [torch.zeros(n_snap, hv, d, d, device="cuda") for _ in range(2)]
    want = ref.gdn_recurrent(q, k, v, g, beta, pools[0], meta, snaps[0])
    got = tri.gdn_recurrent(q, k, v, g, beta, pools[1], meta, snaps[1])
    assert rel(got, want) <= GPU_KERNEL_TOL[dtype]
    assert rel(pools[1], pools[0]) <= 1e-5 and rel(snaps[1], snaps[0]) <= 1e-5
    conv_pools = [torch.randn(4, 3, 10240, device="cuda") for _ in range(2)]
    conv_pools[1].copy_(conv_pools[0])
    x, w = torch.randn(8, 10240, device="cuda", dtype=dtype), torch.randn(10240, 4, device="cuda")
    cs = [torch.zeros(n_snap, 3, 10240, device="cuda") for _ in range(2)]
    assert rel(tri.causal_conv(x, w, conv_pools[1], meta, cs[1]),
               ref.causal_conv(x, w, conv_pools[0], meta, cs[0])) <= GPU_KERNEL_TOL[dtype]
    assert rel(conv_pools[1], conv_pools[0]) <= 1e-6 and rel(cs[1], cs[0]) <= 1e-6


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("lens,snap", [([1, 1, 1], [False] * 3), ([4, 4], [True, False])], ids=["decode", "verify"])
def test_gdn_conv_recurrent_real_heads_gpu(dtype, lens, snap, monkeypatch):
    """The fused conv + recurrence at the real head sizes (Hk 16, Hv 48, 128 x 128: 24 programs share each key
    head's q / k windows) against the torch composition, 20 launches in a row on the same pools (a lost or
    early window write would show up in a later launch)."""
    monkeypatch.setenv("NINFER_GDN_FUSED", "1")
    ref, tri = TorchOps(), TritonOps()
    hk, hv, d, c = 16, 48, 128, 10240
    meta, _, _, n_snap = gdn_routing(lens, [1, 3, 0][:len(lens)], snap, "cuda")
    conv = [torch.randn(4, 3, c, device="cuda") for _ in range(2)]
    rec = [torch.randn(4, hv, d, d, device="cuda") * 0.1 for _ in range(2)]
    conv[1].copy_(conv[0])
    rec[1].copy_(rec[0])
    cs = [torch.zeros(max(n_snap, 1), 3, c, device="cuda") for _ in range(2)]
    rs = [torch.zeros(max(n_snap, 1), hv, d, d, device="cuda") for _ in range(2)]
    w = torch.randn(c, 4, device="cuda") * 0.5
    for i in range(20):
        t = sum(lens)
        qkv = torch.randn(t, c + 6144, device="cuda", dtype=dtype)[:, :c]
        g, beta = ref.gdn_gates(torch.randn(t, hv, device="cuda"), torch.randn(t, hv, device="cuda"),
                                torch.zeros(hv, device="cuda"), torch.zeros(hv, device="cuda"))
        want = ref.gdn_conv_recurrent(qkv, w, conv[0], Branch((g, beta)), rec[0], meta, cs[0], rs[0])[0]
        got, done = tri.gdn_conv_recurrent(qkv, w, conv[1], Branch((g, beta)), rec[1], meta, cs[1], rs[1])
        done.join()
        assert rel(got, want) <= GPU_KERNEL_TOL[dtype], i
        assert rel(conv[1], conv[0]) <= 1e-6 and rel(cs[1], cs[0]) <= 1e-6, i     # copies of x rows: exact
        # the states compound 16-bit rounding differences of q / k / v over the launches
        assert rel(rec[1], rec[0]) <= GPU_KERNEL_TOL[dtype] and rel(rs[1], rs[0]) <= GPU_KERNEL_TOL[dtype], i


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gdn_chunk_prefill_gpu(dtype):
    """fla's chunked kernel when importable, our recurrent kernel otherwise; either way == the reference."""
    ref, tri = TorchOps(), TritonOps()
    lens, hk, hv, d = [300, 77], 16, 48, 128
    meta, _, _, _ = gdn_routing(lens, [0, 1], [False, False], "cuda")
    n = sum(lens)
    q, k = (torch.randn(n, hk, d, device="cuda", dtype=dtype) for _ in range(2))
    v = torch.randn(n, hv, d, device="cuda", dtype=dtype)
    g, beta = ref.gdn_gates(torch.randn(n, hv, device="cuda"), torch.randn(n, hv, device="cuda"),
                            torch.zeros(hv, device="cuda"), torch.zeros(hv, device="cuda"))
    pools = [torch.randn(2, hv, d, d, device="cuda") * 0.1 for _ in range(2)]
    pools[1].copy_(pools[0])
    want = ref.gdn_chunk(q, k, v, g, beta, pools[0], meta)
    got = tri.gdn_chunk(q, k, v, g, beta, pools[1], meta)
    assert rel(got, want) <= GPU_CHUNK_TOL[dtype]
    assert rel(pools[1], pools[0]) <= GPU_CHUNK_TOL[dtype]


def test_gates_branch_inline_outside_capture(monkeypatch):
    """Outside CUDA-graph capture (always on the CPU) the gates branch is the plain call: the same (g, beta) as
    the torch backend, for the fused kernel's T and for a T it composes; a bad NINFER_BRANCH (and
    NINFER_GATES_JOIN, NINFER_GDN_FUSED, NINFER_ATTN_MIN_SPLIT, NINFER_NORM_WARPS, NINFER_SPLIT_UNROLL,
    NINFER_X16_ALIGN, NINFER_GEMV_PINS, NINFER_SPLIT_ARRIVE, NINFER_GEMV_EVICT) is a one-line error naming the
    variable when the backend is built."""
    from ninfer_formats.errors import LoadError
    from ninfer_rt.backends import side_stream
    from ninfer_rt.weights import QWeight
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    w = QWeight.plain(torch.randn(12, 40, generator=gen).to(dev), "in_ba")
    A_log, dt = torch.randn(6, generator=gen).to(dev), torch.randn(6, generator=gen).to(dev)
    for t in (1, 17):
        x = torch.randn(t, 40, generator=gen).to(dev)
        got, want = TritonOps().gdn_ba_gates_branch(x, w, A_log, dt).join(), TorchOps().gdn_ba_gates(x, w, A_log, dt)
        for a, b in zip(got, want):
            assert rel(a, b) <= 1e-5
    assert side_stream.branch(lambda: 7).join() == 7
    monkeypatch.setenv("NINFER_BRANCH", "yes")
    with pytest.raises(LoadError, match="NINFER_BRANCH='yes'"):
        TritonOps()
    monkeypatch.setenv("NINFER_BRANCH", "1")
    monkeypatch.setenv("NINFER_GATES_JOIN", "late")
    with pytest.raises(LoadError, match="NINFER_GATES_JOIN='late'"):
        TritonOps()
    monkeypatch.setenv("NINFER_GATES_JOIN", "conv")
    monkeypatch.setenv("NINFER_GDN_FUSED", "on")
    with pytest.raises(ValueError, match="NINFER_GDN_FUSED='on'"):
        TritonOps()
    monkeypatch.setenv("NINFER_GDN_FUSED", "0")
    for bad in ("48", "0", "x"):
        monkeypatch.setenv("NINFER_ATTN_MIN_SPLIT", bad)
        with pytest.raises(ValueError, match=f"NINFER_ATTN_MIN_SPLIT='{bad}': expected a positive multiple of 32"):
            TritonOps()
    monkeypatch.delenv("NINFER_ATTN_MIN_SPLIT")
    for bad in ("3", "64", "x"):
        monkeypatch.setenv("NINFER_NORM_WARPS", bad)
        with pytest.raises(ValueError, match=f"NINFER_NORM_WARPS='{bad}': expected auto or a power of two"):
            TritonOps()
    monkeypatch.delenv("NINFER_NORM_WARPS")
    for name, bad, want in (("NINFER_SPLIT_UNROLL", "8", "expected 4 (the default), 2 or 1"),
                            ("NINFER_X16_ALIGN", "4", "expected 16 (the default) or 1"),
                            ("NINFER_GEMV_PINS", "/no/such/pins.json", "unreadable ("),
                            ("NINFER_SPLIT_ARRIVE", "relaxed", "expected release (the default) or acq_rel"),
                            ("NINFER_GEMV_EVICT", "last", "expected nvfp4 (the default), normal or first")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(LoadError, match=f"{name}='{bad}': {re.escape(want)}"):
            TritonOps()
        monkeypatch.delenv(name)


@gpu
@pytest.mark.parametrize("on", ["1", "0"], ids=["branch", "inline"])
def test_branch_in_captured_graph_gpu(on, monkeypatch):
    """A branch captured on the side stream joins before its result is used: the replayed graph computes
    (2 x) + (x + 1) for fresh inputs, whether the branch forked (NINFER_BRANCH=1) or ran in line."""
    from ninfer_rt.backends import side_stream
    monkeypatch.setenv("NINFER_BRANCH", on)
    x = torch.randn(4096, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            side = side_stream.branch(lambda: x * 2)
            main = x + 1
            out = side.join() + main
    for seed in range(3):
        x.copy_(torch.randn(4096, generator=torch.Generator().manual_seed(seed)).cuda())
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, 2 * x + (x + 1))
