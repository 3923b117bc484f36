"""MTP speculative decoding: configuration, statistics, and the leader's verification of a round.

A round for a sequence with committed length L and unfed last token t_0 (reference §11-§12):
1. draft d_1..d_k with the MTP module: d_1 from the logits left by the previous alignment, d_{j+1} from an
   MTP step on (d_j, previous MTP hidden) at position L + j - 1 (writes provisional MTP KV);
2. one target forward over [t_0, d_1..d_k] at L..L+k with GDN snapshots;
3. accept (greedy: longest matching prefix; sampling: rejection sampling vs the draft distributions) and
   emit d_1..d_a plus one target token, cut at a stop;
4. commit the target state to the emitted count, rewind the MTP cache to L and re-run it over positions
   L..L+a with the emitted tokens and the *target* hiddens h_L..h_{L+a}; its last output gives the next d_1.
The engine drives these steps (it owns batching and the TP message flow); this module owns the rules.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ninfer_formats.errors import NinferError

from .sampling import SamplingParams, process, small_tensor
from .spec_verify import greedy_verify, rejection_verify

MAX_DRAFT_TOKENS = 7
DRAFT_CHAIN_ENV = "NINFER_DRAFT_CHAIN"


class SpecError(NinferError):
    """Speculative decoding is misconfigured or not possible with this artifact."""


@dataclass(frozen=True)
class SpecConfig:
    method: str = "mtp"
    num_draft_tokens: int = 3

    def __post_init__(self):
        if self.method != "mtp":
            raise SpecError(f"spec.method: only 'mtp' is supported, got {self.method!r}")
        k = self.num_draft_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise SpecError(f"spec.num_draft_tokens: expected an integer in 1..{MAX_DRAFT_TOKENS}, got {k!r}")


def draft_chain_env() -> bool:
    """NINFER_DRAFT_CHAIN: 1 (default: greedy drafts, and with TP1 plain sampled ones, stay on the device between the
    draft steps, the engine's `_draft_chained`) or 0 (every draft read back before the next draft step: the
    comparison run)."""
    v = os.environ.get(DRAFT_CHAIN_ENV, "1")
    if v not in ("0", "1"):
        raise SpecError(f"{DRAFT_CHAIN_ENV}={v!r}: expected 1 or 0")
    return v == "1"


@dataclass
class SpecStats:
    """Counts over rounds that drafted at least one token (1-token fallback steps are counted apart)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    fallback_steps: int = 0
    drafted_at: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT_TOKENS)
    accepted_at: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT_TOKENS)

    def record(self, k: int, n_acc: int) -> None:
        if k == 0:
            self.fallback_steps += 1
            return
        self.rounds += 1
        self.drafted += k
        self.accepted += n_acc
        for i in range(k):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < n_acc

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """P(draft i accepted | drafted); 1 + their sum is the mean acceptance length."""
        return [a / d for a, d in zip(self.accepted_at, self.drafted_at) if d]

    @property
    def tokens_per_round(self) -> float:
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict:
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": self.acceptance, "acceptance_per_position": self.acceptance_per_position,
                "tokens_per_round": self.tokens_per_round, "fallback_steps": self.fallback_steps}


def column_counts(base: torch.Tensor | None, drafts: list[int], vocab: int) -> torch.Tensor | None:
    """Penalty counts for columns 0..k of a round: column j has also seen d_1..d_j. -> [k+1, V] or None."""
    if base is None:
        return None
    k = len(drafts)
    out = base.expand(k + 1, vocab).clone()
    for j, d in enumerate(drafts):
        out[j + 1:, d] += 1
    return out


def draft_distributions(logits: torch.Tensor, params: list[SamplingParams], counts: list,
                        prev: list[list[int]], vocab: int, seen: list | None = None,
                        ban: list[tuple] | None = None, allow: torch.Tensor | None = None) -> torch.Tensor:
    """Processed MTP distributions [R, V] for the next draft of each row (penalties see earlier drafts; `ban`,
    `allow`: process's)."""
    rows = [None if c is None else column_counts(c, d, vocab)[-1] for c, d in zip(counts, prev)]
    return process(logits, params, rows, seen, ban, allow)


@dataclass
class RoundInput:
    """One sequence's verify result, leader side."""

    params: SamplingParams
    logits: torch.Tensor                 # [k+1, V] target logits of [t_0, d_1..d_k]
    drafts: list[int]
    q: list[torch.Tensor]                # draft distributions [V] each (sampling only)
    counts: torch.Tensor | None          # penalty counts before the round
    generator: torch.Generator | None
    argmax: list[int] | None = None      # the argmax of each logits row, when the host has read it back already
    seen: torch.Tensor | None = None     # bool [V]: the prompt's tokens (repetition penalty)
    ban: list[tuple] | None = None       # per logits row: token ids it may not choose (sampling.stop_ban)
    allow: torch.Tensor | None = None    # bool [k+1, V]: the tokens a grammar allows each row (grammar.Constraint)

    @property
    def argmax_decides(self) -> bool:
        return argmax_decides(self.params, self.counts) and not (self.ban and any(self.ban)) and self.allow is None


def verify(r: RoundInput) -> tuple[int, int]:
    """-> (accepted drafts, the target token after them) for one sequence."""
    n, tok = verify_on_device(r).tolist()
    return n, tok


def verify_on_device(r: RoundInput) -> torch.Tensor:
    """`verify` without the host sync: int64 [2] = (accepted drafts, target token) on the logits' device, so
    a batch of sequences reads all its verdicts back in one transfer."""
    k, vocab = len(r.drafts), r.logits.shape[-1]
    p = _target_probs([r])
    drafts = small_tensor([r.drafts], torch.long, p.device).reshape(1, k)
    if r.params.greedy:
        n, tok = greedy_verify(p.argmax(-1)[None], drafts)
    else:
        q = torch.stack(r.q)[None] if k else p.new_zeros(1, 0, vocab)
        n, tok = rejection_verify(p[None], q, drafts, *_draws([r], k, vocab, p.device))
    return torch.stack([n[0], tok[0]])


def _target_probs(rows: list[RoundInput]) -> torch.Tensor:
    """The processed distributions of every row's K + 1 target rows, stacked [sum(K + 1), V]: each column sees the
    row's earlier drafts in its penalty counts. A grammar mask (`allow`) only for a single row (`_sampled_batch`)."""
    vocab = rows[0].logits.shape[-1]
    params, counts, seen, ban = [], [], [], []
    for r in rows:
        n = len(r.drafts) + 1
        params += [r.params] * n
        counts += _split(column_counts(r.counts, r.drafts, vocab), n)
        seen += [r.seen] * n
        ban += r.ban if r.ban is not None else [()] * n
    logits = rows[0].logits if len(rows) == 1 else torch.cat([r.logits for r in rows])
    return process(logits, params, counts, seen, ban, rows[0].allow if len(rows) == 1 else None)


def _draws(rows: list[RoundInput], k: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's acceptance uniforms [R, k] and residual noise [R, V] from its generator: row by row, the
    uniforms first (one row's stream, or the shared default one, is consumed in the same order either way)."""
    us, noise = [], torch.empty(len(rows), vocab, device=device)
    for i, r in enumerate(rows):
        us.append(torch.rand(1, k, generator=r.generator, device=device))
        noise[i].exponential_(generator=r.generator)
    return (us[0] if len(us) == 1 else torch.cat(us)), noise


def _sampled_batch(rows: list[RoundInput]) -> bool:
    """Rows one `verify_sampled` serves: all sampled, the same draft count (0: plain sampled decoding), no grammar
    masks (a mask on some rows only would change what `process` keeps for the others)."""
    k = len(rows[0].drafts)
    return len(rows) > 1 and all(not r.params.greedy and len(r.drafts) == k and len(r.q) == k
                                 and r.allow is None for r in rows)


def verify_sampled(rows: list[RoundInput]) -> torch.Tensor:
    """`verify_on_device` for a batch of sampled rows (`_sampled_batch`) in one pass: one `process` over every
    row's K + 1 target rows and one rejection, instead of ~30 launches per row. The per-row arithmetic and each
    generator's draws are those of `verify_on_device`. -> int64 [R, 2]."""
    k, vocab, R = len(rows[0].drafts), rows[0].logits.shape[-1], len(rows)
    p = _target_probs(rows).view(R, k + 1, vocab)
    drafts = small_tensor([r.drafts for r in rows], torch.long, p.device).reshape(R, k)
    q = torch.stack([qj for r in rows for qj in r.q]).view(R, k, vocab) if k else p.new_zeros(R, 0, vocab)
    n, tok = rejection_verify(p, q, drafts, *_draws(rows, k, vocab, p.device))
    return torch.stack([n, tok], 1)


def argmax_decides(params: SamplingParams, counts: torch.Tensor | None) -> bool:
    """Greedy without penalties in effect, a bias or a token restriction: the argmax of the raw logits is the
    decision."""
    return params.greedy and not params.logit_bias and not params.allowed_token_ids and not params.bad_words_ids \
        and not (counts is not None and params.has_penalties)


def verify_rows(rows: list[RoundInput]) -> list[list[int]]:
    """[accepted drafts, target token] for every row, read back in one transfer. Greedy rows without penalties
    need only the argmax of each target row: one kernel for the whole batch and the prefix match on the host,
    instead of `verify_on_device`'s dozen launches per row on the host's critical path. Rows that carry their
    `argmax` (the engine read it back with the drafts, `Engine._target_argmax`) need no device work here."""
    if not rows:
        return []
    if not all(r.argmax_decides for r in rows):
        return decide_on_device(rows).tolist()
    sizes = [len(r.drafts) + 1 for r in rows]
    for r, n in zip(rows, sizes):
        if r.logits.shape[0] != n:
            raise ValueError(f"verify_rows: {r.logits.shape[0]} logits rows for {n - 1} drafts")
        if r.argmax is not None and len(r.argmax) != n:
            raise ValueError(f"verify_rows: {len(r.argmax)} argmax values for {n - 1} drafts")
    if all(r.argmax is not None for r in rows):
        ids = [t for r in rows for t in r.argmax]
    else:
        ids = torch.cat([r.logits for r in rows]).argmax(-1).tolist()
    out, o = [], 0
    for r, n in zip(rows, sizes):
        t = ids[o:o + n]
        acc = next((i for i, d in enumerate(r.drafts) if d != t[i]), n - 1)
        out.append([acc, t[acc]])
        o += n
    return out


def decide_on_device(rows: list[RoundInput]) -> torch.Tensor:
    """`verify_rows` without the read-back: int64 [R, 2] on the logits' device. A step of plain greedy rows
    (no drafts, no penalties: greedy decode at any batch size) is one argmax over the stacked logits instead
    of `verify_on_device`'s handful of launches per row, which sit on the host's critical path."""
    if not rows:
        raise ValueError("decide_on_device: no rows")
    if all(not r.drafts and r.argmax_decides for r in rows):
        toks = torch.cat([r.logits for r in rows]).argmax(-1)
        if toks.numel() != len(rows):       # a plain decode row has exactly one logits row
            raise ValueError(f"decide_on_device: {toks.numel()} logits rows for {len(rows)} sequences")
        return torch.stack([torch.zeros_like(toks), toks], 1)
    if _sampled_batch(rows):
        return verify_sampled(rows)
    # plain decoding of greedy and sampled requests together: each group in one pass, not ~30 launches per row
    g = [i for i, r in enumerate(rows) if not r.drafts and r.argmax_decides]
    s = [i for i in range(len(rows)) if i not in g]
    if g and _sampled_batch([rows[i] for i in s]):
        out = torch.empty(len(rows), 2, dtype=torch.long, device=rows[0].logits.device)
        out[small_tensor(g, torch.long, out.device)] = decide_on_device([rows[i] for i in g])
        out[small_tensor(s, torch.long, out.device)] = verify_sampled([rows[i] for i in s])
        return out
    return torch.stack([verify_on_device(r) for r in rows])


def _split(counts: torch.Tensor | None, n: int) -> list:
    return [None] * n if counts is None else list(counts)
