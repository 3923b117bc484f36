"""Prefill-only fast paths of the Triton backend, checked on CPU against the torch reference: the SDPA
attention of long chunks (ninfer_rt/backends/prefill_attn.py) with its routing rules (CPU / CUDA-graph
capture / env switch / refused dtypes) and fallbacks, the env switches' errors, and the prefill path choice of
ninfer_kernels.dispatch (the fla GDN wrapper: test_prefill_fla.py). The CUDA checks (the path TritonOps really
takes there, and a CUDA-graph capture) skip without a GPU."""
from __future__ import annotations

import pytest
import torch

from ninfer_formats.errors import NinferError
from ninfer_rt.backends import prefill_attn
from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.backends.triton_ops import TritonOps
from ninfer_rt.batch import attn_meta
from numerics import rel

ATTN_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
PAGE = 16
CUDA0 = torch.device("cuda", 0)
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _case(prior, new, hq, hk, d, dtype, device, seed=0):
    """Sequences with `prior` cached and `new` tokens; pages of different sequences interleaved, and every
    cache slot outside a sequence's keys (unowned pages, the last page's tail) holding NaN."""
    g = torch.Generator().manual_seed(seed)
    kv = [p + n for p, n in zip(prior, new)]
    need = [-(-n // PAGE) for n in kv]
    order = torch.randperm(sum(need) + 3, generator=g).tolist()
    pages, at = [], 0
    for n in need:
        pages.append(order[at:at + n])
        at += n
    meta = attn_meta(pages, list(prior), list(new), PAGE, device)
    shape = (sum(need) + 3, PAGE, hk, d)
    live = torch.zeros(shape[:2], dtype=torch.bool)
    for pg, n in zip(pages, kv):
        live.view(-1)[(torch.tensor(pg)[:, None] * PAGE + torch.arange(PAGE)).flatten()[:n]] = True
    kc, vc = (torch.randn(shape, generator=g).masked_fill(~live[..., None, None], float("nan"))
              .to(device=device, dtype=dtype) for _ in range(2))
    q = torch.randn(sum(new), hq, d, generator=g).to(device=device, dtype=dtype)
    return q, kc, vc, meta


@pytest.fixture
def fresh_state(monkeypatch):
    """Empty refusal / said-once sets for the test."""
    monkeypatch.setattr(prefill_attn, "_REFUSED", set())
    monkeypatch.setattr(prefill_attn, "_SAID", set())


# ---- attention: numerics ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("prior,new,hq,hk,d", [
    ((0,), (37,), 6, 2, 32),               # fresh chunk, GQA 3
    ((0, 0), (19, 53), 4, 4, 16),          # two fresh sequences, no GQA
    ((45,), (21,), 8, 2, 24),              # second chunk: bottom-right causal over cached keys
    ((0, 70, 3), (33, 17, 40), 6, 3, 8),   # mixed: fresh, long context, short context
], ids=["fresh_gqa3", "two_fresh", "context", "mixed"])
def test_prefill_attention_matches_reference(prior, new, hq, hk, d, dtype):
    q, kc, vc, meta = _case(prior, new, hq, hk, d, dtype, "cpu")
    q = q.transpose(0, 1).contiguous().transpose(0, 1)        # a strided view, as the model hands in
    want = TorchOps().attention(q, kc, vc, meta, d ** -0.5)
    got = prefill_attn.prefill_attention(q, kc, vc, meta, d ** -0.5)
    assert got.dtype == dtype and not got.isnan().any()
    assert rel(got, want) <= ATTN_TOL[dtype]


def test_later_chunk_last_query_sees_every_key():
    """Independent of the reference: the last new token of a later chunk attends to all L keys, the first
    one to the cached keys and itself (bottom-right causal alignment)."""
    prior, new, h, d = 45, 21, 2, 16
    q, kc, vc, meta = _case((prior,), (new,), h, h, d, torch.float32, "cpu")
    got = prefill_attn.prefill_attention(q, kc, vc, meta, d ** -0.5)
    pages = meta.block_tables[0].long()
    k, v = (c.index_select(0, pages).flatten(0, 1)[:prior + new] for c in (kc, vc))

    def full(row, n):
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[row], k[:n]) * d ** -0.5, dim=-1)
        return torch.einsum("hl,lhd->hd", p, v[:n])
    assert rel(got[-1], full(new - 1, prior + new)) <= ATTN_TOL[torch.float32]
    assert rel(got[0], full(0, prior + 1)) <= ATTN_TOL[torch.float32]


# ---- attention: routing ----

def _meta(lens, kv_extra=0):
    pages = [list(range(-(-(n + kv_extra) // PAGE))) for n in lens]
    return attn_meta(pages, [kv_extra] * len(lens), list(lens), PAGE, "cpu")


@pytest.mark.parametrize("mode,device,lens,kv_extra,capturing,want", [
    ("auto", CUDA0, (256,), 0, False, True),
    ("auto", CUDA0, (255,), 0, False, False),                       # short chunk: paged kernel
    ("auto", CUDA0, (300, 1), 0, False, False),                     # a decode row in the batch
    ("auto", CUDA0, (300,), prefill_attn.SDPA_MAX_KV, False, False),  # context too long to gather
    ("auto", CUDA0, (300,), 0, True, False),                        # CUDA-graph capture
    ("sdpa", CUDA0, (1,), 0, False, True),
    ("sdpa", CUDA0, (300,), 0, True, False),                        # capture wins over the forced mode
    ("sdpa", torch.device("cpu"), (300,), 0, False, False),
    ("paged", CUDA0, (1000,), 0, False, False),
], ids=["auto_long", "auto_short", "auto_mixed", "auto_long_kv", "auto_capture", "sdpa_decode",
        "sdpa_capture", "sdpa_cpu", "paged"])
def test_sdpa_route(mode, device, lens, kv_extra, capturing, want, monkeypatch, fresh_state):
    monkeypatch.setenv("NINFER_PREFILL_ATTN", mode)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    assert prefill_attn.wants_sdpa(device, torch.bfloat16, _meta(lens, kv_extra)) is want


def test_sdpa_route_skips_refused_dtype(monkeypatch, fresh_state):
    monkeypatch.setenv("NINFER_PREFILL_ATTN", "sdpa")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    prefill_attn._REFUSED.add((torch.float32, CUDA0))
    assert not prefill_attn.wants_sdpa(CUDA0, torch.float32, _meta((300,)))
    assert prefill_attn.wants_sdpa(CUDA0, torch.bfloat16, _meta((300,)))


@pytest.mark.parametrize("error,refused", [
    (RuntimeError("No available kernel. Aborting execution.\nflash: head_dim"), True),
    (torch.OutOfMemoryError("CUDA out of memory"), False),
], ids=["no_backend", "oom"])
def test_try_prefill_attention_falls_back_and_says_once(error, refused, monkeypatch, capsys, fresh_state):
    def boom(*a):
        raise error
    monkeypatch.setattr(prefill_attn, "prefill_attention", boom)
    q, kc, vc, meta = _case((0,), (20,), 2, 2, 8, torch.float32, "cpu")
    for _ in range(3):
        assert prefill_attn.try_prefill_attention(q, kc, vc, meta, 0.3) is None
    assert ((q.dtype, q.device) in prefill_attn._REFUSED) is refused
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "paged kernel runs instead" in err[0]


def test_try_prefill_attention_raises_device_faults(monkeypatch, fresh_state):
    def boom(*a):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(prefill_attn, "prefill_attention", boom)
    q, kc, vc, meta = _case((0,), (20,), 2, 2, 8, torch.float32, "cpu")
    with pytest.raises(torch.AcceleratorError):
        prefill_attn.try_prefill_attention(q, kc, vc, meta, 0.3)
    assert not prefill_attn._REFUSED


def test_triton_ops_attention_takes_sdpa_when_routed(monkeypatch, fresh_state):
    """The TritonOps glue: a routed batch runs prefill_attention (restricted to the fast backends) once."""
    calls = []
    real = prefill_attn.prefill_attention
    monkeypatch.setattr(prefill_attn, "wants_sdpa", lambda device, dtype, meta: True)
    monkeypatch.setattr(prefill_attn, "prefill_attention", lambda *a: calls.append(1) or real(*a))
    q, kc, vc, meta = _case((30, 0), (40, 25), 6, 2, 16, torch.float32, "cpu")
    got = TritonOps().attention(q, kc, vc, meta, 0.25)
    assert calls == [1] and not prefill_attn._REFUSED
    assert rel(got, TorchOps().attention(q, kc, vc, meta, 0.25)) <= ATTN_TOL[torch.float32]


# ---- env switches ----

@pytest.mark.parametrize("var,value,allowed", [
    ("NINFER_PREFILL_ATTN", "flash", "auto, paged, sdpa"),
    ("NINFER_PREFILL_PATH", "cublas", "auto, fused, dequant"),
], ids=["attn", "path"])
def test_bad_env_value_fails_at_backend_start(var, value, allowed, monkeypatch):
    monkeypatch.setenv(var, value)
    with pytest.raises(NinferError) as e:
        TritonOps()
    msg = str(e.value)
    assert "\n" not in msg and f"{var}={value!r}" in msg and msg.endswith(allowed)


def test_bad_attn_env_value_is_not_ignored_on_cpu(monkeypatch):
    monkeypatch.setenv("NINFER_PREFILL_ATTN", "Paged")
    with pytest.raises(NinferError, match="NINFER_PREFILL_ATTN='Paged'"):
        prefill_attn.wants_sdpa(torch.device("cpu"), torch.float32, _meta((300,)))


# ---- dispatch: prefill GEMM path ----

class _Shape:
    """What the prefill path choice reads of a weight."""

    def __init__(self, n, k):
        self.shape, self.fmt = (n, k), "nvfp4"


@pytest.mark.parametrize("forced", ["fused", "dequant"])
def test_prefill_path_forced_by_env(forced, monkeypatch):
    from ninfer_kernels import dispatch
    monkeypatch.setenv("NINFER_PREFILL_PATH", forced)
    assert dispatch._choose_prefill(torch.zeros(33, 64), _Shape(48, 64), None) == forced


@pytest.mark.parametrize("n, k, item, want", [
    (14336, 5120, 2, "dequant"),            # a 27B attention q/k/v/gate weight: 147 MB dense
    (32768, 16384, 2, "dequant"),           # exactly DENSE_COPY_MAX (2**30 bytes)
    (32768, 16385, 2, "fused"),             # one column more
    (248320, 5120, 4, "fused"),             # lm_head with fp32 activations: 5 GB dense
], ids=["attn_qkv", "at-limit", "over-limit", "lm_head-fp32"])
def test_untimed_prefill_path_size_rule(n, k, item, want):
    from ninfer_kernels import dispatch
    assert dispatch.untimed_prefill_path(n, k, item) == want


def test_prefill_path_env_rejects_unknown(monkeypatch):
    from ninfer_kernels import dispatch
    from ninfer_kernels.gemv_launch import KernelInputError
    monkeypatch.setenv("NINFER_PREFILL_PATH", "cublas")
    with pytest.raises(KernelInputError, match="NINFER_PREFILL_PATH='cublas': expected one of auto, fused, dequant"):
        dispatch._choose_prefill(torch.zeros(33, 64), _Shape(48, 64), None)


def test_prefill_path_off_cuda_is_fused(monkeypatch):
    """No CUDA timing on the interpreter, with or without NINFER_GEMV_TUNE=0: the fused kernel."""
    from ninfer_kernels import dispatch
    monkeypatch.delenv("NINFER_PREFILL_PATH", raising=False)
    for tune in ("0", "1"):
        monkeypatch.setenv("NINFER_GEMV_TUNE", tune)
        assert dispatch._choose_prefill(torch.zeros(33, 5120), _Shape(14336, 5120), None) == "fused"


# ---- CUDA: the path TritonOps really takes ----

@gpu
@pytest.mark.parametrize("prior,new", [((0,), (1031,)), ((700,), (512,)), ((0, 0), (300, 257))],
                         ids=["fresh", "context", "two_fresh"])
def test_triton_ops_attention_sdpa_gpu(prior, new, monkeypatch, fresh_state):
    q, kc, vc, meta = _case(prior, new, 24, 4, 256, torch.bfloat16, "cuda")
    calls = []
    real = prefill_attn.prefill_attention
    monkeypatch.setattr(prefill_attn, "prefill_attention", lambda *a: calls.append(1) or real(*a))
    assert prefill_attn.wants_sdpa(q.device, q.dtype, meta)
    got = TritonOps().attention(q, kc, vc, meta, 256 ** -0.5)
    assert calls == [1] and not prefill_attn._SAID               # SDPA ran and did not fall back
    monkeypatch.setenv("NINFER_PREFILL_ATTN", "paged")
    paged = TritonOps().attention(q, kc, vc, meta, 256 ** -0.5)
    want = TorchOps().attention(q, kc, vc, meta, 256 ** -0.5)
    assert rel(got, want) <= ATTN_TOL[torch.bfloat16] and rel(paged, want) <= ATTN_TOL[torch.bfloat16]


@gpu
def test_attention_in_graph_capture_is_paged_gpu(monkeypatch, fresh_state):
    """NINFER_PREFILL_ATTN=sdpa, yet the captured graph holds the paged kernel (replayed, it gives the
    reference's output); SDPA would bake this batch's host-side lengths into the graph."""
    q, kc, vc, meta = _case((40,), (300,), 8, 2, 128, torch.bfloat16, "cuda")
    ops = TritonOps()
    monkeypatch.setenv("NINFER_PREFILL_ATTN", "paged")
    ops.attention(q, kc, vc, meta, 0.1)                          # compiles the paged kernel outside capture
    monkeypatch.setenv("NINFER_PREFILL_ATTN", "sdpa")

    def forbidden(*a):
        raise AssertionError("SDPA ran inside a CUDA-graph capture")
    monkeypatch.setattr(prefill_attn, "prefill_attention", forbidden)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = ops.attention(q, kc, vc, meta, 0.1)
    graph.replay()
    torch.cuda.synchronize()
    assert rel(got, TorchOps().attention(q, kc, vc, meta, 0.1)) <= ATTN_TOL[torch.bfloat16]


@gpu
@pytest.mark.parametrize("n,want", [(14336, "dequant"), (248320 * 2, "fused")], ids=["layer", "huge"])
def test_prefill_path_untimed_on_cuda(n, want, monkeypatch):
    from ninfer_kernels import dispatch
    monkeypatch.delenv("NINFER_PREFILL_PATH", raising=False)
    monkeypatch.setenv("NINFER_GEMV_TUNE", "0")
    x = torch.zeros(33, 5120, dtype=torch.bfloat16, device="cuda")
    assert dispatch._choose_prefill(x, _Shape(n, 5120), None) == want
