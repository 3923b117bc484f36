"""Qwen3.8 text decoder + MTP module over an `Ops` backend and a `TPGroup`.

    model = Model(cfg, weights, ops, tp, cache=CacheConfig(...))
    st = model.new_state()
    out = model.forward([SeqInput(ids, st)])                     # prefill chunk / decode (T = 1)
    out = model.forward([SeqInput(verify_ids, st, snapshot=True)]); st.commit(n)   # MTP verify + rollback
    d = model.mtp_forward([MtpInput(next_ids, out.hidden, st.mtp)])

Tokens of `SeqInput` are appended at positions state.length .. state.length + T - 1. Logits are vocab-parallel
per rank and gathered with `tp.all_gather_last` unless `gather=False`. `Output.hidden` is the post-`norm`
hidden (the MTP input) for `forward`, the post-`mtp.norm` hidden (the next draft's input) for `mtp_forward`.
Weights use per-rank shapes; heads per rank = total / tp.size. The residual is added once per rank after
the all-reduce of the partial outputs.

Projections reading the same input are fused by row concatenation at construction (q|k|v, gate|up,
in_proj_qkv|z, in_proj_b|a), which copies them: pass `consume_weights=True` to pop each entry from the
`weights` dict as it is bound, so the unfused copies go away layer by layer instead of doubling the peak.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer_formats.errors import LoadError
from ninfer_formats.model_config import ModelConfig

from . import batch as B
from . import draft_head, inventory
from .layers import get, linear, vec
from .layers.attention import FullAttention
from .layers.gdn import GatedDeltaNet
from .layers.mlp import Mlp
from .layers.mtp import MtpModule
from .sampling import small_tensor, to_device
from .state import CacheConfig, GdnPool, KVPool, MtpState, PendingSnapshot, SeqState
from .tp_group import LocalGroup, TPGroup
from .weights import QWeight

LOGITS = ("all", "last", "none")


def logit_rows(lens, modes) -> tuple[list[int], list[int]]:
    """Packed sequences of `lens` rows with logits modes `modes` -> (cu_seqlens, the packed rows that get logits)."""
    cu, rows = [0], []
    for n, mode in zip(lens, modes):
        if mode == "all":
            rows.extend(range(cu[-1], cu[-1] + n))
        elif mode == "last":
            rows.append(cu[-1] + n - 1)
        cu.append(cu[-1] + n)
    return cu, rows


@dataclass
class SeqInput:
    token_ids: torch.Tensor                  # int64 [T]
    state: SeqState
    snapshot: bool = False                   # keep the GDN state after each token for commit(n)
    logits: str = "all"                      # "all" rows, only the "last" row, or "none"
    positions: torch.Tensor | None = None    # rope positions [T] or [3, T] (MRoPE); default length + arange(T)
    inputs_embeds: torch.Tensor | None = None  # [T, H] replacing the token embeddings (vision splices)


@dataclass
class MtpInput:
    token_ids: torch.Tensor                  # int64 [T]: the NEXT tokens
    hidden: torch.Tensor                     # [T, H]: target post-norm hiddens at the previous positions
    state: MtpState
    logits: str = "all"
    positions: torch.Tensor | None = None    # default mtp.length + arange(T)


@dataclass
class Output:
    logits: torch.Tensor       # [R, V] (or [R, V / tp] with gather=False): rows `logit_rows` of the batch
    hidden: torch.Tensor       # [sumT, H]
    logit_rows: list[int]      # packed-row index of each logits row
    cu_seqlens: list[int]      # sequence b owns packed rows cu[b]:cu[b+1]

    def seq_logits(self, b: int) -> torch.Tensor:
        lo, hi = self.cu_seqlens[b], self.cu_seqlens[b + 1]
        idx = [i for i, r in enumerate(self.logit_rows) if lo <= r < hi]
        return self.logits[idx[0]:idx[-1] + 1] if idx else self.logits[:0]


class _Block:
    def __init__(self, cfg, weights, i, tp, kv_layer, gdn_layer):
        p = f"layers.{i}."
        self.in_ln = vec(weights, f"{p}input_layernorm.weight")
        self.post_ln = vec(weights, f"{p}post_attention_layernorm.weight")
        self.full = cfg.is_full(i)
        self.mixer = (FullAttention(cfg, weights, p, tp, kv_layer) if self.full
                      else GatedDeltaNet(cfg, weights, p, tp, gdn_layer))
        self.mlp = Mlp(weights, p, tp)
        self.gate_params = None if self.full else self.mixer.gate_params()


def _shape(w) -> tuple[int, ...]:
    return tuple(w.shape)


class _Popping:
    """A dict view whose lookups remove the entry (the model then holds the only reference)."""

    def __init__(self, src: dict):
        self.src = src

    def __getitem__(self, name):
        return self.src.pop(name)


class Model:
    def __init__(self, cfg: ModelConfig, weights: dict, ops, tp: TPGroup | None = None, *,
                 cache: CacheConfig = CacheConfig(), dtype: torch.dtype | None = None,
                 consume_weights: bool = False):
        self.cfg, self.ops, self.tp = cfg, ops, tp or LocalGroup()
        inventory.bind({n: _shape(w) for n, w in weights.items()}, cfg, self.tp.size)
        if consume_weights:
            weights = _Popping(weights)
        self.embed = get(weights, "embed_tokens.weight")
        self.device = self.embed.device
        self.dtype = dtype or (self.embed.dtype if isinstance(self.embed, torch.Tensor) else torch.float32)
        self.lm_head = self._lm_head(weights)
        self.norm = vec(weights, "norm.weight")
        kv_i = gdn_i = 0
        self.blocks = []
        for i in range(cfg.num_hidden_layers):
            self.blocks.append(_Block(cfg, weights, i, self.tp, kv_i, gdn_i))
            kv_i, gdn_i = kv_i + cfg.is_full(i), gdn_i + (not cfg.is_full(i))
        self.mtp = MtpModule(cfg, weights, self.tp, kv_i) if cfg.mtp_num_hidden_layers else None
        self.draft_spec = (draft_head.resolve(draft_head.spec_from_env(), self.lm_head) if self.mtp is not None
                           else draft_head.DraftHeadSpec())
        self.draft_head = draft_head.build(self.draft_spec, self.lm_head, self.tp.rank * self.lm_head.shape[0])
        self._alloc(cache, kv_i + (self.mtp is not None), gdn_i)

    def _lm_head(self, weights) -> QWeight:
        if not self.cfg.tie_word_embeddings:
            return linear(weights, "lm_head.weight")
        v = self.cfg.vocab_size // self.tp.size      # tied: this rank's vocab rows of the embedding
        table = self.embed if isinstance(self.embed, QWeight) else QWeight.plain(self.embed, "embed_tokens.weight")
        return table.rows(self.tp.rank * v, (self.tp.rank + 1) * v)

    def _alloc(self, cache: CacheConfig, n_kv: int, n_gdn: int) -> None:
        c, tp = self.cfg, self.tp.size
        self.cache_config = cache
        self.kv_pool = KVPool(cache.num_pages, cache.page_size, n_kv, c.num_key_value_heads // tp, c.head_dim,
                              self.dtype, self.device)
        nv = c.linear_num_value_heads // tp
        self.gdn_pool = GdnPool(cache.max_seqs, n_gdn, c.linear_conv_kernel_dim - 1, c.conv_dim // tp, nv,
                                c.linear_key_head_dim, c.linear_value_head_dim, self.device)
        self.n_gdn = n_gdn

    def new_state(self) -> SeqState:
        return SeqState(self.kv_pool, self.gdn_pool, self.mtp is not None)

    # ---- main model ----
    @torch.no_grad()
    def forward(self, batch: list[SeqInput], *, gather: bool = True) -> Output:
        lens, starts = self._admit([(s.token_ids, s.state, s.logits) for s in batch])
        for s in batch:                 # a graph runner's commit may have left the state in a snapshot row
            s.state.materialize()
        ctx = self._ctx([s.state.pages for s in batch], starts, lens, [s.positions for s in batch])
        full, groups, snap, n_snap = B.gdn_routing(lens, [s.state.slot for s in batch],
                                                   [s.snapshot for s in batch], self.device)
        ctx.gdn, ctx.gdn_groups = full, groups
        if n_snap:
            pool = self.gdn_pool
            ctx.snap_conv = torch.empty(self.n_gdn, n_snap, *pool.conv.shape[2:], device=self.device)
            ctx.snap_rec = torch.empty(self.n_gdn, n_snap, *pool.rec.shape[2:], device=self.device)
        h = self._embed([s.token_ids for s in batch], [s.inputs_embeds for s in batch])
        hidden = self._decoder(h, ctx)
        out = self._output(hidden, lens, [s.logits for s in batch], gather)
        for s, n, off in zip(batch, lens, snap):
            if off < 0:
                s.state.length += n
            else:
                s.state.pending = PendingSnapshot(n, ctx.snap_conv, ctx.snap_rec, off)
        return out

    def _decoder(self, h, ctx):
        ops, eps = self.ops, self.cfg.rms_norm_eps
        x, h, gates = self._in_norm(self.blocks[0], h, None)
        for i, blk in enumerate(self.blocks):
            pool = self.kv_pool if blk.full else self.gdn_pool
            mixed = blk.mixer(ops, x, ctx, pool) if blk.full else blk.mixer(ops, x, ctx, pool, gates)
            x, h = ops.add_rmsnorm(mixed, h, blk.post_ln, eps)
            if i + 1 < len(self.blocks):
                x, h, gates = self._in_norm(self.blocks[i + 1], blk.mlp(ops, x), h)
            else:
                x, h = ops.add_rmsnorm(blk.mlp(ops, x), h, self.norm, eps)
        return x

    def _in_norm(self, blk, x, residual):
        """blk's input norm of residual + x (of x alone before the first block, whose residual stream x then
        starts) -> (normed, residual stream, a GDN block's gates: computed with the norm where the backend can)."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        if blk.gate_params is not None:
            y, s, gates = ops.norm_ba_gates(x, residual, blk.in_ln, eps, *blk.gate_params)
            return y, x if residual is None else s, gates
        if residual is None:
            return ops.rmsnorm(x, blk.in_ln, eps, True), x, None
        return (*ops.add_rmsnorm(x, residual, blk.in_ln, eps), None)

    # ---- MTP ----
    @torch.no_grad()
    def mtp_forward(self, batch: list[MtpInput], *, gather: bool = True) -> Output:
        if self.mtp is None:
            raise LoadError("mtp: this model was loaded without the MTP module")
        lens, starts = self._admit([(m.token_ids, m.state, m.logits) for m in batch], mtp=True)
        ctx = self._ctx([m.state.parent.pages for m in batch], starts, lens, [m.positions for m in batch])
        emb = self._embed([m.token_ids for m in batch], [None] * len(batch))
        hidden = torch.cat([m.hidden.to(self.dtype) for m in batch])
        d = self.mtp(self.ops, emb, hidden, ctx, self.kv_pool)
        out = self._output(d, lens, [m.logits for m in batch], gather, draft=True)
        for m, n in zip(batch, lens):
            m.state.length += n
        return out

    # ---- shared plumbing ----
    def _admit(self, items, mtp: bool = False):
        if not items:
            raise ValueError("forward: empty batch")
        if len({id(st) for _, st, _ in items}) != len(items):
            raise ValueError("forward: a sequence appears twice in one batch")
        lens, starts = [], []
        for ids, st, mode in items:
            seq = st.parent if mtp else st
            if seq.freed:
                raise RuntimeError("forward: sequence state was freed")
            if seq.pending is not None and not mtp:
                raise RuntimeError("forward: commit() the previous snapshot forward first")
            if mode not in LOGITS:
                raise ValueError(f"logits: {mode!r} is not one of {LOGITS}")
            if ids.dim() != 1 or ids.numel() == 0:
                raise ValueError(f"token_ids: expected a non-empty 1-D tensor, got shape {tuple(ids.shape)}")
            lens.append(ids.numel())
            starts.append(st.length)
            seq.ensure_capacity(st.length + ids.numel())
        return lens, starts

    def _ctx(self, pages, starts, lens, overrides) -> B.StepCtx:
        return B.StepCtx(positions=B.positions(starts, lens, overrides, self.device),
                         attn=B.attn_meta(pages, starts, lens, self.kv_pool.page_size, self.device))

    def _embed(self, ids_list, embeds):
        # host ids (prompts, host drafts) and device ids (chained drafts) can share a step
        ids = torch.cat([to_device(i, self.device) for i in ids_list])
        h = self.ops.embedding(ids, self.embed, self.dtype)
        if any(e is not None for e in embeds):
            h, row = h.clone(), 0
            for ids_b, e in zip(ids_list, embeds):
                if e is not None:
                    h[row:row + ids_b.numel()] = e.to(h.dtype)
                row += ids_b.numel()
        return h

    def head_logits(self, x: torch.Tensor, draft: bool = False) -> torch.Tensor:
        """This rank's vocab slice of logits of x: the lm_head's, or for MTP drafts the draft head's
        (`ninfer_rt.draft_head`; the same as the lm_head's unless NINFER_DRAFT_HEAD picks another)."""
        if not draft or self.draft_spec.kind == "lm_head":
            return self.ops.linear(x, self.lm_head)
        rows = self.lm_head.shape[0]
        if self.draft_head is None:          # the shortlist ends below this rank's vocab slice
            return torch.full((x.shape[0], rows), float("-inf"), dtype=self.dtype, device=x.device)
        return draft_head.logits(self.ops, x, self.draft_head, rows)

    def _output(self, hidden, lens, modes, gather, draft: bool = False) -> Output:
        cu, rows = logit_rows(lens, modes)
        if len(rows) == len(hidden):
            sel = hidden
        else:
            sel = hidden.index_select(0, small_tensor(rows, torch.long, hidden.device))
        logits = self.head_logits(sel, draft)
        if gather and self.tp.size > 1:
            logits = self.tp.all_gather_last(logits)
        return Output(logits=logits, hidden=hidden, logit_rows=rows, cu_seqlens=cu)
