"""Structured output: a request's grammar (a JSON schema, a regex, a choice, an EBNF grammar, or a structural tag,
as forced tool calls use) turned into the set of tokens each output position may take, through xgrammar (an
optional dependency, imported on first use).

`GrammarBackend` is built once per engine, on the first structured request (the tokenizer's vocabulary is
indexed then, ~1 s at 248K tokens); compiled grammars are cached by xgrammar. `Constraint` follows one sequence:
`allowed(drafts)` gives the token masks of an MTP round's rows (row j after the drafts d_1..d_j, walked forward
and rolled back), `accept(tokens)` commits the emitted ones. Special tokens other than the stop tokens and the
tool-call tags are never allowed (their text is not output text), and the grammar ends only on a stop token, which
ends the request (finish reason "stop").
"""
from __future__ import annotations

import json
import re

import torch

from ninfer_formats.errors import NinferError

from .tokenizer import TOOL_CALL_TAGS

KINDS = ("json_schema", "regex", "choice", "grammar", "structural_tag")
CACHE_BYTES = 256 << 20      # compiled grammars kept (xgrammar's cache; the default keeps every client's forever)
JSON_WHITESPACE = 20         # longest whitespace run in JSON output (llama.cpp's bound): models loop on newlines


_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class GrammarError(NinferError):
    """A request's grammar cannot be compiled, or structured output is not available here."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise GrammarError("structured output needs the xgrammar package on the server "
                           "(pip install 'ninfer[structured]')") from None
    return xgrammar


def _ebnf(spec: tuple) -> str:
    kind, text = spec
    if kind == "choice":
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(text))
    return text


def _compiling(spec: tuple, build):
    try:
        return build()
    except (RuntimeError, ValueError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = _LOG_PREFIX.sub("", first)      # xgrammar's "[hh:mm:ss] /path/file.cc:123: " is not for clients
        raise GrammarError(f"{spec[0]}: cannot be compiled: {first}") from None


def check_syntax(spec: tuple) -> None:
    """The grammar parses (no vocabulary needed: a CLI checks its flags before the model loads); GrammarError."""
    xgr = _xgrammar()
    kind, text = spec
    build = {"json_schema": lambda: xgr.Grammar.from_json_schema(text), "regex": lambda: xgr.Grammar.from_regex(text),
             "structural_tag": lambda: xgr.Grammar.from_structural_tag(text)}
    _compiling(spec, build.get(kind, lambda: xgr.Grammar.from_ebnf(_ebnf(spec))))


class GrammarBackend:
    """The tokenizer's vocabulary as xgrammar sees it, and a compiler with its cache."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        xgr = _xgrammar()
        self.vocab_size = vocab_size          # the logits' width (the model's, maybe padded past the tokenizer's)
        raw = tokenizer._tok
        n = raw.get_vocab_size(with_added_tokens=True)
        special = {i for i, t in raw.get_added_tokens_decoder().items()
                   if t.special and t.content not in TOOL_CALL_TAGS}
        # an empty piece is xgrammar's mark for a special token: never part of the text a grammar matches; the
        # tool-call tags stay text, so a forced call (tool_choice) is written with the tokens the model knows
        vocab = ["" if i in special else (raw.id_to_token(i) or "") for i in range(n)]
        kind = xgr.VocabType.BYTE_LEVEL if getattr(tokenizer, "_byte_level", False) else xgr.VocabType.RAW
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        info = xgr.TokenizerInfo(vocab, kind, vocab_size=max(vocab_size, n), stop_token_ids=sorted(self.stop_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_BYTES)
        self.words = -(-max(vocab_size, n) // 32)

    def compile(self, spec: tuple):
        """spec = (kind, text) of SamplingParams.structured -> a compiled grammar; GrammarError naming the problem."""
        return _compiling(spec, lambda: self._compile(spec))

    def _compile(self, spec: tuple):
        kind, text = spec
        if kind == "json_schema":
            return self.compiler.compile_json_schema(text, max_whitespace_cnt=JSON_WHITESPACE)
        if kind == "regex":
            return self.compiler.compile_regex(text)
        if kind == "structural_tag":
            return self.compiler.compile_structural_tag(text)
        return self.compiler.compile_grammar(_ebnf(spec))

    def constraint(self, spec: tuple, after: int | None = None) -> Constraint:
        xgr = _xgrammar()
        return Constraint(xgr.GrammarMatcher(self.compile(spec)), self, after)


class Constraint:
    """One sequence's grammar state (leader side). With `after`, the output is free until that token (the end of
    a reasoning block) and follows the grammar from the next one."""

    def __init__(self, matcher, backend: GrammarBackend, after: int | None = None):
        self.m, self.backend, self.after = matcher, backend, after
        # mask rows of this round by the drafts before them: a draft step's row is the verify step's row again,
        # so each is filled once per round (filling is the costly part); emptied when tokens are committed
        self._rows: dict[tuple[int, ...], torch.Tensor] = {}

    def ends(self, token: int) -> bool:
        """A stop token of the grammar: it ends the request (a grammar ends only on one, and nothing can follow it;
        in the reasoning before it, it is a stop token all the same)."""
        return token in self.backend.stop_ids

    @property
    def active(self) -> bool:
        """The grammar applies from the next token on (False while the reasoning block before it runs)."""
        return self.after is None

    def allowed(self, drafts: list[int], device) -> torch.Tensor | None:
        """bool [len(drafts) + 1, vocab]: row j = the tokens allowed after the drafts d_1..d_j; None while every
        row is free (before `after`). A draft the grammar rejects ends the walk: later rows keep the last mask
        (the draft is rejected at that row anyway)."""
        if self.after is None:
            return self._walk(drafts, device)
        if self.after not in drafts:
            return None
        e = drafts.index(self.after) + 1           # rows 0..e-1 choose up to the end token: free
        free = torch.ones(e, self.backend.vocab_size, dtype=torch.bool, device=device)
        return torch.cat([free, self._walk(drafts[e:], device)])

    def _walk(self, drafts: list[int], device) -> torch.Tensor:
        rows, walked = len(drafts) + 1, 0
        # pinned for the GPU: the copy does not wait for the queued steps (the host allocator keeps the block
        # until the copy has run)
        bits = torch.empty(rows, self.backend.words, dtype=torch.int32, pin_memory=torch.device(device).type == "cuda")
        for j in range(rows):
            if j == 0 or (walked == j and not self.m.is_terminated()):
                row = self._rows.get(key := tuple(drafts[:j]))
                if row is None:
                    self.m.fill_next_token_bitmask(bits, j)
                    self._rows[key] = bits[j].clone()
                else:
                    bits[j] = row
            else:                 # past a rejected draft or a stop token: the row decides nothing that is kept
                bits[j] = bits[j - 1]
            if j < len(drafts) and walked == j and not self.m.is_terminated() and self.m.accept_token(drafts[j]):
                walked += 1
        if walked:
            self.m.rollback(walked)
        return unpack(bits.to(device, non_blocking=True), self.backend.vocab_size)

    def accept(self, tokens: list[int]) -> None:
        """Commit emitted tokens (each was allowed: the masks made sure)."""
        self._rows.clear()
        if self.after is not None:
            if self.after not in tokens:
                return
            tokens, self.after = tokens[tokens.index(self.after) + 1:], None
        for t in tokens:
            if self.m.is_terminated() or not self.m.accept_token(int(t)):
                break


def unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [R, ceil(V/32)] bitmask (bit t % 32 of word t // 32) -> bool [R, V]."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    out = (bits[:, :, None] >> shifts) & 1
    return out.reshape(bits.shape[0], -1)[:, :vocab].bool()
