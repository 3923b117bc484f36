"""Random but valid packed weights, made directly on a device (GPU tests and the benchmark).

Quantizing real-size matrices with the numpy codecs takes minutes (IQ3_S: ~0.2 M weights/s), and the
kernels must decode every bit pattern anyway, so big test weights are random bytes with only the fields
the formats constrain fixed: NVFP4 block scales positive and finite, GGML super-block scales finite fp16
of a realistic size, no E4M3 NaN codes. `make(fmt, N, K)` returns the data dict of a
`ninfer_rt.weights.QWeight` (codes/scales/gscale, blocks, codes/row_scale, or w).
"""
from __future__ import annotations

import torch

FORMATS = ("nvfp4", "q6_k", "iq3_s", "f8_e4m3_row", "bf16", "f16", "f32")
_BLOCK_BYTES = {"q6_k": 210, "iq3_s": 110}
_D_OFFSET = {"q6_k": 208, "iq3_s": 0}   # byte offset of the fp16 super-block scale inside a block
_PLAIN = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def _bytes(shape, gen, device) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8, device=device)


def _fp16_scales(n: int, gen, device, size: float) -> torch.Tensor:
    s = (torch.rand(n, generator=gen, device=device) + 0.5) * size
    sign = torch.randint(0, 2, (n,), generator=gen, device=device) * 2 - 1
    return (s * sign).to(torch.float16)


def make(fmt: str, N: int, K: int, *, device="cpu", seed: int = 0) -> dict:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    if fmt == "nvfp4":
        codes = _bytes((N, K // 2), gen, device)
        # E4M3 exponent field 4..11: block scales 2^-3 .. 2^4 (positive, finite)
        scales = torch.randint(0x20, 0x60, (N, K // 16), generator=gen, dtype=torch.uint8, device=device)
        return {"codes": codes, "scales": scales, "gscale": 2.0 ** -9}
    if fmt in _BLOCK_BYTES:
        nb, bb = K // 256, _BLOCK_BYTES[fmt]
        blocks = _bytes((N, nb, bb), gen, device)
        d = _fp16_scales(N * nb, gen, device, 2e-3 if fmt == "q6_k" else 1e-3)
        o = _D_OFFSET[fmt]
        blocks[..., o:o + 2] = d.view(torch.uint8).view(N, nb, 2)
        return {"blocks": blocks.reshape(N, nb * bb)}
    if fmt == "f8_e4m3_row":
        codes = _bytes((N, K), gen, device)
        codes[(codes & 0x7F) == 0x7F] -= 1          # 0x7F / 0xFF are NaN
        row_scale = (torch.rand(N, generator=gen, device=device) + 0.5) * 1e-3
        return {"codes": codes, "row_scale": row_scale.float()}
    if fmt in _PLAIN:
        w = torch.randn((N, K), generator=gen, device=device) * 0.02
        return {"w": w.to(_PLAIN[fmt])}
    raise ValueError(f"randweights.make: unknown format {fmt!r} (one of {', '.join(FORMATS)})")


def packed_bytes(fmt: str, N: int, K: int) -> int:
    """Bytes of weight data one GEMV reads (the format's bits per weight, scales included)."""
    if fmt == "nvfp4":
        return N * (K // 2 + K // 16)
    if fmt in _BLOCK_BYTES:
        return N * (K // 256) * _BLOCK_BYTES[fmt]
    if fmt == "f8_e4m3_row":
        return N * K + 4 * N
    return N * K * torch.empty((), dtype=_PLAIN[fmt]).element_size()
