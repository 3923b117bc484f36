"""Inputs shared by the f16-variant GEMV tests (packed-half2, warp-MMA): NVFP4 weights and wide-range activations;
and `as_h200`, the launcher seen as on an H200 for candidate-list tests without a GPU."""
import numpy as np
import torch

from ninfer_formats import codecs


def rel_l2(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def nvfp4_weights(N: int, K: int, seed: int, dev):
    """(codes, scales, gscale) of N(0, 0.05) weights quantized by the numpy codec, codes/scales on `dev`."""
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05
    c, s, g = codecs.nvfp4.quantize(w)
    return torch.from_numpy(c).to(dev), torch.from_numpy(s).to(dev), float(g)


def wide_range_x(T: int, K: int, seed: int) -> torch.Tensor:
    """N(0,1) times 2**u, u uniform in [-20, 12] per element: tiny and large activations side by side."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, K, generator=g) * torch.exp2(torch.randint(-20, 13, (T, K), generator=g).float())


def every_code_nvfp4(N: int, K: int, dev):
    """(codes, scales): every code byte at every position; E4M3 scales from subnormal (0x01, 0x07) to 448 (0x7E)."""
    codes = torch.from_numpy((np.arange(N * K // 2) % 256).astype(np.uint8).reshape(N, K // 2)).to(dev)
    pattern = np.array([0x01, 0x07, 0x08, 0x38, 0x7E, 0x30, 0x40, 0x50], dtype=np.uint8)
    return codes, torch.from_numpy(np.resize(pattern, (N, K // 16))).to(dev)


def extreme_x(K: int, span: int, dev) -> torch.Tensor:
    """[2, K] fp32 with four spans of `span` activations: all zero, near the fp32 top, fp32 subnormals (row 0)
    and beyond the f16 range (row 1) -- what a power-of-two scaling into f16 must survive."""
    x = torch.randn(2, K, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    x[0, 0:span] = 0.0
    x[0, span:2 * span] *= 1e30
    x[0, 2 * span:3 * span] *= 1e-40
    x[1, 3 * span:4 * span] = 65504.0 * 4
    return x.to(dev)


def as_h200(monkeypatch) -> torch.device:
    """`gemv_launch.candidates` as on an H200 (sm_90, 132 SMs), without one: returns the cuda device to pass."""
    from ninfer_kernels import gemv_launch as gl
    monkeypatch.setattr(gl, "interpreting", lambda: False)
    monkeypatch.setattr(gl.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(gl, "sm_count", lambda device: 132)
    return torch.device("cuda")
