"""The engine's memory and graph layout: what every rank builds from the same arguments (the KV/GDN cache
sizes, the CUDA-graph shapes, the context limit), so the leader and the followers agree without messages.

`EngineError` lives here, the lowest of the engine modules, so the layout can raise it; `ninfer_rt.engine`
re-exports all of this.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ninfer_formats.errors import NinferError

from .graphs import GraphConfig
from .sampling_rows import topk_kernel
from .speculative import SpecConfig
from .state import CacheConfig

DEFAULT_CONTEXT = 8192          # default KV reservation per batch slot when kv_pages is not given
DEFAULT_PAGE = 16
GRAPH_MODES = ("auto", "eager", "off")
GRAPH_MAX_BATCH = 64            # larger decode batches run without graphs (capture time, snapshot buffers)
PREFILL_GRAPH_TOKENS = (2, 4, 8, 16)    # batch-1 graph sizes short prefill chunks are cut into (graph_prefill)
PREFILL_GRAPHS_ENV = "NINFER_PREFILL_GRAPHS"
ROUND_GRAPHS_ENV = "NINFER_ROUND_GRAPHS"
SAMPLED_ROUNDS_ENV = "NINFER_SAMPLED_ROUNDS"


class EngineError(NinferError):
    """A request cannot be served as given (overlong prompt, bad token id, duplicate id, ...)."""


def cache_config(cfg, max_batch: int, kv_pages: int | None, page_size: int = DEFAULT_PAGE) -> CacheConfig:
    """The same on every rank (followers build it from the same arguments)."""
    if not isinstance(max_batch, int) or max_batch < 1:
        raise EngineError(f"max_batch: expected a positive integer, got {max_batch!r}")
    if kv_pages is None:
        kv_pages = max_batch * math.ceil(min(cfg.max_position_embeddings, DEFAULT_CONTEXT) / page_size)
    return CacheConfig(num_pages=kv_pages, page_size=page_size, max_seqs=max_batch)


@dataclass(frozen=True)
class Layout:
    """What every rank builds from the same arguments: the cache, the graph shapes, the context limit."""
    cache: CacheConfig
    graphs: GraphConfig | None
    max_model_len: int


def graph_config(device, ops, spec: SpecConfig | None, max_batch: int, max_model_len: int,
                 mode: str | GraphConfig = "auto") -> GraphConfig | None:
    """The engine's graphs: decode (and, with MTP, verify of 1..K drafts, MTP steps of 1..K+1 tokens: the
    1-token draft step and the alignment after a round that emitted a + 1 tokens, and a greedy round of K drafts
    as one graph unless NINFER_ROUND_GRAPHS=0: `graph_round`) at batch sizes 1, 2, 4, ...
    up to max_batch (at most GRAPH_MAX_BATCH), one KV bucket = the context limit.
    "auto": captured on CUDA with the triton backend (the torch reference reads host metadata a graph would
    freeze), none elsewhere; "eager": the same static-buffer steps without capture; "off": the plain model."""
    if isinstance(mode, GraphConfig):
        return mode
    if mode not in GRAPH_MODES:
        raise EngineError(f"graphs: expected one of {', '.join(GRAPH_MODES)} or a GraphConfig, got {mode!r}")
    if mode == "off" or torch.device(device).type != "cuda" or type(ops).__name__ != "TritonOps":
        return None
    top = min(max_batch, GRAPH_MAX_BATCH)
    sizes = tuple(sorted({1 << i for i in range(top.bit_length()) if 1 << i < top} | {top}))
    k = spec.num_draft_tokens if spec is not None else 0
    rd, sampled = round_graph_drafts(k), sampled_rounds()       # both variables checked, whatever their values
    return GraphConfig(batch_sizes=sizes, tokens=tuple(range(1, k + 2)), mtp_tokens=tuple(range(1, k + 2)) if k else (),
                       kv_buckets=(max_model_len,), eager=mode == "eager", prefill_tokens=prefill_graph_tokens(),
                       round_drafts=rd, sampled_rounds=bool(rd) and sampled)


def prefill_graph_tokens() -> tuple[int, ...]:
    """The batch-1 prefill graph sizes (`graph_prefill`): PREFILL_GRAPH_TOKENS, none with NINFER_PREFILL_GRAPHS=0."""
    v = os.environ.get(PREFILL_GRAPHS_ENV, "1")
    if v not in ("0", "1"):
        raise EngineError(f"{PREFILL_GRAPHS_ENV}={v!r}: expected 1 (short prefill chunks as graph steps) or 0")
    return PREFILL_GRAPH_TOKENS if v == "1" else ()


def round_graph_drafts(k: int) -> int:
    """The K of the round graphs (`graph_round`: a greedy MTP round of K drafts as one graph): k, or 0 (none) with
    NINFER_ROUND_GRAPHS=0 or without MTP."""
    v = os.environ.get(ROUND_GRAPHS_ENV, "1")
    if v not in ("0", "1"):
        raise EngineError(f"{ROUND_GRAPHS_ENV}={v!r}: expected 1 (an MTP round as one graph) or 0")
    return k if v == "1" else 0


def sampled_rounds() -> bool:
    """NINFER_SAMPLED_ROUNDS: 1 (default: rounds with sampled rows as one graph too, `graph_round_sampled`) or 0 (they
    take the separate steps: the comparison run)."""
    v = os.environ.get(SAMPLED_ROUNDS_ENV, "1")
    if v not in ("0", "1"):
        raise EngineError(f"{SAMPLED_ROUNDS_ENV}={v!r}: expected 1 (a sampled MTP round as one graph) or 0")
    return v == "1"


def engine_layout(loaded, ops, spec: SpecConfig | None, max_batch: int, kv_pages: int | None,
                  page_size: int = DEFAULT_PAGE, max_model_len: int | None = None,
                  graphs: str | GraphConfig = "auto") -> Layout:
    """With graphs the pool gets one more sequence slot and the pages of one padded row (the runner's scratch
    sequence), so the requests see the same capacity as without."""
    topk_kernel()                     # NINFER_TOPK_KERNEL checked at start, not at the first sampled request
    base = cache_config(loaded.config, max_batch, kv_pages, page_size)
    cap = base.num_pages * base.page_size
    limit = min(loaded.config.max_position_embeddings, cap, max_model_len or cap)
    g = graph_config(getattr(loaded, "device", "cpu"), ops, spec, max_batch, limit, graphs)
    if g is None:
        return Layout(base, None, limit)
    spare = math.ceil(g.max_tokens / page_size)
    return Layout(CacheConfig(num_pages=base.num_pages + spare, page_size=page_size, max_seqs=max_batch + 1),
                  g, limit)
