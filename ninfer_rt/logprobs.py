"""Log-probabilities of emitted tokens: OpenAI's `logprobs` / `top_logprobs`, vLLM's `logprobs=k`.

They are the model's own distribution at each position, log_softmax of the target's logits before penalties,
temperature and truncation (vLLM's default, `raw_logprobs`), so they do not depend on how a token was chosen.
A round of MTP verifies its drafts on the target's logits at every emitted position, so speculative decoding
returns the values plain decoding would (up to rounding). Requests that ask for none cost nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import small_tensor

SLICE = 64           # logits rows turned into logprobs at a time (a prompt chunk's rows: bounded fp32 temporaries)
FLOOR = -9999.0      # stands in for -inf (a token the model rules out): JSON has no infinities (vLLM does the same)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()     # the k most likely tokens at this position, most likely first
    rank: int | None = None                     # how many tokens are at least as likely, itself included (vLLM's)


def _finite(v: float) -> float:
    return v if v > FLOOR else FLOOR          # also maps NaN to the floor


def token_logprobs(items: list[tuple[torch.Tensor, list[int], int]], vocab: int) -> list[list[TokenLogprob]]:
    """items: per sequence (logits [>= n, >= vocab] whose row j chose token j, the n tokens, k alternatives)
    -> per sequence one TokenLogprob per token. All sequences in one host read-back; SLICE rows at a time in fp32,
    so a prompt chunk's logits never have a full-size fp32 copy."""
    if not items:
        return []
    k = max(k for _, _, k in items)
    parts = []
    for lg, toks, _ in items:
        ids = small_tensor(toks, torch.long, lg.device)
        for lo in range(0, len(toks), SLICE):
            rows = lg[lo:min(lo + SLICE, len(toks)), :vocab].float()
            lp = rows - torch.logsumexp(rows, -1, keepdim=True)
            own = lp.gather(1, ids[lo:lo + rows.shape[0], None])
            # vLLM's rank: the tokens at least as likely, itself included (ranks < 2^24: exact in float32)
            cols = [own, (lp >= own).sum(-1, keepdim=True).float()]
            if k:
                val, idx = lp.topk(min(k, vocab), -1)
                cols += [val, idx.float()]          # ids < 2^24: exact in float32, so one tensor and one transfer
            parts.append(torch.cat(cols, 1))
    host = torch.cat(parts).tolist()
    out, r = [], 0
    for _, ts, want in items:
        seq = []
        for t in ts:
            row = host[r]
            kk = (len(row) - 2) // 2
            top = tuple((int(row[2 + kk + j]), _finite(row[2 + j])) for j in range(min(want, kk)))
            seq.append(TokenLogprob(int(t), _finite(row[0]), top, int(row[1])))
            r += 1
        out.append(seq)
    return out


# ---- which logits rows chose which tokens, in an engine step (Core._execute) ----
def emitted_items(dec, pre, verdicts, drafts, out) -> list:
    """(seq, logits rows, emitted tokens) of every row whose request asked for logprobs (params: leader only)."""
    items = [(s, out.seq_logits(i), v.emitted(d)) for i, ((s, _), d, v) in enumerate(zip(dec, drafts, verdicts))
             if s.params is not None and s.params.logprobs is not None and v.n_emit]
    for i, ((s, _, b), v) in enumerate(zip(pre, verdicts[len(dec):]), start=len(dec)):
        if b == len(s.prompt) and s.params is not None and s.params.logprobs is not None and v.n_emit:
            items.append((s, out.seq_logits(i)[-1:], [v.token]))
    return items


def prompt_items(pre, rows: set, out, n_dec: int) -> list:
    """(seq, logits rows, prompt tokens they predict) of prompt chunks that returned every row: rows a..b-1 predict
    prompt tokens a+1..b (the final chunk's last row predicts the first output token, not a prompt token)."""
    items = []
    for i, (s, a, b) in enumerate(pre, start=n_dec):
        if s.req_id in rows and a + 1 < len(s.prompt):
            items.append((s, out.seq_logits(i), s.prompt[a + 1:b + 1]))
    return items
