"""The Triton top-W selection (ninfer_kernels.topk_select) against its torch reference (a stable descending sort):
the same values and columns, ties in column order, at odd sizes with zeros and tied runs; under the interpreter
on CPU (small first-stage blocks: its sort is slow), on the GPU at the 27B vocabulary. Through
`sampling_rows.select_top` with NINFER_TOPK_KERNEL=1 on CUDA; the variable's errors."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from ninfer_formats.errors import NinferError  # noqa: E402
from ninfer_kernels.ops_common import KernelInputError  # noqa: E402
from ninfer_kernels.topk_select import reference, topk_rows  # noqa: E402
from ninfer_rt import sampling_rows  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rows(r: int, v: int, seed: int) -> torch.Tensor:
    x = torch.rand(r, v, generator=torch.Generator().manual_seed(seed))
    x[0, : v // 5] = 0.0                            # zero probabilities (a truncated row)
    x[:, 7:19] = x[:, 7:8].clone()                  # a tied run: lower columns first
    return x.to(DEV)


@pytest.mark.parametrize("r,v,w,block", [(1, 1003, 64, 128), (3, 777, 20, 64), (2, 300, 64, 64), (2, 901, 7, 32)],
                         ids=["one-row", "odd-vocab", "width-is-block", "narrow"])
def test_topk_rows_is_the_stable_sort(r, v, w, block):
    x = _rows(r, v, v)
    got, cols = topk_rows(x, w, block)
    want, want_cols = reference(x, w)
    assert torch.equal(got, want) and torch.equal(cols, want_cols)
    assert not got.isnan().any()


def test_topk_rows_rejects_what_it_cannot_select():
    with pytest.raises(KernelInputError, match="topk_rows: float32 rows"):
        topk_rows(torch.zeros(1, 10, device=DEV), 11)
    with pytest.raises(KernelInputError, match="topk_rows: float32 rows"):
        topk_rows(torch.zeros(1, 100, dtype=torch.float16, device=DEV), 8)


def test_topk_kernel_variable(monkeypatch):
    assert sampling_rows.topk_kernel() is False
    monkeypatch.setenv("NINFER_TOPK_KERNEL", "1")
    assert sampling_rows.topk_kernel() is True
    monkeypatch.setenv("NINFER_TOPK_KERNEL", "yes")
    with pytest.raises(NinferError, match="NINFER_TOPK_KERNEL='yes': expected 0"):
        sampling_rows.topk_kernel()


@gpu
@pytest.mark.parametrize("r", [1, 4], ids=["draft-step", "verdict"])
def test_select_top_through_the_kernel_gpu(monkeypatch, r):
    """At the 27B vocabulary: the kernel's selection is the stable sort's, and `processed` keeps torch.topk's
    distributions (the same values; tied columns may differ)."""
    monkeypatch.setenv("NINFER_TOPK_KERNEL", "1")
    x = _rows(r, 248320, 5)
    got, cols = sampling_rows.select_top(x, 64)
    want, want_cols = reference(x, 64)
    assert torch.equal(got, want) and torch.equal(cols, want_cols)
    logits = torch.randn(r, 248320, device=DEV) * 3
    prm = torch.tensor([[0.8, 20.0, 0.95, 0.0]] * r, device=DEV)
    mine = sampling_rows.processed(logits, prm)
    monkeypatch.setenv("NINFER_TOPK_KERNEL", "0")
    assert torch.allclose(mine, sampling_rows.processed(logits, prm), atol=1e-7)
