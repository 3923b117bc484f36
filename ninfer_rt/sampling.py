"""Sampling parameters, logits processing and batched token sampling.

`process()` turns raw logits into the *processed distribution* a token is drawn from (penalties,
temperature, top-k, top-p, min-p, renormalised). Speculative decoding needs these distributions, not
just the drawn ids: rejection sampling compares the target's processed distribution with the draft's.
Greedy rows (temperature 0) get a one-hot distribution at the argmax, which makes greedy a special case
of the same contract.
"""
from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass

import torch

from ninfer_formats.errors import NinferError

from . import sampling_rows
from .sampling_rows import softmax_rows

PENALTY_LIMIT = 2.0          # OpenAI's documented range for presence/frequency penalties
MAX_LOGPROBS = 20            # top alternatives per token (OpenAI's top_logprobs limit; vLLM's default max_logprobs)
BIAS_LIMIT = 100.0           # OpenAI's documented range for logit_bias values
REPETITION_LIMIT = 10.0      # repetition_penalty's upper bound (vLLM takes any value > 0; beyond 10 is a typo)
MAX_SEED = 2**63 - 1


class SamplingError(NinferError):
    """A sampling parameter is out of range or of the wrong type (message names the field)."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0            # 0 = greedy
    top_k: int = 0                      # 0 (or -1) = off
    top_p: float = 1.0                  # (0, 1]; 1 = off
    min_p: float = 0.0                  # [0, 1]; 0 = off
    presence_penalty: float = 0.0       # over generated tokens, OpenAI semantics
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0     # over prompt and generated tokens, HF / vLLM semantics; 1 = off
    seed: int | None = None             # None = nondeterministic
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()    # in addition to the model's eos ids
    stop: tuple[str, ...] = ()              # stop strings (need a tokenizer on the engine)
    ignore_eos: bool = False
    logprobs: int | None = None         # None = off; k = each emitted token's log-probability + the top k
    prompt_logprobs: int | None = None  # the same for the prompt's tokens after its first (vLLM's name)
    logit_bias: tuple = ()              # ((token id, bias), ...) added to the logits before anything else; a
                                        # {id: bias} mapping is accepted and stored sorted
    min_tokens: int = 0                 # vLLM's: no stop token (eos, stop_token_ids) and no stop string before
                                        # this many tokens; at most max_tokens
    structured: tuple = ()              # (kind, text): the output follows a grammar (ninfer_rt.grammar.KINDS):
                                        # ("json_schema", schema), ("regex", r), ("choice", JSON list of
                                        # strings), ("grammar", EBNF), ("structural_tag", xgrammar's JSON)
    grammar_after: int | None = None    # the grammar starts after this token (a reasoning block's end, as vLLM's
                                        # reasoning parsers do); None: from the first token
    allowed_token_ids: tuple[int, ...] = ()      # vLLM's: the only tokens that may be drawn; () = all
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # vLLM's bad_words, tokenized: no output ends with one of these
    include_stop_str_in_output: bool = False     # vLLM's: the matched stop string ends the text, not cut off
    skip_special_tokens: bool = True    # vLLM's: special tokens' text left out of the output text

    def __post_init__(self):
        self._check_numbers()
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingError(f"max_tokens: expected an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingError(f"min_tokens: expected an integer in [0, max_tokens = {self.max_tokens}], "
                                f"got {self.min_tokens!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise SamplingError(f"seed: expected an integer in [0, 2^63), got {self.seed!r}")
        self._check_tokens()
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not all(isinstance(s, str) and s for s in _iter(stop, "stop")):
            raise SamplingError(f"stop: expected non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingError(f"{name}: expected a boolean, got {getattr(self, name)!r}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        self._check_structured()
        for name in ("logprobs", "prompt_logprobs"):
            lp = getattr(self, name)
            if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
                raise SamplingError(f"{name}: expected an integer in [0, {MAX_LOGPROBS}], got {lp!r}")

    def _check_tokens(self):
        """stop_token_ids, allowed_token_ids, bad_words_ids: token ids, and no request whose bans leave nothing."""
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if isinstance(ids, (str, bytes)) or not all(_is_int(i) and i >= 0 for i in _iter(ids, name)):
                raise SamplingError(f"{name}: expected non-negative integers, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(self.allowed_token_ids))))
        words = [tuple(w) if isinstance(w, (list, tuple)) else w for w in _iter(self.bad_words_ids, "bad_words_ids")]
        if not all(isinstance(w, tuple) and w and all(_is_int(i) and i >= 0 for i in w) for w in words):
            raise SamplingError(f"bad_words_ids: expected non-empty sequences of token ids, got {self.bad_words_ids!r}")
        object.__setattr__(self, "bad_words_ids", tuple(dict.fromkeys(words)))
        allowed = set(self.allowed_token_ids)
        banned = {w[0] for w in self.bad_words_ids if len(w) == 1} | (set(self.stop_token_ids) if self.min_tokens
                                                                       else set())
        if allowed and allowed <= banned:
            raise SamplingError("allowed_token_ids: every allowed token is banned (a one-token bad word, or a stop "
                                "token that min_tokens holds back)")

    def _check_numbers(self):
        t = self.temperature
        if not _is_num(t) or t < 0:
            raise SamplingError(f"temperature: expected a finite number >= 0, got {t!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise SamplingError(f"top_k: expected an integer >= 0 (0 or -1 = off), got {self.top_k!r}")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise SamplingError(f"min_p: expected a number in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or abs(v) > PENALTY_LIMIT:
                raise SamplingError(f"{name}: expected a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not _is_num(r) or not 0 < r <= REPETITION_LIMIT:
            raise SamplingError(f"repetition_penalty: expected a number in (0, {REPETITION_LIMIT:g}], got {r!r}")

    def _check_structured(self):
        st = self.structured
        if st == ():
            return
        from .grammar import KINDS
        if not (isinstance(st, tuple) and len(st) == 2 and st[0] in KINDS and isinstance(st[1], str)):
            raise SamplingError(f"structured: expected (kind, text) with kind one of {', '.join(KINDS)}, got {st!r}")
        after = self.grammar_after
        if after is not None and not (_is_int(after) and after >= 0):
            raise SamplingError(f"grammar_after: expected a token id, got {after!r}")
        if self.ignore_eos or self.min_tokens:      # a grammar ends on a stop token, which these hold back
            raise SamplingError(f"structured: cannot be combined with "
                                f"{'ignore_eos' if self.ignore_eos else 'min_tokens'} (the grammar ends on a stop "
                                f"token)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits: their argmax is the token (no penalties, no bias, no token restriction)."""
        return self.greedy and not self.has_penalties and not self.logit_bias and not self.allowed_token_ids and \
            not self.bad_words_ids


def _bias_pairs(bias) -> tuple:
    pairs = list(bias.items()) if isinstance(bias, dict) else _iter(bias, "logit_bias")
    try:
        out = tuple(sorted((int(t), float(b)) for t, b in pairs))
        ok = all(_is_int(t) and _is_num(b) for t, b in pairs)
    except (TypeError, ValueError):
        ok = False
    if not ok or any(t < 0 or abs(b) > BIAS_LIMIT for t, b in out) or len({t for t, _ in out}) != len(out):
        raise SamplingError(f"logit_bias: expected distinct token ids >= 0 mapped to numbers in [-100, 100], "
                            f"got {bias!r}")
    return out


def _iter(v, name):
    try:
        return list(v)
    except TypeError:
        raise SamplingError(f"{name}: expected a list, got {v!r}") from None


def make_generator(params: SamplingParams, device) -> torch.Generator:
    """One generator per request, so a seeded request is reproducible whatever else is batched."""
    g = torch.Generator(device=device)
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    g.manual_seed(seed)
    return g


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device` without a host sync: torch copies pageable memory to a GPU synchronously (after all queued
    work), which would stall the host behind the step it just launched (engine_ahead.py, an MTP round); a pinned
    staging copy goes in stream order instead. Tensors already there pass through."""
    device = torch.device(device)
    if t.device.type != "cpu" or device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def copy_in(dst: torch.Tensor, t: torch.Tensor) -> None:
    """`dst.copy_(t)` from host values without a host sync (`to_device`'s pinned staging) and without a device
    temporary: one transfer into a static buffer."""
    if dst.device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    dst.copy_(t, non_blocking=True)


def small_tensor(values, dtype, device) -> torch.Tensor:
    """A short host list as a tensor on `device` without a host sync (`to_device`)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def token_counts(token_ids, vocab: int, device) -> torch.Tensor:
    """Occurrence counts [V] (float32) of generated tokens, the input of the penalties."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=device)
    return torch.bincount(ids, minlength=vocab).to(torch.float32)


def process(logits: torch.Tensor, params: list[SamplingParams], counts: list[torch.Tensor | None] | None = None,
            seen: list[torch.Tensor | None] | None = None, ban: list[tuple] | None = None,
            allow: torch.Tensor | None = None) -> torch.Tensor:
    """Processed distributions [R, V] float32 for logits [R, V]; row r uses params[r], counts[r] (generated
    tokens), seen[r] (bool [V]: the prompt's tokens, for the repetition penalty), ban[r] (token ids it may
    not draw: the stop tokens while min_tokens is not reached, `stop_ban`) and allow[r] (bool [R, V]: the only
    tokens it may draw, a grammar's; None: all). allowed_token_ids and a grammar both apply; a row they leave
    empty together keeps the grammar's tokens."""
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"process: logits {tuple(logits.shape)} for {len(params)} parameter rows")
    x, own = logits.float(), False
    raw = x                  # every step below is out of place
    if any(p.logit_bias for p in params):
        x, own = _add_bias(x, params), True
    restricted, free = allow is not None, x
    limited = any(p.allowed_token_ids for p in params)
    if limited:
        x, own, restricted = _only_allowed(x, params), True, True
    if allow is not None:
        x, own = x.masked_fill(~allow, -math.inf), True
        if limited:     # where both leave nothing the grammar outranks allowed_token_ids: its matcher needs its tokens
            x = torch.where(torch.isfinite(x).any(-1, keepdim=True), x, free.masked_fill(~allow, -math.inf))
    hard = x                 # what a row must keep: its allowed tokens, its grammar's
    if ban is not None and any(ban):
        rows = [r for r, b in enumerate(ban) for _ in b]
        cols = [t for b in ban for t in b]
        idx = (small_tensor(rows, torch.long, x.device), small_tensor(cols, torch.long, x.device))
        x, own, restricted = x.index_put(idx, torch.tensor(-math.inf, device=x.device)), True, True
    if restricted:
        x = _nonempty(x, hard, raw)
    if counts is not None and any(c is not None and p.has_penalties for p, c in zip(params, counts)):
        x = x if own else x.clone()      # the rows below change in place: never the caller's logits
        for r, (p, c) in enumerate(zip(params, counts)):
            if c is None or not p.has_penalties:
                continue
            if p.repetition_penalty != 1:       # HF / vLLM: a seen token's logit shrinks toward 0 (or grows below it)
                hit = c > 0 if seen is None or seen[r] is None else (c > 0) | seen[r]
                x[r] = torch.where(hit, torch.where(x[r] > 0, x[r] / p.repetition_penalty,
                                                    x[r] * p.repetition_penalty), x[r])
            x[r] -= p.frequency_penalty * c + p.presence_penalty * (c > 0).float()
    greedy = [r for r, p in enumerate(params) if p.greedy]
    rand = [r for r, p in enumerate(params) if not p.greedy]
    if not rand:                    # the common uniform batches skip the row gather/scatter and its copies
        return _one_hot(x)
    if not greedy:
        return _truncate(x, params)
    out = torch.empty_like(x)
    g, r = small_tensor(greedy, torch.long, x.device), small_tensor(rand, torch.long, x.device)
    out[g] = _one_hot(x[g])
    out[r] = _truncate(x[r], [params[i] for i in rand])
    return out


def _nonempty(x: torch.Tensor, hard: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """Rows the bans (min_tokens' stop tokens, bad_words) leave empty keep only their hard restrictions (allowed
    tokens, a grammar's); rows those leave empty too, the raw logits: never a crash or token 0."""
    x = torch.where(torch.isfinite(x).any(-1, keepdim=True), x, hard)
    return torch.where(torch.isfinite(x).any(-1, keepdim=True), x, raw)


def bad_word_ban(params: SamplingParams, out: list[int], drafts: list[int], rows: int) -> list[tuple]:
    """vLLM's bad_words for the `rows` output positions after out + drafts[:j]: the last token of every banned
    sequence whose other tokens end that history (a one-token sequence always; the prompt is not history)."""
    if not params.bad_words_ids:
        return [()] * rows
    hist, got = list(out) + list(drafts[:rows - 1]), []
    for j in range(rows):
        h = hist[:len(out) + j]
        got.append(tuple(sorted({w[-1] for w in params.bad_words_ids
                                 if len(w) - 1 <= len(h) and tuple(h[len(h) - len(w) + 1:]) == w[:-1]})))
    return got


def merged(*bans: list[tuple]) -> list[tuple]:
    """Row-wise union of `ban` lists."""
    return [tuple(sorted(set().union(*row))) if any(row) else () for row in zip(*bans)]


def row_bans(params: SamplingParams, eos, out: list[int], drafts: list[int], rows: int) -> list[tuple]:
    """The `ban` of `process` for the `rows` output positions after out + drafts[:j]: the stop tokens under
    min_tokens and the bad words' last tokens."""
    return merged(stop_ban(params, eos, len(out), rows), bad_word_ban(params, out, drafts, rows))


def stop_ban(params: SamplingParams, eos, emitted: int, rows: int) -> list[tuple]:
    """The `ban` of `process` for `rows` consecutive output positions starting at `emitted` tokens already out:
    the stop tokens (eos unless ignore_eos, and stop_token_ids) where fewer than min_tokens precede."""
    if emitted >= params.min_tokens:
        return [()] * rows
    stops = tuple(sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))))
    return [stops if emitted + j < params.min_tokens else () for j in range(rows)]


def _add_bias(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """x + each row's logit_bias (a copy: x may be the caller's logits)."""
    rows = [r for r, p in enumerate(params) for _ in p.logit_bias]
    cols = [t for p in params for t, _ in p.logit_bias]
    vals = [b for p in params for _, b in p.logit_bias]
    idx = (small_tensor(rows, torch.long, x.device), small_tensor(cols, torch.long, x.device))
    return x.index_put(idx, small_tensor(vals, torch.float32, x.device), accumulate=True)


_MASKS: dict[tuple, torch.Tensor] = {}      # (id(params), device, vocab) -> bool [V], while the params live


def _allowed_mask(p: SamplingParams, vocab: int, device) -> torch.Tensor:
    """The bool [V] mask of a request's allowed_token_ids, built once per request and device (a request may
    allow most of the vocabulary: rebuilding it every step would cost the whole batch)."""
    key = (id(p), str(device), vocab)
    m = _MASKS.get(key)
    if m is None:
        m = torch.zeros(vocab, dtype=torch.bool, device=device)
        m[small_tensor([t for t in p.allowed_token_ids if t < vocab], torch.long, device)] = True
        _MASKS[key] = m
        weakref.finalize(p, _MASKS.pop, key, None)
    return m


def _only_allowed(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """x with -inf outside each restricted row's allowed_token_ids (a copy)."""
    every = torch.ones(x.shape[1], dtype=torch.bool, device=x.device)
    keep = torch.stack([_allowed_mask(p, x.shape[1], x.device) if p.allowed_token_ids else every for p in params])
    return x.masked_fill(~keep, -math.inf)


def _one_hot(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x).scatter_(1, x.argmax(-1, keepdim=True), 1.0)


TOPK_SORT_MAX = 4096     # rows whose top_k are all at most this are truncated from a top-k selection


def _truncate(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p on the sorted distribution; renormalised. Rows that
    `sampling_rows.holds` accepts take its fixed path (the one a captured MTP round draws with)."""
    dev, V = x.device, x.shape[1]
    if all(sampling_rows.holds(p, V) for p in params):
        prm = to_device(sampling_rows.param_rows(params, V), dev)
        return sampling_rows.processed(x, prm, sampling_rows.selects(params, V))
    temp = small_tensor([float(p.temperature) for p in params], torch.float32, dev)[:, None]
    probs = softmax_rows(x / temp)
    ks = [p.top_k if 0 < p.top_k < V else V for p in params]
    # every row keeps at most max(ks) tokens: sort only those (a top-k selection, not a sort of the vocabulary),
    # and the cumulative sum below runs over max(ks) columns instead of all 248,320
    width = max(ks)
    sp, order = probs.topk(width, dim=-1) if width <= TOPK_SORT_MAX else probs.sort(dim=-1, descending=True)
    k = small_tensor(ks, torch.long, dev)[:, None]
    ranks = torch.arange(sp.shape[1], device=dev)[None, :]
    keep = ranks < k
    sp = sp * keep
    top_p = small_tensor([float(p.top_p) for p in params], torch.float32, dev)[:, None]
    # keep a token while the mass strictly before it (within top-k) is below top_p: the first always stays
    before = (sp.cumsum(-1) - sp) / sp.sum(-1, keepdim=True)
    keep &= before < top_p
    min_p = small_tensor([float(p.min_p) for p in params], torch.float32, dev)[:, None]
    keep &= sp >= min_p * sp[:, :1]
    sp = sp * keep
    sp = sp / sp.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, sp)


def sample(probs: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row of processed distributions [R, V] -> int64 [R]. A sampled row's draw is
    torch.multinomial's one-sample path, argmax(p / q) with q ~ Exp(1) from the row's generator (the same draws
    from the same stream), without its validity check: that reads a value back, a host sync per call on CUDA, which
    would stall the device-chained drafts (`Decisions._device_drafts`). `process` rows are finite and >= 0."""
    rand = [r for r, p in enumerate(params) if not p.greedy]
    if not rand:
        return probs.argmax(-1)
    # one race for the batch: each sampled row's noise from its generator, in row order; a greedy row races
    # against ones, which leaves its argmax (one division and one argmax, not four launches per sampled row)
    q = torch.ones_like(probs) if len(rand) < len(params) else torch.empty_like(probs)
    for r in rand:
        q[r].exponential_(1, generator=generators[r])
    return (probs / q).argmax(-1)
