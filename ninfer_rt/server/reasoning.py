"""Split a generated token stream into reasoning (`<think>...</think>`) and answer content.

Qwen3.8's `<think>` / `</think>` are single added tokens (ids 248068/248069, reference §15), so the split
is done on token ids, before detokenization: a tag can never be cut between two stream chunks, and the
two parts are detokenized by separate `TextStream`s (stop strings apply to the answer only).

The generation prompt of a thinking chat template already ends inside the reasoning block
(`<|im_start|>assistant\\n<think>\\n`); with thinking disabled it ends after an empty block
(`<think>\\n\\n</think>\\n\\n`). `prompt_think_state` reads that from the prompt's token ids, from the
last turn header (`<|im_start|>`) on: tags in a user message or an earlier turn say nothing about the turn
being generated.
"""
from __future__ import annotations

REASONING, CONTENT = "reasoning", "content"
OPEN, CLOSED, NONE = "open", "closed", "none"


def prompt_think_state(prompt_ids, start_id: int | None, end_id: int | None, turn_id: int | None = None) -> str:
    """OPEN if the generation prompt leaves a `<think>` block open, CLOSED if its last block is closed, else
    NONE. With `turn_id` (the turn-header token) only the ids after its last occurrence are read."""
    if start_id is None or end_id is None:
        return NONE
    ids = [int(t) for t in prompt_ids]
    if turn_id is not None and turn_id in ids:
        ids = ids[len(ids) - ids[::-1].index(turn_id):]
    last_start = last_end = -1
    for i, t in enumerate(ids):
        if t == start_id:
            last_start = i
        elif t == end_id:
            last_end = i
    if last_start < 0:
        return NONE
    return OPEN if last_start > last_end else CLOSED


class ReasoningSplitter:
    """Routes each generated id to REASONING or CONTENT; the tag tokens themselves are dropped.

    Without a think block in the prompt, a `<think>` as the very first generated token opens one (models
    whose template leaves the tag to the model). Later tags are ordinary content.
    """

    def __init__(self, start_id: int | None, end_id: int | None, prompt_state: str = NONE):
        self.start_id, self.end_id = start_id, end_id
        self.phase = REASONING if prompt_state == OPEN else CONTENT
        self._may_open = prompt_state == NONE and start_id is not None
        self._closed = False

    def split(self, ids) -> list[tuple[str, list[int]]]:
        """-> runs [(phase, ids)] in order, tags removed."""
        runs: list[tuple[str, list[int]]] = []
        for t in ids:
            t = int(t)
            if self.phase == REASONING and not self._closed and t == self.end_id:
                self.phase, self._closed = CONTENT, True
                continue
            if self._may_open and t == self.start_id:
                self.phase, self._may_open = REASONING, False
                continue
            self._may_open = False
            if runs and runs[-1][0] == self.phase:
                runs[-1][1].append(t)
            else:
                runs.append((self.phase, [t]))
        return runs


class OutputText:
    """Generated ids -> (reasoning text, answer text) deltas, with stop strings on the answer.

    `split=None` means no reasoning split (completions): everything is answer text. `keep_special`: the answer
    keeps special tokens' text (a tokenizer may mark `<tool_call>` special; the tool parser needs it).
    """

    def __init__(self, tok, stop: tuple[str, ...], split: ReasoningSplitter | None, keep_special: bool = False,
                 min_tokens: int = 0, keep_stop: bool = False, reasoning_special: bool = False):
        """`min_tokens`: stop strings apply only to text after that many generated ids (tags included), as in
        vLLM; `keep_stop`: a matched stop string stays at the end of the answer; `reasoning_special`: the
        reasoning text keeps special tokens' text too (vLLM's skip_special_tokens false)."""
        from ..tokenizer import TextStream
        self.split, self.min_tokens, self.pushed = split, min_tokens, 0
        self.reasoning_tokens = 0         # ids of the reasoning block so far, its tags included
        self.answer = TextStream(tok, stop, not keep_special, min_tokens == 0, keep_stop)
        self.reasoning = TextStream(tok, (), not reasoning_special) if split is not None else None
        self._reasoning_flushed = False

    @property
    def stopped(self) -> bool:
        """A stop string matched in the answer; the text is final."""
        return self.answer.stopped

    def push(self, ids) -> tuple[str, str]:
        ids = list(ids)
        before = self.pushed
        self.pushed += len(ids)
        if self.min_tokens and before <= self.min_tokens < self.pushed:     # arm stop strings past min_tokens
            cut = self.min_tokens - before
            r1, c1 = self._push(ids[:cut])
            self.answer.arm()
            r2, c2 = self._push(ids[cut:])
            return r1 + r2, c1 + c2
        return self._push(ids)

    def _push(self, ids) -> tuple[str, str]:
        if self.split is None:
            return "", self.answer.push(ids)
        r = c = ""
        self.reasoning_tokens += len(ids)             # less the answer's ids below: the dropped tags count here
        for phase, run in self.split.split(ids):
            if phase == REASONING:
                r += self.reasoning.push(run)
            else:
                if self.reasoning.ids and not self._reasoning_flushed:
                    # the block is closed: release a held-back partial character before the answer starts
                    r += self.reasoning.flush()
                    self._reasoning_flushed = True
                self.reasoning_tokens -= len(run)
                c += self.answer.push(run)
        return r, c

    def flush(self) -> tuple[str, str]:
        return (self.reasoning.flush() if self.reasoning is not None else ""), self.answer.flush()
