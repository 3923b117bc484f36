"""Small launch helpers shared by the decode-path kernels (row views, block sizes, dot precision)."""
from __future__ import annotations

import os

import torch
import triton

from .gemv_launch import KernelInputError  # noqa: F401  (the kernels' one bad-input error, a NinferError)


def interpreting() -> bool:
    """True under the Triton CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(max(1, int(n))))


def rows3(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as an [A, B, D] view with a unit last stride.

    Two row strides cover the views the model hands in (a head slice of a fused projection, a reshaped
    column slice) without a copy; anything else is made contiguous first.
    """
    if x.dim() == 0:
        raise KernelInputError("rows3: expected at least 1 dim")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() == 3:
        return x
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands use exact fp32 products ("ieee"), matching the torch reference; fp16/bf16 use the
    tensor-core path (where the GPU has one), whose products are exact anyway."""
    return "ieee" if dtype == torch.float32 else "tf32"


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def warps_for(block: int) -> int:
    """Warps for a one-row-per-program kernel over `block` elements."""
    return 8 if block >= 4096 else 4 if block >= 1024 else 2 if block >= 256 else 1
