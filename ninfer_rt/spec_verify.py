"""Acceptance rules of a speculative round (reference §12), as pure batched tensor functions.

A round verifies K drafts d_1..d_K with K+1 target distributions p_0..p_K (p_{i-1} decides d_i; p_K gives
the bonus token). Both functions return (n_acc [B], token [B]): the round commits d_1..d_{n_acc} then `token`.

Randomness is passed in (uniforms `u`, exponentials `noise`) so the rule is a deterministic function of its
inputs: the engine draws them from each request's own generator, and the statistical test draws millions
at once.
"""
from __future__ import annotations

import torch


def leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[B, K] bool -> [B] count of leading True values."""
    if mask.shape[-1] == 0:
        return torch.zeros(mask.shape[:-1], dtype=torch.long, device=mask.device)
    return mask.long().cumprod(-1).sum(-1)


def greedy_verify(target_ids: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_ids [B, K+1] (argmax of p_0..p_K), drafts [B, K]: longest matching prefix + target token."""
    n_acc = leading_true(drafts == target_ids[:, :-1])
    return n_acc, target_ids.gather(1, n_acc[:, None])[:, 0]


def rejection_verify(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor,
                     noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless rejection sampling: the committed tokens are distributed exactly as target samples.

    p [B, K+1, V] target processed distributions, q [B, K, V] the draft distributions each d_i was drawn
    from, drafts [B, K], u [B, K] ~ U[0, 1), noise [B, V] ~ Exp(1).
    Accept d_i with probability min(1, p_{i-1}(d_i) / q_i(d_i)); at the first rejection draw from
    norm(max(p_{i-1} - q_i, 0)); if all K are accepted draw the bonus from p_K.
    """
    B, K = drafts.shape
    if K == 0:
        # plain sampled decoding: nothing to accept, and the residual below is p_0 itself (q is empty)
        return torch.zeros(B, dtype=torch.long, device=p.device), (p[:, 0] / noise).argmax(-1)
    idx = drafts[..., None]
    pd = p[:, :K].gather(-1, idx)[..., 0]
    qd = q.gather(-1, idx)[..., 0]
    n_acc = leading_true(u * qd < pd)             # u < p/q without dividing by a possibly tiny q
    rows = torch.arange(B, device=p.device)
    p_sel = p[rows, n_acc]                         # p_{n_acc}: the rejecting position, or p_K
    q_pad = torch.cat([q, q.new_zeros(B, 1, p.shape[-1])], dim=1)
    resid = (p_sel - q_pad[rows, n_acc]).clamp_min(0)
    # an all-zero residual means p == q there, where rejection has probability 0; p is the safe fallback
    empty = resid.sum(-1, keepdim=True) <= 0
    resid = torch.where(empty, p_sel, resid)
    # exponential race: argmax w_i / E_i picks i with probability w_i / sum(w)
    token = (resid / noise).argmax(-1)
    return n_acc, token
