"""Short prefill chunks through the captured target graphs: a chunk of n tokens runs as consecutive batch-1
graph steps whose sizes add up to n (largest first), instead of one eager forward.

Why: an eager forward of the 27B model launches ~1,500 kernels from Python (~40 us each with Triton), about
100 ms whatever the chunk's length, while a captured step of up to 16 tokens costs about one decode step. The
chunks that matter are short: a prompt's tail after a prefix-cache hit, the tail the prefix cache's page-boundary
cut leaves, a chat turn. Each piece is an ordinary target step (KV written, GDN state advanced in place, no
snapshot rows), so the result is the eager forward's up to rounding. A chunk goes eagerly (with the rest of its
step's prefill part) when it needs more than `GraphConfig.prefill_pieces` pieces, carries positions or image
embeddings, asks for snapshots, or would pass the largest KV bucket.
"""
from __future__ import annotations

import torch

from .model import LOGITS, Output, SeqInput


def pieces(n: int, sizes: tuple[int, ...], most: int) -> list[int] | None:
    """n tokens as captured sizes, largest first (sizes hold 1, so any n > 0 splits), or None past `most` pieces."""
    out, left = [], n
    for t in sorted(sizes, reverse=True):
        k, left = divmod(left, t)
        out += [t] * k
    return out if n > 0 and not left and len(out) <= most else None


def plan(runner, s, gather: bool) -> list[int] | None:
    """The pieces of one prefill chunk, or None when it must run eagerly."""
    cfg, model = runner.cfg, runner.model
    if not cfg.prefill_tokens or s.snapshot or s.positions is not None or s.inputs_embeds is not None \
            or s.logits not in LOGITS or s.token_ids.dim() != 1 or (not gather and model.tp.size > 1):
        return None
    if runner._bucket(s.state.length + s.token_ids.numel()) is None:
        return None
    return pieces(s.token_ids.numel(), cfg.single_tokens, cfg.prefill_pieces)


def run_chunk(runner, s, sizes: list[int], gather: bool) -> Output:
    """One chunk as consecutive graph steps -> the Output its eager forward would give."""
    hidden, logits, rows, lo, last = [], [], [], 0, None
    for j, t in enumerate(sizes):
        mode = s.logits if s.logits == "all" or j == len(sizes) - 1 else "none"
        last = runner.forward([SeqInput(s.token_ids[lo:lo + t], s.state, logits=mode)], gather=gather)
        hidden.append(last.hidden)
        if last.logit_rows:
            logits.append(last.logits)
            rows += [lo + r for r in last.logit_rows]
        lo += t
    return Output(logits=_cat(logits) if logits else last.logits, hidden=_cat(hidden), logit_rows=rows,
                  cu_seqlens=[0, lo])


def concat(outs: list[Output]) -> Output:
    """Per-sequence Outputs -> one Output over the sequences in order."""
    if len(outs) == 1:
        return outs[0]
    cu, rows, logits = [0], [], []
    for o in outs:
        rows += [cu[-1] + r for r in o.logit_rows]
        if o.logit_rows:
            logits.append(o.logits)
        cu.append(cu[-1] + o.cu_seqlens[-1])
    return Output(logits=_cat(logits) if logits else outs[-1].logits, hidden=_cat([o.hidden for o in outs]),
                  logit_rows=rows, cu_seqlens=cu)


def _cat(xs: list[torch.Tensor]) -> torch.Tensor:
    return xs[0] if len(xs) == 1 else torch.cat(xs)
