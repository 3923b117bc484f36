"""OpenAI `logprobs` objects from the engine's per-token log-probabilities (ninfer_rt.logprobs.TokenLogprob).

Chat (`logprobs: true`, `top_logprobs: 0..20`): `{"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}, ...]}, ...]}`. Completions (`logprobs: 0..20`): the legacy parallel lists
`{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}, ...], "text_offset"}`, where `top_logprobs`
holds the chosen token too (as OpenAI's and vLLM's do) and `text_offset` is where the token's text starts in the
completion, in characters, continuing across streamed chunks (a token inside a multi-byte character starts where
that character does; special tokens, which the text leaves out, add nothing). A token's text is its bytes
decoded; bytes that are not whole UTF-8 characters read `bytes:\\xNN...` (as OpenAI writes them), so distinct
tokens never share a key; `bytes` keeps the exact bytes. Every generated token is listed (reasoning tokens
included), up to a stop string's token.
"""
from __future__ import annotations

import codecs

from ..logprobs import TokenLogprob


class LogprobFormat:
    """One request's formatter: `chat` or completions, `top` alternatives, the running text offset."""

    def __init__(self, tok, *, chat: bool, top: int, as_ids: bool = False):
        """as_ids: vLLM's `return_tokens_as_token_ids`: tokens named "token_id:N" (text offsets and bytes stay the
        token's own), so a client can tell tokens whose text is not valid UTF-8 apart."""
        self.tok, self.chat, self.top, self.as_ids = tok, chat, top, as_ids
        self.n_tokens = tok.vocab_size       # the model's vocabulary may be padded past the tokenizer's
        self.offset = 0
        self._chars = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text: dict[int, tuple[str, list[int]]] = {}

    def _piece(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._text:
            b = self.tok.token_bytes(token_id)
            try:
                text = b.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{x:02x}" for x in b)
            self._text[token_id] = (text, list(b))
        return self._text[token_id]

    def _advance(self, token_id: int, specials_are_text: bool = False) -> int:
        """-> where this token's text starts; moves the offset past the characters it completes. A character
        still missing bytes waits for them; one that a new character interrupts reads U+FFFD, before this token."""
        start = self.offset
        if token_id in self.tok.special_ids and not specials_are_text:
            return start
        b = bytes(self._piece(token_id)[1])
        if self._chars.getstate()[0] and b and not 0x80 <= b[0] <= 0xBF:
            start += 1
        self.offset += len(self._chars.decode(b))
        return start

    def _name(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self._piece(token_id)[0]

    def _entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self._name(token_id), "logprob": logprob, "bytes": self._piece(token_id)[1]}

    def format_prompt(self, first_id: int, lps: list) -> dict:
        """Completions' `echo`: the prompt's tokens, before the output's. The first has no logprob (nothing
        predicts it), and special tokens count as text (an echoed prompt keeps them)."""
        out = self.format([TokenLogprob(first_id, None)] + list(lps), specials_are_text=True)
        out["top_logprobs"][0] = None
        return out

    def vllm_prompt(self, lps: list) -> list:
        """vLLM's `prompt_logprobs`: None for the first prompt token (nothing predicts it), then per token
        {token id: {logprob, rank, decoded_token}} for the token itself and its `top` alternatives."""
        out = [None]
        def entry(i: int, v: float, rank: int | None) -> dict:
            return {"logprob": v, "rank": rank, "decoded_token": self.tok.decode([i])}
        for t in lps:           # the token's own entry first, then the alternatives (vLLM's order)
            d = {str(t.token_id): entry(t.token_id, t.logprob, t.rank)}
            d.update({str(i): entry(i, v, r + 1) for r, (i, v) in enumerate(self._top(t))})
            out.append(d)
        return out

    def _top(self, t: TokenLogprob) -> list[tuple[int, float]]:
        """The alternatives that are tokens (a padded vocabulary row is none)."""
        return [(i, v) for i, v in t.top[:self.top] if i < self.n_tokens]

    def format(self, lps: list, specials_are_text: bool = False) -> dict:
        """The `logprobs` object of these tokens (a reply's, or one streamed chunk's)."""
        if self.chat:
            return {"content": [{**self._entry(t.token_id, t.logprob),
                                 "top_logprobs": [self._entry(i, v) for i, v in self._top(t)]} for t in lps]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in lps:
            text = self._name(t.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(t.logprob)
            top = {self._name(i): v for i, v in self._top(t)}
            top.setdefault(text, t.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self._advance(t.token_id, specials_are_text))
        return out


def requested(req, chat: bool) -> tuple[int | None, int | None]:
    """-> the engine's (logprobs, prompt_logprobs) for a request (alternatives per token; None: none). Prompt
    logprobs come with completions' `echo` and with vLLM's `prompt_logprobs`."""
    if chat:
        return ((req.top_logprobs or 0) if req.logprobs else None), req.prompt_logprobs
    echo = req.logprobs if req.echo else None
    plp = max((k for k in (echo, req.prompt_logprobs) if k is not None), default=None)
    return req.logprobs, plp
