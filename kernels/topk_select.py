"""Top-W of a few wide float32 rows (the sampled MTP rounds' top-k selection), sorted, ties to the lowest column.

torch.topk gives each of a few 248,320-wide rows one slice of a radix select: 69 us per row on an H100 inside a
CUDA graph (bench/NOTES.md §47 F), four times per sampled round with a top_k. Here each value becomes an int64 key,
its order-preserving int32 image in the high 32 bits and (2^32 - 1 - column) in the low 32 (as `sampling`'s
argmax), so one descending sort orders by value and then by lower column, and the selection is deterministic
(torch.topk's order among tied values on CUDA is not). Two stages: blocks of BLOCK columns in parallel, each
sorted and its first W keys kept; then one program per row sorts the blocks' keys and writes the first W as
(value, column). The reference is `reference` (torch, on any device); W <= BLOCK.
Measured on an H100 (§48 C): 179 us for one row, 203 for four, against torch.topk's 72 / 77: Triton's `tl.sort`
of 4096 int64 keys per program is the cost. So it is opt-in (NINFER_TOPK_KERNEL=1), for its fixed tie order only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ops_common import KernelInputError, pow2
from .pdl import pdl_enter, pdl_kw

BLOCK = 4096
LOW_MASK = 0xFFFFFFFF
PAD_KEY = -(2 ** 63)            # below every value's key: padding never outranks a real column


@triton.jit
def _key(x, col):
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    return ordered * 4294967296 + (4294967295 - col.to(tl.int64))


@triton.jit
def topk_block_kernel(x_ptr, key_ptr, V, sx, NB, W: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)   # ninfer_kernels.pdl: before any load or store
    r = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    j = tl.arange(0, BLOCK)
    col = b * BLOCK + j
    ok = col < V
    x = tl.load(x_ptr + r * sx + col, mask=ok, other=0.0).to(tl.float32)
    keys = tl.where(ok, _key(x, col), -9223372036854775808)
    keys = tl.sort(keys, descending=True)
    tl.store(key_ptr + (r * NB + b) * W + j, keys, mask=j < W)


@triton.jit
def topk_final_kernel(key_ptr, val_ptr, idx_ptr, N, W: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_N)
    keys = tl.load(key_ptr + r * N + j, mask=j < N, other=-9223372036854775808)
    keys = tl.sort(keys, descending=True)
    ordered = (keys >> 32).to(tl.int32)
    bits = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    col = 4294967295 - (keys & 4294967295)
    tl.store(val_ptr + r * W + j, bits.to(tl.float32, bitcast=True), mask=j < W)
    tl.store(idx_ptr + r * W + j, col, mask=j < W)


def topk_rows(x: torch.Tensor, width: int, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [R, V] (no nan) -> (the `width` largest values of each row, descending, float32 [R, W]; their
    columns int64 [R, W]); equal values in column order. block: columns per first-stage program (a power of two;
    the tests take small ones, the interpreter's sort being slow)."""
    R, V = x.shape
    if x.dtype != torch.float32 or not 1 <= width <= min(V, block) or V > LOW_MASK or block != pow2(block):
        raise KernelInputError(f"topk_rows: float32 rows and 1 <= width <= min(V, {block}), got {x.dtype} "
                               f"[{R}, {V}], width {width}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    nb = triton.cdiv(V, block)
    keys = torch.empty(R, nb * width, dtype=torch.int64, device=x.device)
    topk_block_kernel[(R, nb)](x, keys, V, x.stride(0), nb, W=width, BLOCK=block, num_warps=8, **pdl_kw(x.device))
    vals = torch.empty(R, width, dtype=torch.float32, device=x.device)
    idx = torch.empty(R, width, dtype=torch.int64, device=x.device)
    topk_final_kernel[(R,)](keys, vals, idx, nb * width, W=width, BLOCK_N=pow2(nb * width), num_warps=8,
                            **pdl_kw(x.device))
    return vals, idx


def reference(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same selection in torch: a stable descending sort (ties in column order), its first `width`."""
    vals, idx = torch.sort(x.float(), dim=-1, descending=True, stable=True)
    return vals[:, :width], idx[:, :width]


def compile_specs(act: str):
    """At the 27B vocabulary: 61 blocks of 4096 columns, their 64-key heads merged by one 4096-wide sort."""
    return [(topk_block_kernel, {"x_ptr": "*fp32", "key_ptr": "*i64", "V": "i32", "sx": "i64", "NB": "i32"},
             {"W": 64, "BLOCK": BLOCK}, 8),
            (topk_final_kernel, {"key_ptr": "*i64", "val_ptr": "*fp32", "idx_ptr": "*i64", "N": "i32"},
             {"W": 64, "BLOCK_N": 4096}, 8)]
