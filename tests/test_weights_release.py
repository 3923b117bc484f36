"""NVFP4 / Q6_K / IQ3_S weights whose stored tensors the triton backend released after repacking (kernels/dispatch.py
`release`, on CUDA): one copy of the bytes on the device, and every path that reads the stored layout (the torch
reference's dequantize, row slicing, embedding rows, fusion, moves) gets it back bit-exact from the planes."""
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gemv_inputs import random_ggml_blocks  # noqa: E402
from ninfer_kernels import dispatch, randweights, reference  # noqa: E402
from ninfer_kernels.gemv_iq3_s import BLOCK_BYTES as IQ3_S_BYTES, repack_iq3_s, unpack_iq3_s  # noqa: E402
from ninfer_kernels.gemv_iq3_s4 import repack_growth  # noqa: E402
from ninfer_kernels.gemv_nvfp4 import repack_nvfp4, unpack_nvfp4  # noqa: E402
from ninfer_kernels.gemv_q6_k import BLOCK_BYTES as Q6_K_BYTES, repack_q6_k, unpack_q6_k  # noqa: E402
from ninfer_rt.weights import QWeight, dequantize  # noqa: E402

GGML = {"q6_k": (Q6_K_BYTES, repack_q6_k, unpack_q6_k), "iq3_s": (IQ3_S_BYTES, repack_iq3_s, unpack_iq3_s)}
FORMATS = ("nvfp4", *GGML)
N, K = 13, 512
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def stored(fmt: str) -> dict:
    """A weight's stored tensors (and nvfp4's gscale) on DEV."""
    if fmt == "nvfp4":
        return randweights.make("nvfp4", N, K, device=DEV, seed=3)
    return {"blocks": random_ggml_blocks(fmt, N, K, 0).to(DEV)}


def tensors(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, torch.Tensor)}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


@pytest.mark.parametrize("fmt", GGML)
def test_unpack_inverts_repack_ggml(fmt):
    _, repack, unpack = GGML[fmt]
    b = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (7, 3 * GGML[fmt][0]), dtype=np.uint8))
    planes = repack(b, 768)
    assert torch.equal(unpack(planes), b)
    rows = torch.tensor([5, 0, 5, 2])
    assert torch.equal(unpack(planes, rows), b[rows])


@pytest.mark.parametrize("k", [80, 128, 400], ids=lambda k: f"K{k}")
def test_unpack_inverts_repack_nvfp4(k):
    """Chunk-major planes [C, N, 8] with C = ceil(K / 128): a ragged last chunk is zero-padded."""
    rng = np.random.default_rng(k)
    codes = torch.from_numpy(rng.integers(0, 256, (7, k // 2), dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(0, 256, (7, k // 16), dtype=np.uint8))
    planes = repack_nvfp4(codes, scales)
    C = -(-k // 128)
    assert planes["codes"].shape == (C, 7, 8) and planes["scales"].shape == (C, 7, 8)
    words = codes.view(torch.int64)
    assert torch.equal(planes["codes"][k // 128 // 2, 3, 1], words[3, 8 * (k // 128 // 2) + 1])
    assert same(unpack_nvfp4(planes, k), {"codes": codes, "scales": scales})
    rows = torch.tensor([5, 0, 5, 2])
    assert same(unpack_nvfp4(planes, k, rows), {"codes": codes[rows], "scales": scales[rows]})


@pytest.mark.parametrize("fmt", FORMATS)
def test_released_weight_keeps_every_path(fmt):
    data = stored(fmt)
    qw = QWeight(fmt, (N, K), {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in data.items()}, "w")
    twin = QWeight(fmt, (N, K), data, "w")
    x = torch.randn(3, K, device=DEV)
    y = dispatch.linear(x, qw)
    assert qw.released == (DEV == "cuda")       # on CPU the stored tensors stay (nothing to save in host memory)
    if not qw.released:
        dispatch.release(qw, dispatch._packed(qw))
    first = next(iter(tensors(data)))
    assert qw.released and qw.data[first] is None and qw.device == data[first].device
    # the planes hold the stored bytes; the IQ3_S 4-bit code planes (the default layout) 24 more per block
    grow = repack_growth(N, K) if fmt == "iq3_s" else 0
    assert sum(t.nbytes for t in qw.stored_tensors()) == sum(t.nbytes for t in tensors(data).values()) + grow
    assert same(qw.tensors(), tensors(data))
    assert torch.equal(dispatch.linear(x, qw), y)                           # the kernels read the planes
    assert torch.equal(dequantize(qw), dequantize(twin))                    # the torch reference path
    assert torch.equal(reference.ref_linear(x, fmt, qw), reference.ref_linear(x, fmt, twin.data))
    idx = torch.tensor([4, 4, 0, 12], device=DEV)
    assert same(tensors(qw.select_rows(idx).data), {k: v[idx] for k, v in tensors(data).items()})   # embeddings
    assert same(tensors(qw.rows(2, 9).data), {k: v[2:9] for k, v in tensors(data).items()})   # TP / tied head
    assert qw.rows(2, 9).data.get("gscale") == data.get("gscale")
    fused = QWeight.concat_rows([qw, twin], "fused")
    assert same(tensors(fused.data), {k: torch.cat([v, v]) for k, v in tensors(data).items()})
    assert fused.shape == (2 * N, K)
    assert same(tensors(qw.to("cpu").data), tensors(data))
    qw.release([], None)                        # a second release changes nothing
    assert same(qw.tensors(), tensors(data))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the release happens for CUDA weights only")
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_repack_releases_the_stored_tensors(fmt):
    data = stored(fmt)
    qw = QWeight(fmt, (N, K), {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in data.items()}, "w")
    x = torch.randn(2, K, device="cuda")
    y = dispatch.linear(x, qw)
    assert qw.released and same(qw.tensors(), tensors(data))
    assert torch.equal(dispatch.linear(x, qw), y)
