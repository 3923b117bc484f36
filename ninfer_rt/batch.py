"""Per-forward batch metadata: positions, paged-KV layout, GDN slot/snapshot routing. Built on the host and moved
through pinned memory (`sampling.to_device`): an eager forward queues behind the GPU's work without waiting."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .ops import AttnMeta, GdnMeta
from .sampling import small_tensor, to_device

# Sequences with at most this many new tokens (decode, verify) take the token-by-token GDN path; longer
# non-snapshot ones (prefill chunks) the chunked form. Snapshots always need the recurrent path.
RECURRENT_MAX_T = 8


@dataclass
class StepCtx:
    positions: torch.Tensor                    # int64 [sumT] or [3, sumT]
    attn: AttnMeta
    gdn: GdnMeta | None = None                 # whole batch (causal conv)
    gdn_groups: tuple = ()                     # (("chunk" | "recurrent", GdnMeta with rows), ...)
    snap_conv: torch.Tensor | None = None      # [n_gdn, N, ck-1, C]
    snap_rec: torch.Tensor | None = None       # [n_gdn, N, Hv, dk, dv]


def _cu(lens: list[int], device) -> torch.Tensor:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return small_tensor(cu, torch.int32, device)


def positions(starts: list[int], lens: list[int], overrides: list, device) -> torch.Tensor:
    """Default positions start..start+T-1; an override ([T] or [3, T]) replaces a sequence's rows."""
    parts = [torch.arange(s, s + n, device=device) if o is None else to_device(o.long(), device)
             for s, n, o in zip(starts, lens, overrides)]
    if any(p.dim() == 2 for p in parts):
        parts = [p.expand(3, -1) if p.dim() == 1 else p for p in parts]
        return torch.cat(parts, dim=1)
    return torch.cat(parts)


def attn_meta(pages: list[list[int]], starts: list[int], lens: list[int], page_size: int, device) -> AttnMeta:
    width = max(1, max(len(p) for p in pages))
    table = torch.zeros(len(pages), width, dtype=torch.int32)
    slots = []
    for b, (pg, s, n) in enumerate(zip(pages, starts, lens)):
        table[b, :len(pg)] = torch.tensor(pg, dtype=torch.int32)
        pos = torch.arange(s, s + n)
        slots.append(table[b].long()[pos // page_size] * page_size + pos % page_size)
    kv = [s + n for s, n in zip(starts, lens)]
    return AttnMeta(seq_lens=tuple(lens), kv_lens=tuple(kv), cu_seqlens=_cu(lens, device),
                    kv_lens_t=small_tensor(kv, torch.int32, device), block_tables=to_device(table, device),
                    slot_mapping=to_device(torch.cat(slots), device), page_size=page_size)


def _gdn_meta(idx: list[int], lens, slots, snap, cu_host, device, with_rows: bool) -> GdnMeta:
    sub = [lens[b] for b in idx]
    rows = None
    if with_rows:
        rows = to_device(torch.cat([torch.arange(cu_host[b], cu_host[b] + lens[b]) for b in idx]), device)
    return GdnMeta(seq_lens=tuple(sub), cu_seqlens=_cu(sub, device),
                   slots=small_tensor([slots[b] for b in idx], torch.long, device),
                   snap_index=small_tensor([snap[b] for b in idx], torch.long, device),
                   snap_index_host=tuple(snap[b] for b in idx), rows=rows)


def gdn_routing(lens: list[int], slots: list[int], snapshot: list[bool], device):
    """-> (full-batch GdnMeta, groups, snapshot offsets per sequence (-1 = none), total snapshot rows)."""
    snap, n_snap = [], 0
    for n, s in zip(lens, snapshot):
        snap.append(n_snap if s else -1)
        n_snap += n if s else 0
    cu_host = [0]
    for n in lens:
        cu_host.append(cu_host[-1] + n)
    everyone = list(range(len(lens)))
    full = _gdn_meta(everyone, lens, slots, snap, cu_host, device, with_rows=False)
    rec = [b for b in everyone if snapshot[b] or lens[b] <= RECURRENT_MAX_T]
    chunk = [b for b in everyone if b not in rec]
    if not rec or not chunk:
        groups = (("recurrent" if rec else "chunk", full),)
    else:
        groups = tuple((kind, _gdn_meta(idx, lens, slots, snap, cu_host, device, with_rows=True))
                       for kind, idx in (("recurrent", rec), ("chunk", chunk)))
    return full, groups, snap, n_snap
