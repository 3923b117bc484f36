"""Attention of long prefill chunks through torch's `scaled_dot_product_attention` (FlashAttention-2, cuDNN or
memory-efficient kernels) instead of the paged split-KV kernel, which is shaped for decode: one program per
(sequence, KV head, 64 query rows) walking the keys 32 at a time.

Per sequence b with T_b new tokens and L_b keys (cached + new): its K/V rows are gathered from the pages
([L_b, Hk, D], a few MB), the KV heads repeated to the query heads (GQA; an explicit copy, so every SDPA
backend can take it), and the causal mask is bottom-right aligned: new token t (position L_b - T_b + t) sees
keys 0 .. L_b - T_b + t. A chunk without cached context (L_b == T_b) is plain `is_causal`.

`NINFER_PREFILL_ATTN`: `auto` (default) takes this path for CUDA batches whose every sequence brings at least
`SDPA_MIN_T` new tokens and has at most `SDPA_MAX_KV` keys; `paged` never (the paged kernel everywhere, for
A/B runs); `sdpa` whatever the number of new tokens. Any other value is an error, on every device.
Never while a CUDA graph is captured: the per-sequence loop reads the host-side lengths, which a replay would
not update.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

from ninfer_formats.errors import LoadError

from ..ops import AttnMeta

SDPA_MIN_T = 256
# longer contexts stay paged: the gathered, head-repeated K and V of one sequence take 2 * Hq * L * D elements
SDPA_MAX_KV = 32768
MODES = ("auto", "paged", "sdpa")

_REFUSED: set = set()       # (dtype, device) where no fast SDPA backend took the call: paged from then on
_SAID: set = set()          # fallback reasons already reported on stderr (once per process each)
_DEVICE_FAULT = getattr(torch, "AcceleratorError", ())     # a sticky CUDA error (torch >= 2.8)


def mode() -> str:
    m = os.environ.get("NINFER_PREFILL_ATTN", "auto")
    if m not in MODES:
        raise LoadError(f"NINFER_PREFILL_ATTN={m!r}: expected one of {', '.join(MODES)}")
    return m


def wants_sdpa(device: torch.device, dtype: torch.dtype, meta: AttnMeta) -> bool:
    """Whether a batch of queries on `device` in `dtype` takes `try_prefill_attention`."""
    m = mode()      # before the device test, so a bad value fails on a CPU run too instead of being ignored
    if m == "paged" or device.type != "cuda" or (dtype, device) in _REFUSED:
        return False
    if torch.cuda.is_current_stream_capturing():
        return False
    return min(meta.seq_lens) >= (1 if m == "sdpa" else SDPA_MIN_T) and meta.max_kv_len <= SDPA_MAX_KV


def _gather(cache: torch.Tensor, meta: AttnMeta, b: int, n: int, groups: int) -> torch.Tensor:
    """Keys (or values) 0..n-1 of sequence b as [1, Hk * groups, n, D]; head h is KV head h // groups, the
    reference's repeat_interleave order."""
    pages = meta.block_tables[b, : -(-n // meta.page_size)]
    rows = cache.index_select(0, pages).flatten(0, 1)[:n]                       # [n, Hk, D]
    hk, d = rows.shape[1:]
    if groups > 1:
        rows = rows[:, :, None].expand(n, hk, groups, d).reshape(n, hk * groups, d)
    return rows.transpose(0, 1)[None]


def _sdpa(q, k, v, causal_offset: int, scale: float) -> torch.Tensor:
    t, n = q.shape[2], k.shape[2]
    if causal_offset == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    # is_causal is top-left aligned; with cached keys the last query must see every key
    from torch.nn.attention.bias import causal_lower_right
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(t, n), scale=scale)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
                      scale: float) -> torch.Tensor:
    """q [sumT, Hq, D]; caches [num_pages, page_size, Hk, D] already holding the new tokens -> [sumT, Hq, D]."""
    hq, hk = q.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    start = 0
    for b, (t, n) in enumerate(zip(meta.seq_lens, meta.kv_lens)):
        qb = q[start:start + t].transpose(0, 1)[None]                            # [1, Hq, T, D]
        k = _gather(k_cache, meta, b, n, hq // hk).to(q.dtype)
        v = _gather(v_cache, meta, b, n, hq // hk).to(q.dtype)
        out[start:start + t] = _sdpa(qb, k, v, n - t, scale)[0].transpose(0, 1)
        start += t
    return out


def _say_once(reason: str, text: str) -> None:
    if reason not in _SAID:
        _SAID.add(reason)
        print(f"ninfer-rt: prefill attention: {text}; the paged kernel runs instead", file=sys.stderr)


def try_prefill_attention(q, k_cache, v_cache, meta: AttnMeta, scale: float) -> torch.Tensor | None:
    """`prefill_attention` with the fast SDPA backends only (never the math one: it would materialise the
    [Hq, T, L] scores); None when none of them takes these inputs (e.g. an old GPU) or memory runs out, and
    the caller runs the paged kernel instead. Device faults are raised: the paged kernel could not recover."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return prefill_attention(q, k_cache, v_cache, meta, scale)
    except torch.OutOfMemoryError:
        _say_once("oom", "out of device memory for the gathered K/V (this time)")
        return None
    except RuntimeError as e:
        if isinstance(e, _DEVICE_FAULT):
            raise
        _REFUSED.add((q.dtype, q.device))
        _say_once(("refused", q.dtype, q.device), f"no fast SDPA backend for {q.dtype} on {q.device} "
                  f"({str(e).splitlines()[0] if str(e) else type(e).__name__})")
        return None
