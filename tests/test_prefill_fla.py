"""The fla chunked-GDN wrapper of the Triton backend (ninfer_rt/backends/fla_gdn.py) on CPU: driven by torch
stand-ins with fla's two calling conventions (fla >= 0.4 with GVA, in-kernel l2norm and host offsets; older
fla without them), since fla itself must never import in a CPU test; compared with the torch reference's
chunked delta rule. Also when TritonOps routes a chunk to it (CUDA, 16-bit, not under graph capture) and the
once-per-process note when fla is missing."""
from __future__ import annotations

import sys

import pytest
import torch

from ninfer_rt.backends import fla_gdn
from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.backends.triton_ops import TritonOps
from ninfer_rt.batch import gdn_routing
from numerics import rel

# fla wrapper vs the reference: q, k, v arrive in 16 bits and (old fla API) q, k are normalised to 16 bits
FLA_TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}
RECURRENT_FP32_TOL = 1e-5  # the Triton recurrent kernel (interpreter, fp32) vs the reference's chunked form
CUDA0 = torch.device("cuda", 0)
DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16"}


@pytest.fixture
def fresh_load():
    """No remembered fla import, before and after the test."""
    load = fla_gdn.load            # a test may replace the module attribute; the cache lives on this one
    load.cache_clear()
    yield
    load.cache_clear()


def _l2(x):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _delta_rule(q, k, v, g, beta, scale, initial_state, cu):
    """fla's forward semantics, token by token in fp32 over the packed row [1, T, ...]: value head h reads
    key head h // (HV / H) (fla's GVA indexing)."""
    kv_head = torch.arange(v.shape[2]) // (v.shape[2] // q.shape[2])
    o, final = torch.empty(v.shape), initial_state.float().clone()
    bounds = cu.tolist()
    for n in range(len(bounds) - 1):
        S = final[n]
        for t in range(bounds[n], bounds[n + 1]):
            qt, kt = q[0, t, kv_head].float() * scale, k[0, t, kv_head].float()
            S = S * g[0, t].float().exp()[:, None, None]
            err = v[0, t].float() - torch.einsum("hkv,hk->hv", S, kt)
            S = S + kt[:, :, None] * (beta[0, t].float()[:, None] * err)[:, None, :]
            o[0, t] = torch.einsum("hkv,hk->hv", S, qt)
        final[n] = S
    return o.to(v.dtype), final


class _FlaStandIn:
    """Records the offsets tensors it was handed and checks what fla itself would check."""

    def __init__(self):
        self.offsets = []

    def _check(self, q, k, v, cu):
        assert q.dtype == k.dtype == v.dtype and v.dtype != torch.float32 and q.shape[0] == 1
        assert cu.dtype == torch.int64
        self.offsets.append(cu)

    def new_api(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None):
        """v: values of shape `[B, T, HV, V]`. GVA is applied if `HV > H`."""
        self._check(q, k, v, cu_seqlens)
        assert torch.equal(cu_seqlens_cpu, cu_seqlens.cpu()) and cu_seqlens_cpu.device.type == "cpu"
        assert q.shape[2] < v.shape[2]                 # GVA: the key heads went in unrepeated
        if use_qk_l2norm_in_kernel:
            q, k = _l2(q), _l2(k)
        return _delta_rule(q, k, v, g, beta, scale, initial_state, cu_seqlens)

    def old_api(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                cu_seqlens=None):
        """v: values of shape `[B, T, H, V]`."""
        self._check(q, k, v, cu_seqlens)
        assert q.shape[2] == k.shape[2] == v.shape[2]   # no grouped values before fla 0.4
        return _delta_rule(q, k, v, g, beta, scale, initial_state, cu_seqlens)


def _gdn_case(lens, hk, hv, dk, dv, dtype, seed=1):
    g_ = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q, k = (torch.randn(n, hk, dk, generator=g_).to(dtype) for _ in range(2))
    v = torch.randn(n, hv, dv, generator=g_).to(dtype)
    g, beta = TorchOps().gdn_gates(torch.randn(n, hv, generator=g_), torch.randn(n, hv, generator=g_),
                                   torch.randn(hv, generator=g_) * 0.5, torch.zeros(hv))
    pool = torch.randn(len(lens) + 2, hv, dk, dv, generator=g_) * 0.1
    slots = [len(lens) + 1 - b for b in range(len(lens))]         # reversed, one slot left untouched
    meta = gdn_routing(list(lens), slots, [False] * len(lens), "cpu")[0]
    return (q, k, v, g, beta), pool, meta


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("api", ["new_api", "old_api"])
def test_fla_wrapper_matches_reference(api, dtype):
    fake = _FlaStandIn()
    chunk = fla_gdn.FlaChunk(getattr(fake, api))
    assert (chunk.gva, chunk.l2norm_in_kernel, chunk.host_offsets) == ((True,) * 3 if api == "new_api" else
                                                                      (False,) * 3)
    args, pool, meta = _gdn_case((37, 5, 20), 2, 6, 8, 16, dtype)
    want_pool, got_pool = pool.clone(), pool.clone()
    want = TorchOps().gdn_chunk(*args, want_pool, meta)
    got = chunk(*args, got_pool, meta)
    assert got.dtype == dtype and rel(got, want) <= FLA_TOL[dtype]
    assert rel(got_pool, want_pool) <= FLA_TOL[dtype]
    assert torch.equal(got_pool[0], pool[0])                     # a slot outside the batch
    chunk(*args, pool.clone(), meta)                             # the next layer of the same forward
    other = gdn_routing([37, 5, 20], [3, 2, 1], [False] * 3, "cpu")[0]
    chunk(*args, pool.clone(), other)                            # the next forward
    assert fake.offsets[1] is fake.offsets[0] and fake.offsets[2] is not fake.offsets[0]


@pytest.mark.parametrize("device,dtype,capturing,want", [
    (CUDA0, torch.bfloat16, False, True),
    (CUDA0, torch.float16, False, True),
    (CUDA0, torch.float32, False, False),
    (torch.device("cpu"), torch.bfloat16, False, False),
    (CUDA0, torch.bfloat16, True, False),
], ids=["cuda_bf16", "cuda_fp16", "cuda_fp32", "cpu", "capture"])
def test_fla_route(device, dtype, capturing, want, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    assert fla_gdn.wanted(device, dtype) is want


def test_triton_ops_gdn_chunk_uses_fla_when_routed(monkeypatch, fresh_load):
    fake = _FlaStandIn()
    monkeypatch.setattr(fla_gdn, "wanted", lambda device, dtype: True)
    monkeypatch.setattr(fla_gdn, "load", lambda: fla_gdn.FlaChunk(fake.new_api))
    args, pool, meta = _gdn_case((30, 9), 2, 4, 8, 8, torch.float16)
    want_pool, got_pool = pool.clone(), pool.clone()
    got = TritonOps().gdn_chunk(*args, got_pool, meta)
    assert len(fake.offsets) == 1
    assert rel(got, TorchOps().gdn_chunk(*args, want_pool, meta)) <= FLA_TOL[torch.float16]


def test_missing_fla_said_once_per_process(monkeypatch, capsys, fresh_load):
    """Two backends (e.g. two models in one benchmark process) each run a chunked GDN call that would take
    fla: one stderr line, and both fall back to the recurrent kernel with the reference's result."""
    for mod in ("fla", "fla.ops.gated_delta_rule"):        # the submodule too: a GPU run may have loaded it
        monkeypatch.setitem(sys.modules, mod, None)
    monkeypatch.setattr(fla_gdn, "wanted", lambda device, dtype: True)
    args, pool, meta = _gdn_case((5, 3), 1, 2, 8, 8, torch.float32)
    want = TorchOps().gdn_chunk(*args, pool.clone(), meta)
    a, b = TritonOps(), TritonOps()
    assert a.gdn_prefill_impl() is None
    for ops in (a, b):
        assert rel(ops.gdn_chunk(*args, pool.clone(), meta), want) <= RECURRENT_FP32_TOL
    assert a.gdn_prefill_impl() == b.gdn_prefill_impl() == "recurrent"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "flash-linear-attention (fla) is not importable" in err[0]
