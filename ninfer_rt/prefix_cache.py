"""Prefix caching for a hybrid model: a prompt resumes where an earlier one with the same start left off.

Full attention needs the prefix's KV pages; Gated DeltaNet needs its recurrent and conv state at exactly the
resume point, which no page holds. So entries are taken where a prompt's prefill stops on purpose (`cuts`): at
the last page boundary `n` before its final token, and at the last page boundary of the longest start it shares
with a cached prompt (where requests with one system prompt part). An entry holds the n/page_size full pages
(shared, never written again: later writes land at a sequence's own length) and a copy of the GDN state after
token n-1. The MTP
layer's cache row n-1 pairs token n, so an entry matches prompts that share tokens [0, n] (n + 1 tokens) and
resumes them at n with the MTP cache at n too.

Entries are found by chained page hashes (vLLM's block hashes) and confirmed token by token; the least recently
used goes first when `max_entries` is reached or when the KV pool needs the pages (`KVPool.reclaimer`). Every
tensor-parallel rank keeps its own cache; the ranks insert and evict in the same order (same plans, same
allocations), and the leader sends the resume points it chose (`Plan.cached`).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .state import GdnPool, KVPool, SeqState


@dataclass
class Entry:
    key: tuple[int, int]         # (hash of its pages, token n)
    tokens: tuple[int, ...]      # the prompt's tokens [0, n]: n in the cache, the n-th paired by MTP row n-1
    pages: list[int]
    conv: torch.Tensor           # [n_gdn, ck-1, C]: the GDN state after token n-1
    rec: torch.Tensor            # [n_gdn, Hv, dk, dv]

    @property
    def length(self) -> int:
        return len(self.tokens) - 1


@dataclass
class PrefixStats:
    queries: int = 0             # prompt tokens looked up
    hits: int = 0                # of those, tokens resumed from the cache
    entries: int = 0
    evictions: int = 0


def page_hashes(tokens, page_size: int, pages: int) -> list[int]:
    """hash of pages [0, i] for i < pages: each page's hash chains its predecessor's."""
    out, h = [], 0
    for i in range(pages):
        h = hash((h, tuple(tokens[i * page_size:(i + 1) * page_size])))
        out.append(h)
    return out


class PrefixCache:
    """Methods take a prompt with its `hashes` (`self.hashes(prompt)`, kept by the caller: prompts are long)."""

    def __init__(self, kv: KVPool, gdn: GdnPool, max_entries: int):
        if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries < 1:
            raise ValueError(f"prefix cache: expected a positive number of entries, got {max_entries!r}")
        self.kv, self.gdn, self.max_entries = kv, gdn, max_entries
        self.entries: OrderedDict[tuple[int, int], Entry] = OrderedDict()    # (page hash, token n) -> entry
        self.held: dict[int, int] = {}          # page -> entries holding it
        self.bounds: dict[tuple[int, int], int] = {}    # (hash of pages [0, i), token i * ps) -> entries sharing it
        self.dirty, self._evictable = False, 0     # evictable()'s count, stale when dirty
        self.stats = PrefixStats()
        kv.reclaimer = self

    def hashes(self, prompt: list[int]) -> list[int]:
        """The prompt's page hashes up to its last entry point."""
        return page_hashes(prompt, self.kv.page_size, self.cut(prompt) // self.kv.page_size)

    def cut(self, prompt: list[int]) -> int:
        """The prompt's own entry point: the last page boundary before its final token (0: none)."""
        return (len(prompt) - 1) // self.kv.page_size * self.kv.page_size

    def cuts(self, prompt: list[int], hashes: list[int]) -> list[int]:
        """Where the prompt's prefill stops to be cached, ascending, those cached already left out: the page
        boundary where it leaves the longest cached prefix it shares (a system prompt shared by requests that
        differ after it: the next such request resumes there) and its own entry point."""
        ps, top = self.kv.page_size, len(hashes)
        branch = next((i for i in range(top - 1, 0, -1) if (hashes[i - 1], prompt[i * ps]) in self.bounds), 0)
        return [n for n in (branch * ps, top * ps) if n and not self._find(prompt, n, hashes)]

    def _key(self, prompt: list[int], n: int, hashes: list[int]) -> tuple[int, int]:
        return hashes[n // self.kv.page_size - 1], prompt[n]

    def _find(self, prompt, n: int, hashes: list[int]) -> Entry | None:
        e = self.entries.get(self._key(prompt, n, hashes))
        return e if e is not None and e.tokens == tuple(prompt[:n + 1]) else None

    def lookup(self, prompt: list[int], hashes: list[int]) -> Entry | None:
        """The longest entry this prompt starts with (its tokens [0, n], n < len(prompt)), or None."""
        ps = self.kv.page_size
        for i in range(len(hashes), 0, -1):
            e = self._find(prompt, i * ps, hashes)
            if e is not None:
                return e
        return None

    def resume(self, state: SeqState, prompt: list[int], hashes: list[int], length: int | None = None) -> int:
        """Start `state` from the longest cached prefix of `prompt` (or the one of exactly `length` tokens, a
        follower's copy of the leader's choice); returns the resumed length (0: none)."""
        if length is None:
            self.stats.queries += len(prompt)
            e = self.lookup(prompt, hashes)
        else:
            e = self._find(prompt, length, hashes) if length else None
            if e is None:
                raise RuntimeError(f"prefix cache: no entry of {length} tokens for this prompt on this rank (the "
                                   f"ranks' caches diverged)")
        if e is None:
            return 0
        self.entries.move_to_end(e.key)
        state.adopt(e.pages, e.length, e.conv, e.rec)
        if length is None:
            self.stats.hits += e.length
        return e.length

    def insert(self, state: SeqState, prompt: list[int], hashes: list[int], n: int) -> None:
        """Keep the state of `prompt`'s first n tokens (a page boundary before its last token), which `state`
        holds now: its prefill just stopped there. A prefix already cached is only marked used."""
        ps = self.kv.page_size
        key = self._key(prompt, n, hashes)
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        pages = state.pages[:n // ps]
        row = state.gdn_row
        e = Entry(key, tuple(prompt[:n + 1]), pages, self.gdn.conv[:, row].clone(), self.gdn.rec[:, row].clone())
        for p in pages:
            self.held[p] = self.held.get(p, 0) + 1
        self.kv.share(pages)
        for b in self._bounds(e):
            self.bounds[b] = self.bounds.get(b, 0) + 1
        self.entries[key] = e
        self.stats.entries = len(self.entries)
        self.dirty = True
        while len(self.entries) > self.max_entries:
            self._evict(next(iter(self.entries)))

    def _bounds(self, e: Entry) -> list[tuple[int, int]]:
        """(hash of pages [0, i), token i * page_size) for i = 1 .. n / page_size: the page boundaries m a prompt
        sharing tokens [0, m] with this entry could resume at (`cuts`' branch points)."""
        ps = self.kv.page_size
        return [(h, e.tokens[(i + 1) * ps]) for i, h in enumerate(page_hashes(e.tokens, ps, len(e.pages)))]

    def _evict(self, key: tuple[int, int]) -> None:
        e = self.entries.pop(key)
        for p in e.pages:
            self.held[p] -= 1
            if not self.held[p]:
                del self.held[p]
        for b in self._bounds(e):
            self.bounds[b] -= 1
            if not self.bounds[b]:
                del self.bounds[b]
        self.kv.release(e.pages)
        self.stats.entries = len(self.entries)
        self.stats.evictions += 1
        self.dirty = True

    def evictable(self) -> int:
        """Pages that only cache entries hold (free once those entries go); recounted only after a held page's
        holders changed (`KVPool.share` / `release` mark it), since the server asks after every step."""
        if self.dirty:
            self._evictable = sum(1 for p, n in self.held.items() if self.kv.refs[p] == n)
            self.dirty = False
        return self._evictable

    def reclaim(self, free: int) -> None:
        """Evict the least recently used entries until the pool has `free` unused pages (or none is left). An
        entry whose every page a running sequence also holds frees nothing: it stays (a shared system prompt in
        use is the entry most worth keeping)."""
        for key in list(self.entries):
            if self.kv.unused() >= free:
                return
            if any(self.kv.refs[p] == self.held[p] for p in self.entries[key].pages):
                self._evict(key)

    def clear(self) -> None:
        while self.entries:
            self._evict(next(iter(self.entries)))
