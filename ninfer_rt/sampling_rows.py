"""Sampling from tensors of parameters: the processing and the draw a captured graph can hold.

`sampling.process` reads its parameters from host lists and picks its path by them (a sort of the whole
vocabulary for a row without top_k, a top-k selection of the widest row's k). A graph cannot branch on the host,
so the rows it holds (`holds`) are processed from a float32 tensor of parameters `[R, 4]` (temperature, top_k,
top_p, min_p, penalties; `param_rows`) along one fixed path: the temperature's softmax, then a top-k selection of
`width` = min(TOPK_GRAPH_WIDTH, V) columns for the rows with a top_k (top-p and min-p inside it). The eager
`process` takes this same path for such rows, so the drafts and verdicts a graph draws equal the separate steps'.
"""
from __future__ import annotations

import os

import torch

from ninfer_formats.errors import NinferError

TOPK_GRAPH_WIDTH = 64     # the top-k selection's width for rows with 0 < top_k <= it (Qwen's chat default is 20)
PARAM_COLS = 6            # temperature, top_k (0: off), top_p, min_p, frequency and presence penalties
TOPK_CHUNK = 0            # > 0: the selection as top-k of chunks of this many columns, then of their winners
TOPK_KERNEL_ENV = "NINFER_TOPK_KERNEL"


def topk_kernel() -> bool:
    """NINFER_TOPK_KERNEL: 0 (default: torch.topk) or 1 (on CUDA the Triton selection, ninfer_kernels.topk_select:
    ties in column order, but 2.5x torch.topk's time on an H100: bench/NOTES.md §48 C)."""
    v = os.environ.get(TOPK_KERNEL_ENV, "0")
    if v not in ("0", "1"):
        raise NinferError(f"{TOPK_KERNEL_ENV}={v!r}: expected 0 (torch.topk) or 1 (the Triton selection)")
    return v == "1"


def softmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of float32 rows from grid-wide kernels (max, exp, sum, divide). torch.softmax
    gives each row one thread block on CUDA: for a few rows of a 248,320-token vocabulary (a draft step, a
    verdict) that is one SM reading each row three times. One function for every device and path, so that the
    drafts, the verdict and the chained or read-back paths draw from the same distributions. A row of -inf stays
    nan, as with torch.softmax."""
    e = torch.sub(x, x.amax(-1, keepdim=True)).exp_()
    return e.div_(e.sum(-1, keepdim=True))


def selects(params: list, vocab: int) -> bool:
    """Whether any sampled row has a top_k (`processed`'s select)."""
    return any(top_k_of(p, vocab) for p in params if p is not None and not p.greedy)


def top_k_of(p, vocab: int) -> int:
    """A row's top_k as the processing reads it: 0 when off (0, or at least the vocabulary)."""
    return p.top_k if 0 < p.top_k < vocab else 0


def holds(p, vocab: int) -> bool:
    """A sampled row the fixed path processes: temperature alone (top-p and min-p off, no top_k), or a top_k of at
    most the selection's width with any top-p and min-p. A row without top_k but with top-p or min-p needs the
    sort of the whole vocabulary (`sampling._truncate`)."""
    k = top_k_of(p, vocab)
    if k == 0:
        return p.top_p == 1 and p.min_p == 0
    return k <= min(TOPK_GRAPH_WIDTH, vocab)


def param_rows(params: list, vocab: int) -> torch.Tensor:
    """The parameters of `processed` and `penalize`, float32 [R, 6] on the host. Greedy rows (None: a TP
    follower's) get temperature 1 and nothing else (their distribution is never drawn from: `race` takes their
    argmax)."""
    return torch.tensor([[1.0, 0.0, 1.0, 0.0, 0.0, 0.0] if p is None or p.greedy else
                         [float(p.temperature), float(top_k_of(p, vocab)), float(p.top_p), float(p.min_p),
                          float(p.frequency_penalty), float(p.presence_penalty)]
                         for p in params], dtype=torch.float32).reshape(len(params), PARAM_COLS)


def penalize(x: torch.Tensor, counts: torch.Tensor, prm: torch.Tensor) -> torch.Tensor:
    """float32 logits x [R, V] less each row's frequency x count + presence x (count > 0) (prm: `param_rows`), in
    `sampling.process`'s order of operations (a row without penalties comes back unchanged: x - 0)."""
    return x - (prm[:, 4:5] * counts + prm[:, 5:6] * (counts > 0).float())


def processed(x: torch.Tensor, prm: torch.Tensor, select: bool = True) -> torch.Tensor:
    """Processed distributions [R, V] float32 of logits x [R, V] under parameter rows prm [R, 4] (every row one that
    `holds` accepts): the temperature's softmax; rows with a top_k keep at most top_k tokens of a top-k selection,
    then those whose preceding mass is below top_p, then those at least min_p times the most likely; renormalised.
    Rows without a top_k keep the softmax. select=False: no row has a top_k (the softmax alone: a top-k selection
    of one 248,320-wide row is dozens of kernels)."""
    probs = softmax_rows(x / prm[:, :1])      # bf16 / float32 divides in float32: `process`'s x.float() / t
    if not select:
        return probs
    k = prm[:, 1:2]
    width = min(TOPK_GRAPH_WIDTH, x.shape[1])
    sp, order = select_top(probs, width)
    keep = torch.arange(width, device=x.device)[None, :] < k
    sp = sp * keep
    # keep a token while the mass strictly before it (within top-k) is below top_p: the first always stays
    before = (sp.cumsum(-1) - sp) / sp.sum(-1, keepdim=True)
    keep &= before < prm[:, 2:3]
    keep &= sp >= prm[:, 3:4] * sp[:, :1]
    sp = sp * keep
    sp = sp / sp.sum(-1, keepdim=True)
    return torch.where(k == 0, probs, torch.zeros_like(probs).scatter_(1, order, sp))


def select_top(probs: torch.Tensor, width: int, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` largest values of each row, sorted, and their columns (torch.topk's contract). On CUDA with
    NINFER_TOPK_KERNEL=1: the Triton selection (ties in column order). With a chunk (default TOPK_CHUNK; 0: one
    torch.topk per row) each row's chunks give their top `width` first, then the winners theirs (measured slower
    at four rows, bench/NOTES.md §47 F). The same values; ties may come in another column order, so the eager
    `process` and the graphs use this one function."""
    chunk = TOPK_CHUNK if chunk is None else chunk
    R, V = probs.shape
    if probs.is_cuda and topk_kernel():
        from ninfer_kernels.topk_select import topk_rows
        return topk_rows(probs, width)
    if chunk <= 0 or V <= chunk:
        return probs.topk(width, dim=-1)
    n = -(-V // chunk)
    # padding below every probability (>= 0): never chosen before a real column
    padded = torch.nn.functional.pad(probs, (0, n * chunk - V), value=-1.0).view(R, n, chunk)
    v, i = padded.topk(min(width, chunk), dim=-1)
    cols = (i + torch.arange(0, n * chunk, chunk, device=probs.device)[:, None]).view(R, -1)
    sp, j = v.view(R, -1).topk(width, dim=-1)
    return sp, cols.gather(1, j)


def race(probs: torch.Tensor, noise: torch.Tensor, sampled: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """One token per row -> int64 [R]: a sampled row's exponential race argmax(probs / noise) (`sampling.sample`'s
    draw), a greedy row's argmax of its raw logits."""
    return torch.where(sampled, (probs / noise).argmax(-1), logits.argmax(-1))
