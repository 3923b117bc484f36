"""Q6_K / IQ3_S weights whose GGML blocks the triton backend released after repacking (kernels/dispatch.py
`release_blocks`, on CUDA): one copy of the bytes on the device, and every path that reads GGML rows (the torch
reference's dequantize, row slicing, embedding rows, fusion, moves) gets them back bit-exact from the planes."""
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gemv_inputs import random_ggml_blocks  # noqa: E402
from ninfer_kernels import dispatch, reference  # noqa: E402
from ninfer_kernels.gemv_iq3_s import BLOCK_BYTES as IQ3_S_BYTES, repack_iq3_s, unpack_iq3_s  # noqa: E402
from ninfer_kernels.gemv_q6_k import BLOCK_BYTES as Q6_K_BYTES, repack_q6_k, unpack_q6_k  # noqa: E402
from ninfer_rt.weights import QWeight, dequantize  # noqa: E402

FORMATS = {"q6_k": (Q6_K_BYTES, repack_q6_k, unpack_q6_k), "iq3_s": (IQ3_S_BYTES, repack_iq3_s, unpack_iq3_s)}
N, K = 13, 512


def random_blocks(fmt: str) -> torch.Tensor:
    return random_ggml_blocks(fmt, N, K, 0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_unpack_inverts_repack(fmt):
    _, repack, unpack = FORMATS[fmt]
    b = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (7, 3 * FORMATS[fmt][0]), dtype=np.uint8))
    planes = repack(b, 768)
    assert torch.equal(unpack(planes), b)
    rows = torch.tensor([5, 0, 5, 2])
    assert torch.equal(unpack(planes, rows), b[rows])


@pytest.mark.parametrize("fmt", FORMATS)
def test_released_weight_keeps_every_path(fmt):
    blocks = random_blocks(fmt)
    qw, twin = QWeight(fmt, (N, K), {"blocks": blocks.clone()}, "w"), QWeight(fmt, (N, K), {"blocks": blocks}, "w")
    x = torch.randn(3, K)
    y = dispatch.linear(x, qw)                  # on CPU the blocks stay (nothing to save in host memory)
    assert not qw.released and qw.data["blocks"] is not None
    planes = dispatch._packed(qw)
    dispatch.release_blocks(qw, planes)
    assert qw.released and qw.data["blocks"] is None and qw.device == blocks.device
    assert sum(t.nbytes for t in qw.stored_tensors()) == blocks.nbytes      # the planes: the same bytes, once
    assert torch.equal(qw.blocks(), blocks)
    assert torch.equal(dispatch.linear(x, qw), y)                           # the kernels read the planes
    assert torch.equal(dequantize(qw), dequantize(twin))                    # the torch reference path
    assert torch.equal(reference.ref_linear(x, fmt, qw), reference.ref_linear(x, fmt, twin.data))
    idx = torch.tensor([4, 4, 0, 12])
    assert torch.equal(qw.select_rows(idx).data["blocks"], blocks[idx])     # embedding rows
    assert torch.equal(qw.rows(2, 9).data["blocks"], blocks[2:9])           # TP / tied-head slices
    fused = QWeight.concat_rows([qw, twin], "fused")
    assert torch.equal(fused.data["blocks"], torch.cat([blocks, blocks])) and fused.shape == (2 * N, K)
    assert torch.equal(qw.to("cpu").data["blocks"], blocks)
    qw.release_blocks([], None)                 # a second release changes nothing
    assert torch.equal(qw.blocks(), blocks)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the release happens for CUDA weights only")
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_repack_releases_the_blocks(fmt):
    blocks = random_blocks(fmt).cuda()
    qw = QWeight(fmt, (N, K), {"blocks": blocks.clone()}, "w")
    x = torch.randn(2, K, device="cuda")
    y = dispatch.linear(x, qw)
    assert qw.released and torch.equal(qw.blocks(), blocks)
    assert torch.equal(dispatch.linear(x, qw), y)
