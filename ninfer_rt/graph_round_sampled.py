"""A sampled MTP round as one graph: `graph_round`'s round with each draft drawn and the verdict decided inside it.

Without it a sampled round runs as separate steps: each draft step's processing and draw (~9 launches) and the
verdict's processing, rejection and residual draw between the graphs, ~1.1 ms of GPU gaps per round on a 27B
H100 against a greedy round's 0.24 (bench/NOTES.md §46 C) and ~0.7 ms more of the host's time (§46 E).

The graph's randomness is drawn before the replay, from each request's generator in the order the separate steps
draw it (the K drafts' exponential noise, then the verdict's K uniforms and its residual noise), so a seeded
request's tokens and stream positions are the separate steps' (`fill`). The draft and target distributions come
from `sampling_rows.processed` over a parameter tensor, the path the eager `process` takes for the same rows, so
the graph draws the separate steps' tokens (on CUDA up to torch.topk's order among tied values, which
NINFER_TOPK_KERNEL=1 fixes). Greedy rows of the same batch keep their argmax drafts and verdict.

Rows it holds: plain sampled or greedy rows (no penalties, bias, bans or grammar: the engine's chain) whose
truncation `sampling_rows.holds` (temperature alone, or a top_k up to its width with any top-p and min-p). With TP
every rank replays the same graph: the plan brings the followers each sampled row's parameters and generator state
(engine_core's protocol), so their noise, drafts and verdicts are the leader's. `NINFER_SAMPLED_ROUNDS=0` turns it
off (engine_layout).

Two graphs per batch size: "sround" processes with the top-k selection, "tround" without it, for batches whose
sampled rows have no top_k (temperature alone; the selection costs a sampled round ~0.4 ms on a 27B H100 otherwise).

Packed output: `graph_round`'s (drafts, verify argmax), then (accepted drafts, token) for each padded row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams, copy_in
from .sampling_rows import holds, param_rows, penalize, processed, race, selects, top_k_of
from .spec_verify import greedy_verify, rejection_verify


@dataclass
class Buffers:
    """The static inputs of the sampled round graphs (padded batch rows)."""

    prm: torch.Tensor         # float32 [B, 6]: `sampling_rows.param_rows`
    sampled: torch.Tensor     # bool [B]: the row draws (else its argmax decides)
    noise: torch.Tensor       # float32 [B, K, V]: each draft's exponential race noise
    u: torch.Tensor           # float32 [B, K]: the verdict's acceptance uniforms
    rnoise: torch.Tensor      # float32 [B, V]: the verdict's residual (or bonus) draw noise
    counts: torch.Tensor      # float32 [B, V]: a penalized row's generated-token counts ("sround" only)


def buffers(max_batch: int, k: int, vocab: int, device) -> Buffers:
    prm = param_rows([SamplingParams()] * max_batch, vocab).to(device)      # padding rows: valid parameters
    ones = dict(dtype=torch.float32, device=device)
    return Buffers(prm, torch.zeros(max_batch, dtype=torch.bool, device=device),
                   torch.ones(max_batch, k, vocab, **ones), torch.zeros(max_batch, k, **ones),
                   torch.ones(max_batch, vocab, **ones), torch.zeros(max_batch, vocab, **ones))


def why_not(runner, rows: list) -> str:
    """'' when the sampled round graphs serve these rows' sampling, else the reason."""
    if runner.sampled is None:
        return "no sampled round graphs"
    vocab = runner.round_logits.shape[-1]
    if any(r.params is None or not holds(r.params, vocab) for r in rows if not _greedy(r)):
        return "sampling the graph does not hold (top-p or min-p without top_k, or a top_k past its width)"
    if any(r.params is not None and r.params.has_penalties and not _counted(r, vocab) for r in rows):
        return "penalties the graph does not hold (a repetition penalty, a greedy row's, or none with a top_k)"
    return ""


def _counted(r, vocab: int) -> bool:
    """A penalized row the "sround" graph penalizes: sampled, presence / frequency only, with a top_k (the kind that
    applies penalties), its counts on the device."""
    p = r.params
    return not p.greedy and p.repetition_penalty == 1 and top_k_of(p, vocab) > 0 and r.counts is not None


def kind(rows: list, vocab: int) -> str:
    """The graph kind of a round with sampled rows: "sround" (a top-k selection) or "tround" (temperature alone)."""
    return "sround" if selects([r.params for r in rows], vocab) else "tround"


def _greedy(r) -> bool:
    return r.params is None or r.params.greedy


def fill(buf: Buffers, rows: list, k: int) -> None:
    """The rows' parameters, then each sampled row's draws from its generator in the separate steps' order: draft
    j's race noise (`sampling.sample`), then the verdict's uniforms and residual noise (`speculative._draws`)."""
    n, vocab = len(rows), buf.noise.shape[-1]
    prm = param_rows([r.params for r in rows], vocab)
    copy_in(buf.prm[:n], prm)
    copy_in(buf.sampled[:n], torch.tensor([not _greedy(r) for r in rows]))
    for i, r in enumerate(rows):
        if prm[i, 4:].any():        # the others' stale counts are finite, and a zero penalty leaves them out
            buf.counts[i].copy_(r.counts, non_blocking=True)
    for i, r in enumerate(rows):
        if _greedy(r):
            continue
        for j in range(k):
            buf.noise[i, j].exponential_(1, generator=r.generator)
        buf.u[i:i + 1, :k].uniform_(0, 1, generator=r.generator)
        buf.rnoise[i].exponential_(generator=r.generator)


class Drafter:
    """Draws a round's drafts inside the graph body, keeping each draft distribution for the verdict."""

    def __init__(self, buf: Buffers, b: int, select: bool):
        self.buf, self.b, self.select, self.q = buf, b, select, []
        self.counts = [buf.counts[:b]]      # "sround": each draft's penalty counts, the round's drafts added

    def _penalized(self, logits: torch.Tensor, counts: torch.Tensor, prm: torch.Tensor) -> torch.Tensor:
        return penalize(logits, counts, prm) if self.select else logits      # bf16 - float32: float32

    def __call__(self, logits: torch.Tensor, j: int) -> torch.Tensor:
        b = self.b
        prm = self.buf.prm[:b]
        q = processed(self._penalized(logits, self.counts[-1], prm), prm, self.select)
        self.q.append(q)
        d = race(q, self.buf.noise[:b, j], self.buf.sampled[:b], logits)
        if self.select:
            self.counts.append(self.counts[-1].scatter_add(1, d[:, None], torch.ones_like(q[:, :1])))
        return d

    def verdicts(self, ids: torch.Tensor, logits: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
        """int64 [b, 2]: (accepted drafts, token) of each row: rejection sampling (`spec_verify.rejection_verify`)
        for a sampled row, the longest matching prefix for a greedy one. ids [b, K], logits [b (K + 1), V]."""
        b, k = ids.shape
        buf, t = self.buf, k + 1
        prm = buf.prm[:b].repeat_interleave(t, 0)
        if self.select:         # target column i has seen d_1..d_i (`speculative.column_counts`)
            logits = self._penalized(logits, torch.stack(self.counts, 1).view(b * t, -1), prm)
        p = processed(logits, prm, self.select).view(b, t, -1)
        n_s, tok_s = rejection_verify(p, torch.stack(self.q, 1), ids, buf.u[:b, :k], buf.rnoise[:b])
        n_g, tok_g = greedy_verify(argmax.view(b, t), ids)
        s = buf.sampled[:b]
        return torch.stack([torch.where(s, n_s, n_g), torch.where(s, tok_s, tok_g)], 1)
