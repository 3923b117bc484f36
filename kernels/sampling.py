"""Greedy argmax over (vocab-parallel) logits, combinable across TP ranks with one all-reduce(MAX).

Each rank reduces its logits shard [T, V_local] to (max value fp32, global index int64, key int64) per row.
The key packs the value's order-preserving int32 image in the high 32 bits and (2^32 - 1 - index) in the low
32 bits, so the maximum key over ranks is the global maximum with ties going to the lowest index, the same
rule as inside a rank. Two stages: blocks of BLOCK_V columns in parallel, then one program per row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ops_common import KernelInputError, pow2
from .pdl import pdl_enter, pdl_kw

BLOCK_V = 4096
LOW_MASK = 0xFFFFFFFF


@triton.jit
def argmax_block_kernel(x_ptr, pv_ptr, pi_ptr, V, sx_t, NB, BLOCK_V: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)   # ninfer_kernels.pdl: before any load or store
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    i = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = i < V
    x = tl.load(x_ptr + t * sx_t + i, mask=ok, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    idx = tl.min(tl.where((x == m) & ok, i, 2147483647), axis=0)
    tl.store(pv_ptr + t * NB + blk, m)
    tl.store(pi_ptr + t * NB + blk, idx)


@triton.jit
def argmax_final_kernel(pv_ptr, pi_ptr, val_ptr, idx_ptr, key_ptr, NB, offset, BLOCK_B: tl.constexpr,
                        PDL: tl.constexpr = 0):
    pdl_enter(PDL)   # ninfer_kernels.pdl: before any load or store
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_B)
    ok = j < NB
    v = tl.load(pv_ptr + t * NB + j, mask=ok, other=float("-inf"))
    ix = tl.load(pi_ptr + t * NB + j, mask=ok, other=2147483647)
    m = tl.max(v, axis=0)
    best = tl.min(tl.where((v == m) & ok, ix, 2147483647), axis=0).to(tl.int64) + offset
    bits = m.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    tl.store(val_ptr + t, m)
    tl.store(idx_ptr + t, best)
    tl.store(key_ptr + t, ordered * 4294967296 + (4294967295 - best))


def argmax_partial(logits: torch.Tensor, vocab_offset: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, V_local] (this rank's vocab columns starting at `vocab_offset`) ->
    (max fp32 [T], global index int64 [T], combine key int64 [T]). Ties -> lowest index."""
    t, v = logits.shape
    if v == 0 or vocab_offset < 0 or vocab_offset + v > LOW_MASK:
        raise KernelInputError(f"argmax: vocab shard of {v} columns at offset {vocab_offset} is not representable")
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    nb = triton.cdiv(v, BLOCK_V)
    dev = logits.device
    pv = torch.empty(t, nb, dtype=torch.float32, device=dev)
    pi = torch.empty(t, nb, dtype=torch.int32, device=dev)
    val = torch.empty(t, dtype=torch.float32, device=dev)
    idx = torch.empty(t, dtype=torch.int64, device=dev)
    key = torch.empty(t, dtype=torch.int64, device=dev)
    if t:
        argmax_block_kernel[(t, nb)](x, pv, pi, v, x.stride(0), nb, BLOCK_V=BLOCK_V, num_warps=8, **pdl_kw(x.device))
        argmax_final_kernel[(t,)](pv, pi, val, idx, key, nb, int(vocab_offset), BLOCK_B=pow2(nb), num_warps=1,
                                  **pdl_kw(pv.device))
    return val, idx, key


def pack_key(val: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Torch twin of the kernel's key (for combining partials computed elsewhere)."""
    bits = val.float().contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    return ordered * (1 << 32) + (LOW_MASK - idx.long())


def unpack_key(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key (e.g. after an all-reduce MAX over ranks) -> (max value fp32, global index int64)."""
    idx = LOW_MASK - (key & LOW_MASK)
    ordered = (key >> 32).to(torch.int32)
    bits = torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    return bits.view(torch.float32), idx


def compile_specs(act: str):
    return [(argmax_block_kernel, {"x_ptr": f"*{act}", "pv_ptr": "*fp32", "pi_ptr": "*i32", "V": "i32",
                                   "sx_t": "i64", "NB": "i32"}, {"BLOCK_V": BLOCK_V}),
            (argmax_final_kernel, {"pv_ptr": "*fp32", "pi_ptr": "*i32", "val_ptr": "*fp32", "idx_ptr": "*i64",
                                   "key_ptr": "*i64", "NB": "i32", "offset": "i64"}, {"BLOCK_B": 64})]
