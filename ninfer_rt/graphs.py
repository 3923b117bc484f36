"""CUDA-graph runner: the decode step, each MTP verify size and the MTP draft step, captured once and replayed
(with `round_drafts`, also a greedy MTP round's drafts and verify as one graph: `graph_round`).

    runner = GraphRunner(model, GraphConfig(batch_sizes=(1, 2, 4), tokens=(1, 4), mtp_tokens=(1,),
                                            kv_buckets=(4096, 32768)))
    runner.capture()                                          # warm every graph, then capture them all
    out = runner.forward([SeqInput(ids, st), ...])            # same contract as Model.forward
    d = runner.mtp_forward([MtpInput(ids, hidden, st.mtp)])   # same contract as Model.mtp_forward

Graphs are keyed by (kind, padded batch, tokens per sequence, KV bucket). An MTP batch of ragged token counts
(a re-alignment where sequences emitted different counts) is padded to the smallest captured count that holds
it (graph_model's padded rows). A batch the graphs cannot serve (ragged target token counts, prefill chunks,
position overrides, image embeddings, a context past the largest bucket, `gather=False` under TP, snapshot
rows while an earlier verify is still uncommitted) goes to the model's own eager forward, with identical
results up to rounding. `GraphConfig(eager=True)` (CLI `--eager`) runs the very same static-buffer step bodies
without capturing, for debugging and for CPU tests.

Resources: one GDN slot and enough KV pages for the padding rows (size the cache with one spare sequence),
max_batch x max(tokens) snapshot rows appended to the GDN pool (fp32 GDN states: ~144 MiB per row at 27B), and
one private memory pool shared by all graphs (they never run concurrently). A verify's snapshots live in those
pool rows, so `commit` points the sequence at its row instead of copying it (`SeqState.gdn_row`); before a
verify writes rows that hold another sequence's committed state, that state is moved home (`_protect`).
Outputs are copied out of the graph's static buffers unless `copy_outputs=False` (then they are overwritten by
the next replay).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from . import graph_prefill, graph_round, graph_round_sampled
from .batch import RECURRENT_MAX_T
from .graph_model import RowSpec, StaticMeta, mtp_step, target_step
from .model import LOGITS, Output, logit_rows
from .sampling import small_tensor
from .state import CapacityError, PendingSnapshot


# The widest prefill graph: the decode kernels' widest step (ninfer_kernels.dispatch.DECODE_MAX_T; a test keeps
# the two equal). Wider chunks take the prefill kernels, which run eagerly.
PREFILL_MAX_T = 16
_ROUNDS = ("round", "sround", "tround")     # key kinds of the round graphs: greedy, sampled (graph_round_sampled)


class GraphError(RuntimeError):
    """The graph runner cannot be set up as configured."""


def _sizes(name: str, v, lo: int = 1, hi: int | None = None) -> tuple[int, ...]:
    v = tuple(v)
    if any(not isinstance(x, int) or isinstance(x, bool) or x < lo or (hi and x > hi) for x in v) \
            or list(v) != sorted(set(v)):
        raise ValueError(f"graphs.{name}: expected ascending distinct integers in [{lo}, {hi or 'inf'}], got {v!r}")
    return v


@dataclass(frozen=True)
class GraphConfig:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)   # captured batch sizes; smaller batches are padded up
    tokens: tuple[int, ...] = (1,)                # target tokens per sequence: 1 = decode, K+1 = verify of K drafts
    mtp_tokens: tuple[int, ...] = (1,)            # MTP tokens per sequence (1 = a draft step); () = none
    kv_buckets: tuple[int, ...] = (8192,)         # KV-length buckets; the largest bounds graph-served contexts
    eager: bool = False                           # run the static-buffer bodies without capturing (debugging)
    copy_outputs: bool = True                     # hand out copies, not the graph's static outputs
    prefill_tokens: tuple[int, ...] = ()          # more batch-1 target sizes that prefill chunks are cut into
    prefill_pieces: int = 6                       # a chunk needing more pieces runs eagerly
    round_drafts: int = 0                         # K > 0: greedy MTP rounds of K drafts as one graph (graph_round)
    sampled_rounds: bool = False                  # also rounds with sampled rows (graph_round_sampled)

    def __post_init__(self):
        for name in ("batch_sizes", "tokens", "mtp_tokens", "kv_buckets", "prefill_tokens"):
            hi = PREFILL_MAX_T if name == "prefill_tokens" else RECURRENT_MAX_T if "tokens" in name else None
            object.__setattr__(self, name, _sizes(name, getattr(self, name), 1, hi))
        if not self.batch_sizes or not self.tokens or not self.kv_buckets:
            raise ValueError("graphs: batch_sizes, tokens and kv_buckets must not be empty")
        if self.prefill_tokens and self.batch_sizes[0] != 1:
            raise ValueError(f"graphs.prefill_tokens: prefill graphs are batch-1 graphs; batch_sizes "
                             f"{self.batch_sizes!r} has no 1")
        if not isinstance(self.prefill_pieces, int) or self.prefill_pieces < 1:
            raise ValueError(f"graphs.prefill_pieces: expected a positive integer, got {self.prefill_pieces!r}")
        k = self.round_drafts
        if not isinstance(k, int) or isinstance(k, bool) or k < 0 or \
                (k and (k + 1 not in self.tokens or 1 not in self.mtp_tokens)):
            raise ValueError(f"graphs.round_drafts: expected 0 or a K whose verify size K + 1 is in tokens "
                             f"{self.tokens!r} with 1 in mtp_tokens {self.mtp_tokens!r}, got {k!r}")
        if not isinstance(self.sampled_rounds, bool) or (self.sampled_rounds and not k):
            raise ValueError(f"graphs.sampled_rounds: expected a boolean, True only with round_drafts, got "
                             f"{self.sampled_rounds!r}")

    @property
    def max_tokens(self) -> int:
        """The widest step of any graph (sizes the metadata buffers and the scratch row)."""
        return max(self.tokens + self.mtp_tokens + self.prefill_tokens)

    @property
    def single_tokens(self) -> tuple[int, ...]:
        """The target sizes captured at batch 1: `tokens` and `prefill_tokens`."""
        return tuple(sorted(set(self.tokens) | set(self.prefill_tokens)))


@dataclass
class GraphStats:
    replays: int = 0          # steps served by a captured graph
    eager_steps: int = 0      # steps served by the static-buffer bodies without a graph (eager mode)
    fallbacks: int = 0        # steps handed to the model's own forward
    padded_tokens: int = 0    # MTP tokens computed only to pad a sequence to its graph's T (ragged re-alignments)
    prefill_chunks: int = 0   # prefill chunks served as consecutive batch-1 graph steps (`GraphRunner.prefill`)
    rounds: int = 0           # MTP rounds served by one round graph (`GraphRunner.round`)
    sampled_rounds: int = 0   # of those, rounds with sampled rows (`graph_round_sampled`)
    captured: int = 0
    capture_s: float = 0.0
    reasons: dict = field(default_factory=dict)

    def fallback(self, why: str) -> None:
        self.fallbacks += 1
        self.reasons[why] = self.reasons.get(why, 0) + 1


@dataclass
class _Graph:
    graph: object             # torch.cuda.CUDAGraph
    outputs: tuple            # its static outputs: (hidden, logits), a round's also the packed drafts and argmax


class GraphRunner:
    def __init__(self, model, config: GraphConfig = GraphConfig()):
        self.model, self.cfg = model, config
        if not config.eager and model.device.type != "cuda":
            raise GraphError(f"graphs: CUDA graphs need the model on a CUDA device (it is on {model.device}); "
                             f"use eager mode")
        self.mtp_tokens = config.mtp_tokens if model.mtp is not None else ()
        self.max_batch = config.batch_sizes[-1]
        max_t = max(config.tokens + self.mtp_tokens + config.prefill_tokens)
        ps = model.kv_pool.page_size
        try:
            self._scratch = model.new_state()         # padding rows write here
            self._scratch.ensure_capacity(max_t)
        except CapacityError as e:
            raise GraphError(f"graphs: padding rows need one spare sequence slot and {math.ceil(max_t / ps)} "
                             f"KV page(s) ({e}); size the cache for max_batch + 1 sequences") from None
        self.meta = StaticMeta(self.max_batch, max_t, math.ceil(config.kv_buckets[-1] / ps), ps,
                               self._scratch.pages, self._scratch.slot, model.device)
        self.snap_base = None             # first of our snapshot rows in the GDN pool
        if max(config.tokens) > 1 and model.n_gdn:
            try:
                self.snap_base = model.gdn_pool.add_rows(self.max_batch * max(config.tokens))
            except RuntimeError as e:
                self._scratch.free()
                raise GraphError(f"graphs: {e}") from None
        self._lazy: dict = {}             # states (keys) whose committed GDN state is one of our snapshot rows
        self.mtp_hidden = None
        if self.mtp_tokens:
            self.mtp_hidden = torch.zeros(self.max_batch * max(self.mtp_tokens), model.cfg.hidden_size,
                                          dtype=model.dtype, device=model.device)
        self.round_logits, self.draft_meta = None, []
        if config.round_drafts and self.mtp_tokens:
            self.round_logits = torch.zeros(self.max_batch, model.lm_head.shape[0] * model.tp.size,
                                            dtype=model.dtype, device=model.device)
            self.draft_meta = graph_round.draft_metas(self, config.round_drafts)
        self.sampled = None               # graph_round_sampled.Buffers with config.sampled_rounds
        if config.sampled_rounds and self.round_logits is not None:   # TP: every rank draws (the plan's draws)
            self.sampled = graph_round_sampled.buffers(self.max_batch, config.round_drafts,
                                                       self.round_logits.shape[-1], model.device)
        self.graphs: dict[tuple, _Graph] = {}
        self.stats = GraphStats()
        self._pending: list = []          # (state, PendingSnapshot) living in our snapshot buffers
        self._pool = None
        self._kept: list = []             # kernel workspaces a graph points at: never freed while we live

    # ---- keys ----
    def keys(self) -> list[tuple]:
        c = self.cfg
        out = [("target", b, t, k) for b in c.batch_sizes for t in c.tokens for k in c.kv_buckets]
        out += [("target", 1, t, k) for t in c.prefill_tokens if t not in c.tokens for k in c.kv_buckets]
        out += [("mtp", b, t, k) for b in c.batch_sizes for t in self.mtp_tokens for k in c.kv_buckets]
        if self.round_logits is not None:
            out += [("round", b, c.round_drafts, k) for b in c.batch_sizes for k in c.kv_buckets]
        if self.sampled is not None:
            out += [(s, b, c.round_drafts, k) for s in _ROUNDS[1:] for b in c.batch_sizes for k in c.kv_buckets]
        return out

    def _pad(self, n: int) -> int | None:
        return next((b for b in self.cfg.batch_sizes if b >= n), None)

    def _bucket(self, need: int) -> int | None:
        return next((k for k in self.cfg.kv_buckets if k >= need), None)

    # ---- capture ----
    @torch.no_grad()
    def capture(self) -> float:
        """Warm every graph's body (compiles kernels, tunes GEMV configs, builds repacked weights), then capture
        them all, largest first, into one memory pool. Returns the seconds spent. Idempotent."""
        if self.cfg.eager or self.graphs:
            return 0.0
        t0 = time.perf_counter()
        keys = sorted(self.keys(), key=lambda k: (k[1] * (k[2] + (k[0] in _ROUNDS)), k[3], k[0]), reverse=True)
        stream = torch.cuda.Stream(device=self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):
            for key in keys:              # all warm-ups first: nothing a graph points at may move afterwards
                for _ in range(2):
                    self._fill_padding(key)
                    self._body(key, None)
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        torch.cuda.synchronize(self.model.device)
        self._keep_workspaces()
        self._pool = torch.cuda.graph_pool_handle()
        for key in keys:
            self._fill_padding(key)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool):
                outputs = self._body(key, None)
            self.graphs[key] = _Graph(g, outputs)
        torch.cuda.synchronize(self.model.device)
        self.model.gdn_pool.pins += 1
        self.stats.captured = len(self.graphs)
        self.stats.capture_s = time.perf_counter() - t0
        return self.stats.capture_s

    def _fill_padding(self, key) -> None:
        kind, b, t, _ = key
        pad = RowSpec(torch.zeros(1, dtype=torch.long), 0, self._scratch.pages, self._scratch.slot)
        for dm in self.draft_meta if kind in _ROUNDS else ():
            dm.fill([pad], b, 1)
        t += kind in _ROUNDS                  # a round's verify step: K + 1 tokens
        self.meta.fill([RowSpec(torch.zeros(t, dtype=torch.long), 0, self._scratch.pages, self._scratch.slot)],
                       b, t)

    def _keep_workspaces(self) -> None:
        """Hold the GEMV split-K workspaces alive: a later eager call that grows them must not free the
        buffers the captured graphs write to (see ninfer_kernels.gemv_launch)."""
        try:
            from ninfer_kernels import gemv_launch
        except ImportError:
            return
        self._kept = [t for pair in getattr(gemv_launch, "_WS", {}).values() for t in pair]

    def _body(self, key, host):
        """One step body over the static buffers. host: None when capturing (kernels plan for the KV bucket;
        no host snapshot rows), else (true KV lengths, snapshot rows) for an eager run, which backends that
        read host metadata (the torch reference) need."""
        kind, b, t, bucket = key
        if kind in _ROUNDS:
            return graph_round.body(self, b, t, bucket, host, kind)
        kv, snaps = host if host is not None else ((bucket,) * b, (-1,) * b)
        n = b * t
        if kind == "mtp":
            return mtp_step(self.model, self.meta, self.meta.mtp_ctx(b, t, kv), self.mtp_hidden, n, t)
        pool = self.model.gdn_pool
        ctx = self.meta.target_ctx(b, t, kv, snaps, *((pool.conv, pool.rec) if self.snap_base is not None else ()))
        return target_step(self.model, self.meta, ctx, n)

    def _run(self, key, rows: list[RowSpec], t: int | None = None, extra=None):
        """Fill the metadata with `rows` (t tokens each: the key's T unless given), then replay the key's graph
        (eager mode: run its body with the host's KV lengths and snapshot rows, and `extra` after them)."""
        b, t = key[1], t or key[2]
        self.meta.fill(rows, b, t)
        if self.cfg.eager:
            self.stats.eager_steps += 1
            pad = b - len(rows)
            host = (tuple(r.start + t for r in rows) + (t,) * pad, tuple(r.snap for r in rows) + (-1,) * pad)
            return self._body(key, host + ((extra,) if extra is not None else ()))
        if not self.graphs:
            self.capture()
        g = self.graphs.get(key)
        if g is None:
            raise GraphError(f"graphs: no graph captured for {key}")
        g.graph.replay()
        self.stats.replays += 1
        return g.outputs

    # ---- the model's two entry points ----
    @torch.no_grad()
    def forward(self, batch: list, *, gather: bool = True) -> Output:
        key, why = self._plan_target(batch, gather)
        if key is None:
            self.stats.fallback(why)
            return self.model.forward(batch, gather=gather)
        t = key[2]
        self.model._admit([(s.token_ids, s.state, s.logits) for s in batch])
        snap = [self.snap_base + b * t if s.snapshot else -1 for b, s in enumerate(batch)]
        if any(o >= 0 for o in snap):
            self._protect(batch, snap, t)
        rows = [RowSpec(s.token_ids, s.state.length, s.state.pages, s.state.gdn_row, o)
                for s, o in zip(batch, snap)]
        hidden, logits = self._run(key, rows)
        pool = self.model.gdn_pool
        for s, o in zip(batch, snap):
            if o >= 0:
                s.state.pending = PendingSnapshot(t, pool.conv, pool.rec, o)
                self._pending.append((s.state, s.state.pending))
                self._lazy[s.state] = None
            else:
                s.state.length += t
        return self._output(hidden, logits, [t] * len(batch), t, [s.logits for s in batch])

    @torch.no_grad()
    def prefill(self, batch: list, *, gather: bool = True) -> Output:
        """A step's prefill chunks (`Model.forward`'s contract): each as consecutive batch-1 graph steps when every
        chunk of the part can be (`graph_prefill`), else the model's own forward for all of them."""
        plans = [graph_prefill.plan(self, s, gather) for s in batch]
        if not batch or self._scratch.freed or any(p is None for p in plans):
            return self.model.forward(batch, gather=gather)
        self.stats.prefill_chunks += len(batch)
        return graph_prefill.concat([graph_prefill.run_chunk(self, s, p, gather) for s, p in zip(batch, plans)])

    @torch.no_grad()
    def round(self, rows: list, k: int):
        """An MTP round of k drafts per `graph_round.RoundRow` as one graph -> (the verify's Output, the packed
        drafts, argmax and a sampled round's verdicts), or None when the separate steps must run it (`graph_round`)."""
        return graph_round.run(self, rows, k)

    def _protect(self, batch, snap: list[int], t: int) -> None:
        """Move home every committed state in a snapshot row this step writes, unless the row is its own
        sequence's (each kernel program reads its part of a state before it writes that part of any row)."""
        own = {s.state: (o, o + t) for s, o in zip(batch, snap) if o >= 0}
        for st in list(self._lazy):
            if not st.freed and st.gdn_row != st.slot:
                lo, hi = own.get(st, (0, 0))
                if not lo <= st.gdn_row < hi and any(a <= st.gdn_row < b for a, b in own.values()):
                    st.materialize()
            if st.freed or st.gdn_row == st.slot:
                del self._lazy[st]

    @torch.no_grad()
    def mtp_forward(self, batch: list, *, gather: bool = True) -> Output:
        key, why = self._plan_mtp(batch, gather)
        if key is None:
            self.stats.fallback(why)
            return self.model.mtp_forward(batch, gather=gather)
        t = key[2]
        lens, _ = self.model._admit([(m.token_ids, m.state, m.logits) for m in batch], mtp=True)
        for b, m in enumerate(batch):
            self.mtp_hidden[b * t:b * t + lens[b]].copy_(m.hidden, non_blocking=True)
        rows = [RowSpec(m.token_ids, m.state.length, m.state.parent.pages) for m in batch]
        hidden, logits = self._run(key, rows)
        for m, n in zip(batch, lens):
            m.state.length += n
        if any(n != t for n in lens):
            self.stats.padded_tokens += len(lens) * t - sum(lens)
        return self._output(hidden, logits, lens, t, [m.logits for m in batch], last_only=t > 1)

    # ---- planning: which graph, or why none ----
    def _common(self, items, gather: bool, sizes, ragged: bool = False) -> tuple[tuple | None, str]:
        """items: (token_ids, start, extra-ok) per sequence -> ((padded batch, T, bucket), '') or (None, why).
        ragged: sequences of different token counts are padded at their end to the smallest captured T."""
        if self._scratch.freed:
            return None, "runner closed"
        if not items or len(items) > self.max_batch:
            return None, "batch size"
        if not gather and self.model.tp.size > 1:
            return None, "gather=False"
        lens = {ids.numel() if ids.dim() == 1 else -1 for ids, _, _ in items}
        t = next((x for x in sizes if x >= max(lens)), None) if ragged and min(lens) > 0 else \
            (lens.pop() if len(lens) == 1 else None)
        if t not in sizes:
            return None, "token count"
        if not all(ok for _, _, ok in items):
            return None, "position override / embeddings / logits mode"
        bucket = self._bucket(max(start for _, start, _ in items) + t)
        if bucket is None:
            return None, "context past the largest KV bucket"
        return (self._pad(len(items)), t, bucket), ""

    def _plan_target(self, batch, gather):
        items = [(s.token_ids, s.state.length, s.positions is None and s.inputs_embeds is None
                  and s.logits in LOGITS) for s in batch]
        single = len(batch) == 1 and not batch[0].snapshot      # the prefill sizes: batch 1, no snapshot rows
        key, why = self._common(items, gather, self.cfg.single_tokens if single else self.cfg.tokens)
        if key is None:
            return None, why
        if any(s.snapshot for s in batch):
            self._pending = [(st, p) for st, p in self._pending if st.pending is p and not st.freed]
            if self.snap_base is None and self.model.n_gdn:
                return None, "snapshots not configured"
            if self._pending:
                return None, "snapshot buffers in use"
        return ("target",) + key, ""

    def _plan_mtp(self, batch, gather):
        if not self.mtp_tokens:
            return None, "no MTP graphs"
        h = self.model.cfg.hidden_size
        items = [(m.token_ids, m.state.length, m.positions is None and m.logits in LOGITS
                  and tuple(m.hidden.shape) == (m.token_ids.numel(), h)) for m in batch]
        key, why = self._common(items, gather, self.mtp_tokens, ragged=True)
        if key is None:
            return None, why
        # a graph of t > 1 MTP tokens computes each sequence's last logits row only (`mtp_step`)
        if key[1] > 1 and any(m.logits == "all" for m in batch):
            return None, "position override / embeddings / logits mode"
        return ("mtp",) + key, ""

    def _output(self, hidden, logits, lens: list[int], t: int, modes, last_only: bool = False) -> Output:
        """The Output of a replay: the rows each mode asks for. lens: each sequence's real tokens (<= t; fewer
        only with last_only). last_only: `logits` holds one row per sequence (its last real token's). No pageable
        host->device copy (torch makes it wait for the replay, and the host must run ahead of the GPU): views
        where they do, else indices through pinned memory (`_pick_rows`)."""
        if last_only and "all" in modes:
            raise GraphError("graphs: an MTP graph of t > 1 tokens has only each sequence's last logits row")
        if not last_only and any(n != t for n in lens):
            raise GraphError(f"graphs: sequences of {lens} tokens in a step of {t} need last_only")
        cu, rows = logit_rows(lens, modes)
        picked = [b for b, m in enumerate(modes) if m == "last"] if last_only else rows
        sel, view = _pick_rows(logits, picked, 1 if last_only else t)
        hidden, hview = _pick_rows(hidden, [b * t + j for b, n in enumerate(lens) for j in range(n)], t)
        if self.cfg.copy_outputs:
            hidden, sel = (hidden.clone() if hview else hidden), (sel.clone() if view else sel)
        return Output(logits=sel, hidden=hidden, logit_rows=rows, cu_seqlens=cu)

    def close(self) -> None:
        """Drop the graphs and give the scratch slot and pages back (later calls go to the model)."""
        if self.graphs:
            self.model.gdn_pool.pins -= 1
        self.graphs.clear()
        self._pool = None
        self._scratch.free()


def _pick_rows(logits: torch.Tensor, rows: list[int], t: int) -> tuple[torch.Tensor, bool]:
    """logits[rows] -> (tensor, whether it is a view). A prefix, or every t-th row ending each sequence's t
    rows, is a view; anything else one index_select whose indices travel through pinned memory (no sync)."""
    n = len(rows)
    if rows == list(range(n)):
        return logits[:n], True
    if rows == [(b + 1) * t - 1 for b in range(n)]:
        return logits[:n * t].view(n, t, logits.shape[-1])[:, -1], True
    return logits.index_select(0, small_tensor(rows, torch.long, logits.device)), False
