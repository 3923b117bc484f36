"""Prefill-only fast paths of the Triton backend, checked on CPU against the torch reference: the SDPA
attention of long chunks (ninfer_rt/backends/prefill_attn.py) and the prefill path choice of
ninfer_kernels.dispatch. The CUDA checks (the path TritonOps really takes there) skip without a GPU."""
from __future__ import annotations

import pytest
import torch

from ninfer_formats.errors import LoadError
from ninfer_rt.backends import prefill_attn
from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.batch import attn_meta
from numerics import rel

ATTN_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
PAGE = 16
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _case(prior, new, hq, hk, d, dtype, device, seed=0):
    """Sequences with `prior` cached and `new` tokens; pages of different sequences interleaved."""
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
    kc = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    vc = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    q = torch.randn(sum(new), hq, d, generator=g).to(device=device, dtype=dtype)
    return q, kc, vc, meta


@pytest.mark.parametrize("prior,new,hq,hk,d", [
    ((0,), (37,), 6, 2, 32),               # fresh chunk, GQA 3
    ((0, 0), (19, 53), 4, 4, 16),          # two fresh sequences, no GQA
    ((45,), (21,), 8, 2, 24),              # second chunk: bottom-right causal over cached keys
    ((0, 70, 3), (33, 17, 40), 6, 3, 8),   # mixed: fresh, long context, short context
], ids=["fresh_gqa3", "two_fresh", "context", "mixed"])
def test_prefill_attention_matches_reference(prior, new, hq, hk, d):
    q, kc, vc, meta = _case(prior, new, hq, hk, d, torch.float32, "cpu")
    q = q.transpose(0, 1).contiguous().transpose(0, 1)        # a strided view, as the model hands in
    want = TorchOps().attention(q, kc, vc, meta, d ** -0.5)
    got = prefill_attn.prefill_attention(q, kc, vc, meta, d ** -0.5)
    assert rel(got, want) <= ATTN_TOL[torch.float32]


def test_mode_rejects_unknown_value(monkeypatch):
    monkeypatch.setenv("NINFER_PREFILL_ATTN", "flash")
    with pytest.raises(LoadError, match="NINFER_PREFILL_ATTN='flash'"):
        prefill_attn.mode()


def test_cpu_never_takes_sdpa(monkeypatch):
    q, kc, vc, meta = _case((0,), (300,), 4, 2, 8, torch.float32, "cpu")
    monkeypatch.setenv("NINFER_PREFILL_ATTN", "sdpa")
    assert not prefill_attn.wants_sdpa(q, meta)


@gpu
@pytest.mark.parametrize("prior,new", [((0,), (1031,)), ((700,), (512,)), ((0, 0), (300, 257))],
                         ids=["fresh", "context", "two_fresh"])
def test_triton_ops_attention_sdpa_gpu(prior, new, monkeypatch):
    from ninfer_rt.backends.triton_ops import TritonOps
    q, kc, vc, meta = _case(prior, new, 24, 4, 256, torch.bfloat16, "cuda")
    assert prefill_attn.wants_sdpa(q, meta)
    got = TritonOps().attention(q, kc, vc, meta, 256 ** -0.5)
    assert (q.dtype, q.device) not in prefill_attn._REFUSED        # SDPA really ran
    monkeypatch.setenv("NINFER_PREFILL_ATTN", "paged")
    paged = TritonOps().attention(q, kc, vc, meta, 256 ** -0.5)
    want = TorchOps().attention(q, kc, vc, meta, 256 ** -0.5)
    assert rel(got, want) <= ATTN_TOL[torch.bfloat16] and rel(paged, want) <= ATTN_TOL[torch.bfloat16]


class _Shape:
    """What the prefill path choice reads of a weight."""

    def __init__(self, n, k):
        self.shape, self.fmt = (n, k), "nvfp4"


@pytest.mark.parametrize("forced", ["fused", "dequant"])
def test_prefill_path_forced_by_env(forced, monkeypatch):
    from ninfer_kernels import dispatch
    monkeypatch.setenv("NINFER_PREFILL_PATH", forced)
    assert dispatch._choose_prefill(torch.zeros(33, 64), _Shape(48, 64), None) == forced


def test_prefill_path_env_rejects_unknown(monkeypatch):
    from ninfer_kernels import dispatch
    from ninfer_kernels.gemv_launch import KernelInputError
    monkeypatch.setenv("NINFER_PREFILL_PATH", "cublas")
    with pytest.raises(KernelInputError, match="NINFER_PREFILL_PATH='cublas'"):
        dispatch._choose_prefill(torch.zeros(33, 64), _Shape(48, 64), None)


def test_prefill_path_untimed_off_cuda_is_fused(monkeypatch):
    from ninfer_kernels import dispatch
    monkeypatch.delenv("NINFER_PREFILL_PATH", raising=False)
    monkeypatch.setenv("NINFER_GEMV_TUNE", "0")
    assert dispatch._choose_prefill(torch.zeros(33, 5120), _Shape(14336, 5120), None) == "fused"


@gpu
@pytest.mark.parametrize("n,want", [(14336, "dequant"), (248320 * 2, "fused")], ids=["layer", "huge"])
def test_prefill_path_untimed_on_cuda(n, want, monkeypatch):
    from ninfer_kernels import dispatch
    monkeypatch.delenv("NINFER_PREFILL_PATH", raising=False)
    monkeypatch.setenv("NINFER_GEMV_TUNE", "0")
    x = torch.zeros(33, 5120, dtype=torch.bfloat16, device="cuda")
    assert dispatch._choose_prefill(x, _Shape(n, 5120), None) == want
