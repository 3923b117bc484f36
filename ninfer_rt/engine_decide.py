"""The leader's decisions in a step (rank 0; followers receive them, engine_follower.Follower): the drafts of each
draft step, the verdict of each verified row, and the emission of tokens up to a stop.

Greedy rows without penalties or a logit bias are decided by one argmax. With drafts kept on the device
(`_chainable`: greedy or plainly sampled rows; with TP the followers draw a chain's sampled drafts from the
generator states the plan carries, engine_core's protocol) the drafts and the verdict's argmax (queued behind the verify
step, `_target_argmax`) come back in one transfer; sampled, penalized or biased rows take the processed
distributions (`speculative.verify_rows` / `verify_on_device`).
A mixin of `ninfer_rt.engine.Engine`: it reads the Engine's `cfg`, `tp`, `stats`, `eos`, `max_model_len` and
`chain_drafts`.
"""
from __future__ import annotations

import torch

from .engine_core import Seq, Verdict, draw
from .logprobs import token_logprobs
from .sampling import row_bans, small_tensor
from .speculative import RoundInput, argmax_decides, draft_distributions, verify_rows


def _masked(s: Seq) -> bool:
    """Fewer than min_tokens out, or a grammar in force: the raw argmax does not decide (stop tokens are banned,
    or the grammar masks tokens). A grammar waiting for the end of a reasoning block does not count: a round that
    reaches it masks its later rows (`_allow`), and those rows then leave the argmax paths by themselves."""
    return len(s.out) < s.params.min_tokens or (s.grammar is not None and s.grammar.active) or \
        bool(s.params.bad_words_ids)


def _allow(s: Seq, drafts: list[int], logits: torch.Tensor) -> torch.Tensor | None:
    return s.grammar.allowed(drafts, logits.device) if s.grammar is not None else None


def _draft_allow(seqs: list[Seq], prev: list[list[int]], logits: torch.Tensor) -> torch.Tensor | None:
    """bool [R, V] of a draft step: each grammar's tokens after the round's earlier drafts; None without one."""
    if all(s.grammar is None for s in seqs):
        return None
    out, any_row = torch.ones(logits.shape, dtype=torch.bool, device=logits.device), False
    for r, (s, d) in enumerate(zip(seqs, prev)):
        rows = s.grammar.allowed(d, logits.device) if s.grammar is not None else None
        if rows is not None:
            out[r], any_row = rows[-1], True
    return out if any_row else None


def _plain(s: Seq) -> bool:
    """Drafts one processed distribution decides without the host's history (greedy or sampled): no penalties, bias,
    token restrictions, bans or grammar."""
    p = s.params
    return not (p.has_penalties or p.logit_bias or p.allowed_token_ids or p.bad_words_ids or _masked(s))


def _counted(s: Seq) -> bool:
    """Sampled drafts whose only history is the presence / frequency penalties' counts, which stay on the device
    (`Core._device_drafts` adds the round's earlier drafts to them); no repetition penalty (the prompt's tokens)."""
    p = s.params
    return not p.greedy and p.repetition_penalty == 1 and not (p.logit_bias or p.allowed_token_ids or
                                                                p.bad_words_ids or _masked(s))


class Decisions:
    _decided = None     # a sampled round graph's [accepted drafts, token] per decode row of the step, else None

    def _chainable(self, seqs: list[Seq]) -> bool:
        """Steps whose drafts need no host history: NINFER_DRAFT_CHAIN (default on) keeps them on the device between
        the draft steps. Greedy rows (one argmax decides each draft) and sampled rows without the host's history
        (`_plain`); with TP every rank draws a sampled row's drafts from the generator state in the plan
        (`Engine._schedule`). With TP1 also sampled rows with presence / frequency penalties (`_counted`: their
        counts live on the leader's device; followers keep none)."""
        if not self.chain_drafts:
            return False
        if all(s.params.plain_greedy and not _masked(s) for s in seqs):
            return True
        return all(_plain(s) or (self.tp.size == 1 and _counted(s)) for s in seqs)

    def _decide_drafts(self, j, items):
        seqs = [s for s, _, _ in items]
        params = [s.params for s in seqs]
        logits = torch.stack([lg for _, lg, _ in items])
        if j == 1:
            for s in seqs:
                s.q = []
        # draft j guesses output position len(out) + j - 1: its stop tokens are banned below min_tokens
        ban = [row_bans(s.params, self.eos, s.out, d, len(d) + 1)[-1] for s, _, d in items]
        allow = _draft_allow(seqs, [d for _, _, d in items], logits)
        if all(p.plain_greedy for p in params) and not any(ban) and allow is None:
            # the processed distribution would be one-hot at this argmax: one kernel instead of five per draft step
            toks = logits.argmax(-1)
        else:
            toks = draw(seqs, draft_distributions(logits, params, [s.counts for s in seqs], [d for _, _, d in items],
                                                   self.cfg.vocab_size, [s.seen for s in seqs], ban, allow))
        toks = toks.cpu()
        return (self.tp.broadcast(toks) if self.tp.size > 1 else toks).tolist()

    @staticmethod
    def _verified(dec, pre) -> list[tuple[int, Seq]]:
        """(step index, sequence) of every row a verdict reads: the decode rounds, then the final prompt chunks."""
        return [(i, s) for i, (s, _) in enumerate(dec)] + \
            [(i, s) for i, (s, _, b) in enumerate(pre, start=len(dec)) if b == len(s.prompt)]

    def _target_argmax(self, dec, pre, out, skip: int = 0):
        """Greedy rows without penalties are decided by the argmax alone: queue it behind the verify step, so
        `_execute` reads it back with the drafts (one host sync per round, not two). `skip`: the first verified
        sequences whose argmax a round graph took already (`Core._round_rest`)."""
        seqs = self._verified(dec, pre)
        if not seqs or not all(argmax_decides(s.params, s.counts) and not _masked(s) for _, s in seqs):
            return None
        rows = [out.seq_logits(i) if i < len(dec) else out.seq_logits(i)[-1:] for i, _ in seqs[skip:]]
        return torch.cat(rows).argmax(-1) if rows else torch.zeros(0, dtype=torch.long)

    def _decide_verdicts(self, dec, drafts, pre, out) -> list[Verdict]:
        """Every row is verified on the device first and read back in one transfer (not two host syncs per
        sequence); a row only reads its own sequence's counts, so accepting afterwards changes nothing."""
        final = self._verified(dec, pre)[len(dec):]
        # target row j of a round chooses output position len(out) + j
        rows = [RoundInput(s.params, lg, d, s.q, s.counts, s.generator, seen=s.seen,
                           ban=row_bans(s.params, self.eos, s.out, d, len(d) + 1), allow=_allow(s, d, lg))
                for (s, _), d, lg in zip(dec, drafts, (out.seq_logits(i) for i in range(len(dec))))]
        # a prompt chunk may return every row (prompt logprobs): its last one chose the first token
        rows += [RoundInput(s.params, lg, [], [], s.counts, s.generator, seen=s.seen,
                            ban=row_bans(s.params, self.eos, [], [], 1), allow=_allow(s, [], lg))
                 for s, lg in ((s, out.seq_logits(i)[-1:]) for i, s in final)]
        if self._argmax is not None:
            o = 0
            for r in rows:
                r.argmax, o = self._argmax[o:o + r.logits.shape[0]], o + r.logits.shape[0]
        # a sampled round graph decided its rows' verdicts (`Core._round_rest`); greedy ones keep the argmax path
        decided = verify_rows(rows) if self._decided is None else self._decided + verify_rows(rows[len(dec):])
        verdicts = []
        for (s, k), d, (n_acc, tok) in zip(dec, drafts, decided):
            self._record(s, k, n_acc)
            verdicts.append(Verdict(n_acc, tok, self._accept(s, d[:n_acc] + [tok]), s.finished))
        prompt_done = dict(zip((s.req_id for _, s in final), decided[len(dec):]))
        for s, _, _ in pre:
            if s.req_id not in prompt_done:
                verdicts.append(Verdict(0, -1, 0, False))
                continue
            _, tok = prompt_done[s.req_id]
            verdicts.append(Verdict(0, tok, self._accept(s, [tok]), s.finished))
        if self.tp.size > 1 and verdicts:
            self.tp.broadcast(torch.tensor([[v.n_acc, v.token, v.n_emit, int(v.finished)] for v in verdicts]))
        return verdicts

    def _record(self, s: Seq, k: int, n_acc: int) -> None:
        """Count a round (before its tokens are accepted) by the drafts that could be emitted: a round drafting past
        max_tokens (`Engine._even_drafts`) counts as the shorter round it replaces (`s.counted`: the step's report)."""
        room = max(0, s.params.max_tokens - len(s.out) - 1)
        s.counted = (min(k, room), min(n_acc, k, room))
        if self.stats.spec is not None:
            self.stats.spec.record(*s.counted)

    def _take_logprobs(self, items, prompt_items) -> None:
        """One read-back for the step's requests that asked for logprobs or prompt logprobs (`ninfer_rt.logprobs`)."""
        got = token_logprobs([(lg, toks, s.params.logprobs) for s, lg, toks in items] +
                             [(lg, toks, s.params.prompt_logprobs) for s, lg, toks in prompt_items],
                             self.cfg.vocab_size)
        for (s, _, _), lps in zip(items, got):
            s.logprobs = lps
        for (s, _, _), lps in zip(prompt_items, got[len(items):]):
            s.prompt_logprobs += lps

    def _accept(self, s: Seq, tokens: list[int]) -> int:
        """Emit tokens in order until a stop; returns how many were emitted."""
        n = 0
        for t in tokens:
            s.out.append(t)
            n += 1
            if s.stream is not None:
                if len(s.out) > s.params.min_tokens:     # vLLM: stop strings count past min_tokens tokens
                    s.stream.arm()
                s.text_delta += s.stream.push([t])
            if (t in self.eos and not s.params.ignore_eos) or t in s.params.stop_token_ids or \
                    (s.stream is not None and s.stream.stopped) or (s.grammar is not None and s.grammar.ends(t)):
                s.reason = "stop"
            elif len(s.out) >= s.params.max_tokens or len(s.prompt) + len(s.out) >= self.max_model_len:
                s.reason = "length"
            if s.reason:
                s.finished = True
                if s.stream is not None:
                    s.text_delta += s.stream.flush()
                break
        if s.grammar is not None:
            s.grammar.accept(tokens[:n])
        if s.counts is not None:        # one scatter for the step's tokens, not an indexed add per token
            s.counts.index_put_((small_tensor(tokens[:n], torch.long, s.counts.device),),
                                torch.ones(n, device=s.counts.device), accumulate=True)
        return n
