"""flash-linear-attention's chunked gated delta rule as the Triton backend's prefill GDN (CUDA, fp16/bf16).

One varlen call per layer: the batch as one packed row, initial states gathered from and final states
scattered back to the state pool. What the installed fla accepts is read once, not per call:
- GVA (value heads sharing a key head, fla >= 0.4's `HV > H`): q and k go in with their own head count and
  no repeated copies (fla's kernels map value head h to key head h // (Hv / Hk), the reference's
  repeat_interleave order); older versions get the repeated heads;
- `use_qk_l2norm_in_kernel` (else q and k are normalised here, same eps as the reference);
- `cu_seqlens_cpu`: the host copy of the offsets, so fla builds its chunk index without a device sync.
The offsets (int64 on the device, and on the host) are made once per GdnMeta, i.e. once per forward: fla
caches its chunk indices by the identity of the offsets tensor, so every layer after the first hits that cache.
Never imported on a CPU-only path: an importable fla breaks transformers' CPU path (reference §17.2). Never
called while a CUDA graph is captured: fla reads lengths on the host and sizes its grids from them.
"""
from __future__ import annotations

import functools
import inspect
import sys

import torch

from ..ops import GdnMeta

HALF = (torch.float16, torch.bfloat16)       # fla's chunked kernels refuse fp32


def wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a chunked GDN call on `device` in `dtype` may go to fla (if it imports)."""
    return device.type == "cuda" and dtype in HALF and not torch.cuda.is_current_stream_capturing()


@functools.cache
def load() -> FlaChunk | None:
    """The process's FlaChunk over fla's chunk_gated_delta_rule, or None when fla does not import; the first
    call decides, and a missing fla is said once per process on stderr (the fallback is ~15x slower)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except (ImportError, ValueError):          # ValueError: sys.modules["fla"] = None
        print("ninfer-rt: flash-linear-attention (fla) is not importable; GDN prefill uses the token-by-token "
              "kernel (slow for long prompts: pip install flash-linear-attention)", file=sys.stderr)
        return None
    return FlaChunk(chunk_gated_delta_rule)


def decided() -> str | None:
    """'fla' or 'recurrent' once `load` has run in this process, else None."""
    if load.cache_info().currsize == 0:
        return None
    return "fla" if load() is not None else "recurrent"


def _l2norm(x: torch.Tensor, dtype) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + 1e-6)).to(dtype)


class FlaChunk:
    def __init__(self, fn):
        params = inspect.signature(fn).parameters
        self.fn = fn
        self.l2norm_in_kernel = "use_qk_l2norm_in_kernel" in params
        self.host_offsets = "cu_seqlens_cpu" in params
        # no parameter announces GVA; a docstring without it (or a wrapper hiding it) costs only the repeat
        self.gva = "GVA" in (fn.__doc__ or "")
        self._meta, self._offsets = None, None

    def _cu(self, meta: GdnMeta) -> dict:
        if self._meta is not meta:
            kw = {"cu_seqlens": meta.cu_seqlens.long()}
            if self.host_offsets:
                lens = torch.tensor((0,) + tuple(meta.seq_lens), dtype=torch.long)
                kw["cu_seqlens_cpu"] = lens.cumsum(0)
            self._meta, self._offsets = meta, kw
        return self._offsets

    def __call__(self, q, k, v, g, beta, state_pool, meta: GdnMeta) -> torch.Tensor:
        rep = v.shape[1] // q.shape[1]
        if rep > 1 and not self.gva:
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        kw = dict(self._cu(meta))
        if self.l2norm_in_kernel:
            kw["use_qk_l2norm_in_kernel"] = True
        else:
            q, k = _l2norm(q, v.dtype), _l2norm(k, v.dtype)
        init = state_pool.index_select(0, meta.slots)
        o, final = self.fn(q.to(v.dtype)[None].contiguous(), k.to(v.dtype)[None].contiguous(), v[None].contiguous(),
                           g.float()[None].contiguous(), beta.to(v.dtype)[None].contiguous(),
                           scale=q.shape[-1] ** -0.5, initial_state=init, output_final_state=True, **kw)
        state_pool.index_copy_(0, meta.slots, final.float())
        return o[0].to(v.dtype)
