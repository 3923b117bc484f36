"""Graph-friendly pieces of a Model step: fixed-size metadata buffers filled in place, and step bodies that read
only those buffers (so a CUDA graph captured once stays valid for every later step).

A captured graph keeps the device pointers it was recorded with and the host values the kernel wrappers
computed at capture time. Hence:
- every per-step tensor (token ids, positions, KV slot mapping, block tables, KV lengths, GDN slots, snapshot
  rows) is a view of one preallocated device buffer, overwritten before each replay by one host->device
  copy from a pinned staging buffer (`StaticMeta.fill`);
- the host-side fields of AttnMeta / GdnMeta that kernels read are fixed per graph: T new tokens for every
  row, and the KV-length *bucket* the graph serves (the split-KV attention plan is sized for it; the kernel
  loops only to each row's real length, which it reads on the device);
- a batch smaller than the captured size is padded with rows that point at a scratch GDN slot and scratch
  KV pages: they compute garbage nobody reads;
- a row of fewer tokens than the graph's T (an MTP re-alignment where sequences emitted different counts) is
  padded at its end: the padding tokens write their KV to the scratch pages and sit after the row's real tokens,
  so causal attention keeps them out of the real rows. Only steps without recurrent state may do this (a GDN
  layer would advance its state over the padding); `last` holds each row's last real token.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .batch import StepCtx
from .ops import AttnMeta, GdnMeta


@dataclass
class RowSpec:
    """One sequence of a step: its token ids (host or device tensor, at most the step's T) appended at positions
    start, start + 1, ...; a row of fewer than T ids is padded at its end (MTP steps only: see the module doc)."""

    ids: torch.Tensor
    start: int
    pages: list[int]
    slot: int = 0           # GDN state slot (ignored by MTP steps)
    snap: int = -1          # snapshot row offset (>= 0: keep the pool slot, write per-token states there)


STAGING = 16    # pinned staging buffers used in turn: an MTP round fills K + 1 <= 8, a prefill chunk up to 6 more


def _split(raw: torch.Tensor, n64: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One byte buffer -> (its first n64 int64s, the int32s after them): one copy moves both."""
    return raw[:8 * n64].view(torch.int64), raw[8 * n64:].view(torch.int32)


class _Staging:
    """A pinned host mirror of the device buffer, with the event of its last copy (reuse waits for it)."""

    def __init__(self, n64: int, n32: int, pin: bool):
        self.raw = torch.zeros(8 * n64 + 4 * n32, dtype=torch.uint8, pin_memory=pin)
        self.np64, self.np32 = (x.numpy() for x in _split(self.raw, n64))
        self.event = None


class StaticMeta:
    """Device metadata for up to `max_batch` rows of up to `max_tokens` tokens, block tables `max_pages` wide,
    in one device buffer (an int64 part, then an int32 part) that one host->device copy fills.

    int64 buffer: ids | positions | slot_mapping (max_batch * max_tokens each) | gdn slots | snapshot rows |
                  each row's last real token (flat index)
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
        self._n64, self._n32 = 3 * n + 3 * b, b * max_pages + b
        self._raw = torch.zeros(8 * self._n64 + 4 * self._n32, dtype=torch.uint8, device=self.device)
        self._i64, self._i32 = _split(self._raw, self._n64)
        self.ids, self.positions, self.slot_mapping = (self._i64[i * n:(i + 1) * n] for i in range(3))
        self.slots, self.snap, self.last = (self._i64[3 * n + i * b:3 * n + (i + 1) * b] for i in range(3))
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
        """Write `rows` (then padding rows up to `batch`) into the device buffer; no host sync unless all
        STAGING staging buffers are still in flight."""
        if not 0 < len(rows) <= batch <= self.max_batch or not 0 < tokens <= self.max_tokens:
            raise ValueError(f"graphs: {len(rows)} rows in a batch of {batch} x {tokens} tokens "
                             f"(buffers hold {self.max_batch} x {self.max_tokens})")
        st = self._staging[self._turn]
        self._turn = (self._turn + 1) % len(self._staging)
        if st.event is not None:
            st.event.synchronize()
        on_device = self._write_host(st, rows, batch, tokens)
        self._raw.copy_(st.raw, non_blocking=True)
        if self.device.type == "cuda":
            st.event = torch.cuda.Event()
            st.event.record()
        for lo, ids in on_device:
            self.ids[lo:lo + ids.numel()].copy_(ids, non_blocking=True)

    def _write_host(self, st: _Staging, rows, batch: int, tokens: int) -> list:
        n, mb, width = self.max_batch * self.max_tokens, self.max_batch, self.max_pages
        a64, a32 = st.np64, st.np32
        ids, pos, smap = a64[:n], a64[n:2 * n], a64[2 * n:3 * n]
        slots, snap, last = (a64[3 * n + i * mb:3 * n + (i + 1) * mb] for i in range(3))
        bt = a32[:mb * width].reshape(mb, width)
        kvl = a32[mb * width:]
        on_device = []
        for b in range(batch):
            r = rows[b] if b < len(rows) else None
            lo, hi = b * tokens, (b + 1) * tokens
            start, c = (0, tokens) if r is None else (r.start, r.ids.numel())
            table = self._kv_slots(b, r, start, c, tokens, pos[lo:hi], smap[lo:hi])
            bt[b, :len(table)] = table
            kvl[b] = start + tokens
            last[b] = lo + c - 1
            slots[b] = self.scratch_slot if r is None else r.slot
            snap[b] = -1 if r is None else r.snap
            ids[lo:hi] = 0
            if r is not None and r.ids.device.type == "cpu":
                ids[lo:lo + c] = r.ids.numpy()
            elif r is not None:
                on_device.append((lo, r.ids))
        return on_device

    def _kv_slots(self, b: int, r, start: int, c: int, tokens: int, pos, smap) -> np.ndarray:
        """Row b's positions and KV slots (written into pos / smap) -> its block table. The c real tokens write
        into the row's pages; padding tokens (c < tokens) into the scratch pages, and the table walks scratch
        pages past the row's own so that the padding queries' attention reads only valid pages."""
        ps, width = self.page_size, self.max_pages
        pages = self.scratch_pages if r is None else np.asarray(r.pages[:-(-(start + c) // ps)], dtype=np.int64)
        need = -(-(start + tokens) // ps)
        if not 0 < c <= tokens:
            raise ValueError(f"graphs: row {b} has {c} token ids for a step of {tokens}")
        if len(pages) * ps < start + c or need > width:
            raise ValueError(f"graphs: row {b} needs {start + c} KV positions and a table of {need} pages; it has "
                             f"{len(pages)} pages of {ps} (block tables hold {width})")
        p = start + np.arange(tokens)
        pos[:] = p
        smap[:c] = pages[p[:c] // ps] * ps + p[:c] % ps
        j = np.arange(c, tokens)
        smap[c:] = self.scratch_pages[j // ps] * ps + j % ps
        return np.concatenate([pages, np.full(max(need - len(pages), 0), self.scratch_pages[0])])

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
    sequence's last real row, [n / t, V]: the next draft reads nothing else, and the draft head is most of the step."""
    emb = model.ops.embedding(meta.ids[:n], model.embed, model.dtype)
    d = model.mtp(model.ops, emb, hidden_in[:n], ctx, model.kv_pool)
    last = d if t == 1 else d.index_select(0, meta.last[:n // t])      # rows padded at their end: see `last`
    return d, _logits(model, last, draft=True)
