"""Store the new tokens' K and V rows into the paged caches in one launch.

One program per (token, KV head); the flat slot of token i is slot_mapping[i] (page * page_size + offset).
Negative slots are skipped (padding tokens). K and V may be strided views of a fused projection.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ops_common import KernelInputError, pow2
from .pdl import pdl_enter, pdl_kw


@triton.jit
def kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, Hk, sk_t, sk_h, sv_t, sv_h, D,
                    BLOCK_D: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)   # ninfer_kernels.pdl: before any load or store
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, BLOCK_D)
        m = d < D
        dst = (slot * Hk + h) * D + d
        k = tl.load(k_ptr + t * sk_t + h * sk_h + d, mask=m)
        v = tl.load(v_ptr + t * sv_t + h * sv_h + d, mask=m)
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=m)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=m)


def check_store(k_cache, v_cache, k, v, slot_mapping, what: str) -> None:
    """The arguments of a cache store (here, or `rope.qk_norm_rope_store`): one-line errors naming `what`."""
    t, hk, d = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != (hk, d) or v_cache.shape != k_cache.shape:
        raise KernelInputError(f"{what}: k {tuple(k.shape)} v {tuple(v.shape)} cache {tuple(k_cache.shape)} / "
                               f"{tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise KernelInputError(f"{what}: the KV caches must be contiguous")
    if slot_mapping.numel() != t:
        raise KernelInputError(f"{what}: {slot_mapping.numel()} slots for {t} tokens")


def kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hk, D] -> k_cache/v_cache [num_pages, page_size, Hk, D] at flat slots (in place)."""
    check_store(k_cache, v_cache, k, v, slot_mapping, "kv_write")
    t, hk, d = k.shape
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if t:
        kv_write_kernel[(t, hk)](k, v, k_cache, v_cache, slot_mapping, hk, k.stride(0), k.stride(1),
                                 v.stride(0), v.stride(1), d, BLOCK_D=pow2(d), num_warps=1 if d <= 128 else 2,
                                 **pdl_kw(k.device))


def compile_specs(act: str):
    sig = {"k_ptr": f"*{act}", "v_ptr": f"*{act}", "kc_ptr": f"*{act}", "vc_ptr": f"*{act}", "slot_ptr": "*i64",
           "Hk": "i32", "sk_t": "i64", "sk_h": "i64", "sv_t": "i64", "sv_h": "i64", "D": "i32"}
    return [(kv_write_kernel, sig, {"BLOCK_D": 256})]
