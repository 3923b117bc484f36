"""Inference state: the shared paged KV pool, the GDN state pool, and per-sequence handles.

KV: one pool of pages shared by every full-attention layer and the MTP layer (`KVPool.k[layer]` is
[num_pages, page_size, Hk_local, D]). A sequence owns a list of pages in position order; page i holds
positions [i*page_size, (i+1)*page_size) of *every* layer, the MTP layer included (MTP position p pairs the
target hidden at p, so the main and MTP caches share one block table).

Pages are reference-counted: a prefix cache (prefix_cache.py) may hold a finished prompt's full pages and
hand them to later sequences, which read them and never write them (every write lands at a sequence's own
length, past the shared prefix). Pages only the cache holds count as free: `alloc` evicts for them.

GDN: a pool of `max_seqs` slots, each with an fp32 conv window [ck-1, C] and recurrent state [Hv, dk, dv]
per GDN layer. A sequence holds one slot for its lifetime.

Rollback (speculative verify): a forward with `snapshot=True` leaves the committed state untouched and writes
the GDN state after every new token into snapshot rows; `commit(n)` makes the snapshot of token n the committed
state (n = 0 keeps the old one) and sets the length to L + n, which is all the KV needs (entries past the length
are stale and get overwritten). Snapshot rows of the model's own forward are a per-forward buffer, and commit
copies the row into the slot; the graph runner's snapshot rows are pool rows past the slots (`GdnPool.add_rows`),
and commit only points the sequence at the row (`SeqState.gdn_row`) -- no copy of ~3 MB per GDN layer. Whoever
writes those rows next first moves such a state home (`SeqState.materialize`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class CapacityError(RuntimeError):
    """The KV pages or GDN slots are exhausted; the scheduler should wait or preempt."""


@dataclass(frozen=True)
class CacheConfig:
    num_pages: int = 256
    page_size: int = 16
    max_seqs: int = 8

    def __post_init__(self):
        for n in ("num_pages", "page_size", "max_seqs"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"cache.{n}: expected a positive integer, got {v!r}")


class KVPool:
    def __init__(self, num_pages: int, page_size: int, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device):
        shape = (num_layers, num_pages, page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))      # stack: low page ids are handed out first
        self.refs = [0] * num_pages
        self.reclaimer = None         # a PrefixCache: its pages nobody else holds are free on demand

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.k[0, 0, 0].numel() * self.k.shape[0] * self.k.element_size()

    def unused(self) -> int:
        return len(self._free)

    def free_pages(self) -> int:
        """Pages `alloc` can hand out: the unused ones and those only the prefix cache holds."""
        return len(self._free) + (self.reclaimer.evictable() if self.reclaimer is not None else 0)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free) and self.reclaimer is not None:
            self.reclaimer.reclaim(n)
        if n > len(self._free):
            raise CapacityError(f"KV cache full: need {n} pages, {len(self._free)} free of {self.num_pages}")
        got = [self._free.pop() for _ in range(n)]
        for p in got:
            self.refs[p] = 1
        return got

    def share(self, pages: list[int]) -> None:
        """One more holder of each page (a prefix cache entry, or a sequence resuming from one)."""
        for p in pages:
            self.refs[p] += 1
        self._mark(pages)

    def _mark(self, pages: list[int]) -> None:
        """The prefix cache's evictable count is stale once a page it holds gains or loses a holder."""
        r = self.reclaimer
        if r is not None and not r.dirty and any(p in r.held for p in pages):
            r.dirty = True

    def release(self, pages: list[int]) -> None:
        """One holder fewer; a page nobody holds is free again."""
        for p in reversed(pages):
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._free.append(p)
            elif self.refs[p] < 0:
                raise RuntimeError(f"kv pool: page {p} released more often than taken")
        self._mark(pages)


class GdnPool:
    def __init__(self, max_seqs: int, num_layers: int, conv_width: int, channels: int, v_heads: int,
                 k_dim: int, v_dim: int, device):
        self.conv = torch.zeros(num_layers, max_seqs, conv_width, channels, device=device)
        self.rec = torch.zeros(num_layers, max_seqs, v_heads, k_dim, v_dim, device=device)
        self.max_seqs = max_seqs
        self._free = list(range(max_seqs - 1, -1, -1))
        self.pins = 0           # captured CUDA graphs point at conv / rec: add_rows may not move them

    def add_rows(self, n: int) -> int:
        """Append n rows past the slots (a graph runner's snapshot rows); returns the first one's index."""
        if self.pins:
            raise RuntimeError("gdn pool: captured CUDA graphs point at the GDN state pool; create every graph "
                               "runner of a model before capturing one")
        base = self.conv.shape[1]
        for name in ("conv", "rec"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], base + n, *old.shape[2:])
            new[:, :base] = old
            setattr(self, name, new)
        return base

    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise CapacityError(f"all {self.max_seqs} sequence slots are in use")
        slot = self._free.pop()
        self.conv[:, slot].zero_()
        self.rec[:, slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)


@dataclass
class PendingSnapshot:
    """A snapshot forward awaiting commit: T new tokens, their states at rows offset..offset+T-1."""

    tokens: int
    conv: torch.Tensor          # [n_gdn, N, ck-1, C]
    rec: torch.Tensor           # [n_gdn, N, Hv, dk, dv]
    offset: int


class SeqState:
    """One sequence: committed `length`, its KV pages, its GDN slot, and the MTP cache handle (`mtp`)."""

    def __init__(self, kv: KVPool, gdn: GdnPool, has_mtp: bool):
        self._kv, self._gdn = kv, gdn
        self.length = 0
        self.pages: list[int] = []
        self.slot = gdn.acquire()
        self.gdn_row = self.slot    # the pool row holding the committed GDN state: the slot, or a snapshot row
        self.mtp = MtpState(self) if has_mtp else None
        self.pending: PendingSnapshot | None = None
        self.freed = False

    def pages_needed(self, tokens: int) -> int:
        """Extra pages needed for the cache to hold `tokens` positions."""
        return max(0, self._kv.pages_for(tokens) - len(self.pages))

    def ensure_capacity(self, tokens: int) -> None:
        self._check_live()
        n = self.pages_needed(tokens)
        if n:
            self.pages.extend(self._kv.alloc(n))

    def commit(self, n: int) -> None:
        """Accept the first n tokens of the last snapshot forward (0 <= n <= its T)."""
        self._check_live()
        p = self.pending
        if p is None:
            raise RuntimeError("commit: no snapshot forward is pending for this sequence")
        if not 0 <= n <= p.tokens:
            raise ValueError(f"commit: n={n} outside 0..{p.tokens}")
        if n and p.rec is self._gdn.rec:       # a row of the pool itself: point at it
            self.gdn_row = p.offset + n - 1
        elif n:
            self.gdn_row = self.slot              # the copy replaces whatever the slot held
            self._gdn.conv[:, self.slot] = p.conv[:, p.offset + n - 1]
            self._gdn.rec[:, self.slot] = p.rec[:, p.offset + n - 1]
        self.length += n
        self.pending = None
        self.trim()

    def adopt(self, pages: list[int], length: int, conv: torch.Tensor, rec: torch.Tensor) -> None:
        """Start from a cached prefix: its `length` positions in the shared `pages` (main and MTP caches), its
        GDN state (conv [n_gdn, ck-1, C], rec [n_gdn, Hv, dk, dv]) copied into this sequence's slot."""
        self._check_live()
        if self.length or self.pages:
            raise RuntimeError("adopt: the sequence has started already")
        self._kv.share(pages)
        self.pages = list(pages)
        self._gdn.conv[:, self.slot] = conv
        self._gdn.rec[:, self.slot] = rec
        self.gdn_row, self.length = self.slot, length
        if self.mtp is not None:
            self.mtp.length = length

    def materialize(self) -> None:
        """Move a committed state that lives in a snapshot row into the slot (before that row is written)."""
        self._check_live()
        if self.gdn_row != self.slot:
            self._gdn.conv[:, self.slot] = self._gdn.conv[:, self.gdn_row]
            self._gdn.rec[:, self.slot] = self._gdn.rec[:, self.gdn_row]
            self.gdn_row = self.slot

    def trim(self) -> None:
        """Return pages beyond what the main and MTP caches still hold."""
        main = self.length + (self.pending.tokens if self.pending else 0)   # uncommitted KV stays
        used = max(main, self.mtp.length if self.mtp else 0)
        keep = self._kv.pages_for(used)
        if len(self.pages) > keep:
            self._kv.release(self.pages[keep:])
            del self.pages[keep:]

    def free(self) -> None:
        """Return the pages and the GDN slot; the state is unusable afterwards (idempotent)."""
        if self.freed:
            return
        self._kv.release(self.pages)
        self.pages = []
        self._gdn.release(self.slot)
        self.pending = None
        self.freed = True

    def _check_live(self) -> None:
        if self.freed:
            raise RuntimeError("sequence state was freed")


class MtpState:
    """The MTP layer's cache length for one sequence (pages belong to the parent SeqState)."""

    def __init__(self, parent: SeqState):
        self.parent = parent
        self.length = 0

    def rewind(self, length: int) -> None:
        """Forget MTP entries at positions >= length (e.g. back to the round start before re-alignment)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"mtp rewind: length {length} outside 0..{self.length}")
        self.length = length
        self.parent.trim()
