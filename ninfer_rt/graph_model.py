"""Graph-friendly pieces of a Model step: fixed-size metadata buffers filled in place, and step bodies that read
only those buffers (so a CUDA graph captured once stays valid for every later step).

A captured graph keeps the device pointers it was recorded with and the host values the kernel wrappers
computed at capture time. Hence:
- every per-step tensor (token ids, positions, KV slot mapping, block tables, KV lengths, GDN slots, snapshot
  rows) is a view of one preallocated device buffer, overwritten before each replay by two host->device
  copies from pinned staging buffers (`StaticMeta.fill`);
- the host-side fields of AttnMeta / GdnMeta that kernels read are fixed per graph: T new tokens for every
  row, and the KV-length *bucket* the graph serves (the split-KV attention plan is sized for it; the kernel
  loops only to each row's real length, which it reads on the device);
- a batch smaller than the captured size is padded with rows that point at a scratch GDN slot and scratch
  KV pages: they compute garbage nobody reads.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .batch import StepCtx
from .ops import AttnMeta, GdnMeta


@dataclass
class RowSpec:
    """One sequence of a step: T token ids (host or device tensor) appended at positions start..start+T-1."""

    ids: torch.Tensor
    start: int
    pages: list[int]
    slot: int = 0           # GDN state slot (ignored by MTP steps)
    snap: int = -1          # snapshot row offset (>= 0: keep the pool slot, write per-token states there)


STAGING = 8     # pinned staging buffers used in turn: an MTP round fills K + 1 <= 8 (alignment, drafts, verify)


class _Staging:
    """A pinned host mirror of the device buffers, with the event of its last copy (reuse waits for it)."""

    def __init__(self, n64: int, n32: int, pin: bool):
        self.i64 = torch.zeros(n64, dtype=torch.int64, pin_memory=pin)
        self.i32 = torch.zeros(n32, dtype=torch.int32, pin_memory=pin)
        self.np64, self.np32 = self.i64.numpy(), self.i32.numpy()
        self.event = None


class StaticMeta:
    """Device metadata for up to `max_batch` rows of up to `max_tokens` tokens, block tables `max_pages` wide.

    int64 buffer: ids | positions | slot_mapping (max_batch * max_tokens each) | gdn slots | snapshot rows
    int32 buffer: block_tables (max_batch * max_pages) | kv_lens (max_batch)
    """

    def __init__(self, max_batch: int, max_tokens: int, max_pages: int, page_size: int,
                 scratch_pages: list[int], scratch_slot: int, device):
        self.device = torch.device(device)
        self.max_batch, self.max_tokens, self.max_pages, self.page_size = max_batch, max_tokens, max_pages, page_size
        if len(scratch_pages) * page_size < max_tokens:
            raise ValueError(f"graphs: {len(scratch_pages)} scratch pages cannot hold {max_tokens} tokens")
        self.scratch_pages = np.asarray(scratch_pages, dtype=np.int64)
        self.scratch_slot = scratch_slot
        n, b = max_batch * max_tokens, max_batch
        self._n64, self._n32 = 3 * n + 2 * b, b * max_pages + b
        self._i64 = torch.zeros(self._n64, dtype=torch.int64, device=self.device)
        self._i32 = torch.zeros(self._n32, dtype=torch.int32, device=self.device)
        self.ids, self.positions, self.slot_mapping = (self._i64[i * n:(i + 1) * n] for i in range(3))
        self.slots, self.snap = self._i64[3 * n:3 * n + b], self._i64[3 * n + b:]
        self.block_tables = self._i32[:b * max_pages].view(b, max_pages)
        self.kv_lens = self._i32[b * max_pages:]
        pin = self.device.type == "cuda"
        self._staging = [_Staging(self._n64, self._n32, pin) for _ in range(STAGING if pin else 1)]
        self._turn = 0
        self._cu: dict[int, torch.Tensor] = {}

    def cu_seqlens(self, batch: int, tokens: int) -> torch.Tensor:
        """int32 [batch + 1] = 0, T, 2T, ... (constant; a view of one tensor per T, so its address is fixed)."""
        if tokens not in self._cu:
            self._cu[tokens] = torch.arange(0, (self.max_batch + 1) * tokens, tokens, dtype=torch.int32,
                                            device=self.device)
        return self._cu[tokens][:batch + 1]

    # ---- filling ----
    def fill(self, rows: list[RowSpec], batch: int, tokens: int) -> None:
        """Write `rows` (then padding rows up to `batch`) into the device buffers; no host sync unless all
        STAGING staging buffers are still in flight."""
        if not 0 < len(rows) <= batch <= self.max_batch or not 0 < tokens <= self.max_tokens:
            raise ValueError(f"graphs: {len(rows)} rows in a batch of {batch} x {tokens} tokens "
                             f"(buffers hold {self.max_batch} x {self.max_tokens})")
        st = self._staging[self._turn]
        self._turn = (self._turn + 1) % len(self._staging)
        if st.event is not None:
            st.event.synchronize()
        on_device = self._write_host(st, rows, batch, tokens)
        self._i64.copy_(st.i64, non_blocking=True)
        self._i32.copy_(st.i32, non_blocking=True)
        if self.device.type == "cuda":
            st.event = torch.cuda.Event()
            st.event.record()
        for b, ids in on_device:
            self.ids[b * tokens:(b + 1) * tokens].copy_(ids, non_blocking=True)

    def _write_host(self, st: _Staging, rows, batch: int, tokens: int) -> list:
        n, ps, width = self.max_batch * self.max_tokens, self.page_size, self.max_pages
        a64, a32 = st.np64, st.np32
        ids, pos, smap = a64[:n], a64[n:2 * n], a64[2 * n:3 * n]
        slots, snap = a64[3 * n:3 * n + self.max_batch], a64[3 * n + self.max_batch:]
        bt = a32[:self.max_batch * width].reshape(self.max_batch, width)
        kvl = a32[self.max_batch * width:]
        on_device, t = [], np.arange(tokens)
        for b in range(batch):
            r = rows[b] if b < len(rows) else None
            lo, hi = b * tokens, (b + 1) * tokens
            start = r.start if r else 0
            pages = self.scratch_pages if r is None else np.asarray(r.pages[:-(-(start + tokens) // ps)],
                                                                     dtype=np.int64)
            if len(pages) * ps < start + tokens or len(pages) > width:
                raise ValueError(f"graphs: row {b} needs {start + tokens} KV positions; it has {len(pages)} "
                                 f"pages of {ps} (block tables hold {width})")
            p = start + t
            pos[lo:hi] = p
            smap[lo:hi] = pages[p // ps] * ps + p % ps
            bt[b, :len(pages)] = pages
            kvl[b] = start + tokens
            slots[b] = self.scratch_slot if r is None else r.slot
            snap[b] = -1 if r is None else r.snap
            if r is None:
                ids[lo:hi] = 0
            elif r.ids.device.type == "cpu":
                ids[lo:hi] = r.ids.numpy()
            else:
                ids[lo:hi] = 0
                on_device.append((b, r.ids))
        return on_device

    # ---- per-graph contexts ----
    def target_ctx(self, batch: int, tokens: int, kv_host: tuple[int, ...], snap_host: tuple[int, ...],
                   snap_conv=None, snap_rec=None) -> StepCtx:
        """StepCtx over views of the buffers. kv_host: the KV lengths kernels plan with (the bucket when
        capturing, the true lengths when running eagerly); snap_host: host copy of the snapshot rows (read by the torch reference only)."""
        n = batch * tokens
        cu = self.cu_seqlens(batch, tokens)
        attn = AttnMeta(seq_lens=(tokens,) * batch, kv_lens=tuple(kv_host), cu_seqlens=cu,
                        kv_lens_t=self.kv_lens[:batch], block_tables=self.block_tables[:batch],
                        slot_mapping=self.slot_mapping[:n], page_size=self.page_size)
        gdn = GdnMeta(seq_lens=(tokens,) * batch, cu_seqlens=cu, slots=self.slots[:batch],
                      snap_index=self.snap[:batch], snap_index_host=tuple(snap_host))
        return StepCtx(positions=self.positions[:n], attn=attn, gdn=gdn, gdn_groups=(("recurrent", gdn),),
                       snap_conv=snap_conv, snap_rec=snap_rec)

    def mtp_ctx(self, batch: int, tokens: int, kv_host: tuple[int, ...]) -> StepCtx:
        n = batch * tokens
        attn = AttnMeta(seq_lens=(tokens,) * batch, kv_lens=tuple(kv_host), cu_seqlens=self.cu_seqlens(batch, tokens),
                        kv_lens_t=self.kv_lens[:batch], block_tables=self.block_tables[:batch],
                        slot_mapping=self.slot_mapping[:n], page_size=self.page_size)
        return StepCtx(positions=self.positions[:n], attn=attn)


# ---- step bodies: everything between the metadata and the outputs, no host work ----
def _logits(model, x: torch.Tensor, draft: bool = False) -> torch.Tensor:
    logits = model.head_logits(x, draft)
    return model.tp.all_gather_last(logits) if model.tp.size > 1 else logits


def target_step(model, meta: StaticMeta, ctx: StepCtx, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (post-norm hidden [n, H], logits [n, V]) of the target model over the first n rows of `meta`."""
    h = model.ops.embedding(meta.ids[:n], model.embed, model.dtype)
    hidden = model._decoder(h, ctx)
    return hidden, _logits(model, hidden)


def mtp_step(model, meta: StaticMeta, ctx: StepCtx, hidden_in: torch.Tensor, n: int, t: int = 1
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (post-mtp.norm hidden [n, H], logits) of the MTP module over n = batch * t rows; hidden_in [>= n, H]
    static input. Logits: [n, V] for t = 1 (a draft step); for t > 1 (the re-alignment after a round) only each
    sequence's last row, [n / t, V]: the next draft reads nothing else, and the draft head is most of the step."""
    emb = model.ops.embedding(meta.ids[:n], model.embed, model.dtype)
    d = model.mtp(model.ops, emb, hidden_in[:n], ctx, model.kv_pool)
    last = d if t == 1 else d.view(n // t, t, d.shape[-1])[:, -1].contiguous()
    return d, _logits(model, last, draft=True)
