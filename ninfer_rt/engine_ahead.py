"""Run-ahead decode (vLLM's "async scheduling"): the engine launches decode step n+1 before it reads step n's
tokens back, so the host's work between steps (reading the tokens, stop checks, detokenizing, the server's
streaming) overlaps the GPU's next step instead of leaving the GPU idle.

Step n+1 feeds each sequence the token step n decided on the device (`decide_on_device`): no host sync
between them. What the host cannot know before reading step n back:
- a sequence that stopped at step n (EOS, stop token or string): its step n+1 token is dropped unread, and its
  state is freed after step n+1 was launched (stream order keeps the freed pages and slot from being reused
  before step n+1 is done with them);
- a sequence that reaches `max_tokens` or the context end at step n is known beforehand and is left out of
  step n+1, so no step writes past a request's reservation.
The tokens are those of the synchronous engine (same decisions, same per-request generators, consumed in the
same order). Only steps the leader decides alone and that carry no host-side state into the next decision
run ahead: no MTP (drafts and accept counts shape the next step), TP1 (followers receive host tokens), no
penalties (counts), no images (MRoPE positions are computed from host ids). Anything else — an admission, a
prefill chunk, any other request — first drains the step in flight and then runs synchronously.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .engine_core import Seq
from .model import SeqInput
from .speculative import RoundInput, decide_on_device


@dataclass(eq=False)
class Launched:
    """A decode step in flight: its sequences in batch order and their tokens (device, and a host copy that is
    valid once `event` has completed)."""

    seqs: list[Seq]
    toks: torch.Tensor                  # int64 [B] on the model's device
    host: torch.Tensor                  # int64 [B], pinned on CUDA
    event: object                       # torch.cuda.Event, None off CUDA (the copy was synchronous)
    t_launch: float


class RunAhead:
    """Mixed into `Engine`: `_ahead` holds the launched step not yet read back (None: nothing in flight)."""

    _ahead: Launched | None = None
    _ahead_done: float = 0.0            # when the previous run-ahead step was read back (decode time)

    def _ahead_eligible(self, s: Seq) -> bool:
        return (not s.prefilling and s.vision is None and s.counts is None and not s.params.has_penalties
                and s.params.logprobs is None and len(s.out) >= s.params.min_tokens and s.grammar is None
                and not s.params.bad_words_ids)          # its bans follow the host's history

    def _ahead_plan_ok(self, plan) -> bool:
        """A plan to start running ahead with: decode rows only, every running sequence among them."""
        if not self.async_scheduling or self.spec is not None or self.tp.size > 1:
            return False
        if plan.admit or plan.prefill or plan.free or not plan.decode:
            return False
        return len(plan.decode) == len(self.running) and all(self._ahead_eligible(s) for s in self.running)

    def _continues(self, s: Seq) -> bool:
        """Whether `s` is still running and cannot finish by length at the step in flight (it will have
        len(out) + 1 tokens after it)."""
        if self.seqs.get(s.req_id) is not s or s.finished:
            return False
        n = len(s.out) + 1
        return n < s.params.max_tokens and len(s.prompt) + n < self.max_model_len

    def _launch(self, seqs: list[Seq], prev: Launched | None) -> Launched:
        """One decode forward over `seqs` and its token decisions, all enqueued; nothing read back. The ids are
        the host's last tokens (first step) or the device tokens of `prev`."""
        if prev is None:
            ids = torch.tensor([s.last for s in seqs], dtype=torch.long)
            idx = list(range(len(seqs)))
        else:       # views of the device tokens (an index tensor would be a synchronous host->device copy)
            ids, pos = prev.toks, {id(s): i for i, s in enumerate(prev.seqs)}
            idx = [pos[id(s)] for s in seqs]
        t0 = time.perf_counter()
        inputs = [SeqInput(ids[j:j + 1], s.state) for j, s in zip(idx, seqs)]
        out = self._forward(inputs, len(inputs))
        rows = [RoundInput(s.params, out.seq_logits(i), [], [], None, s.generator) for i, s in enumerate(seqs)]
        toks = decide_on_device(rows)[:, 1]
        cuda = toks.device.type == "cuda"
        host = torch.empty(len(seqs), dtype=torch.long, pin_memory=cuda)
        host.copy_(toks, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        return Launched(seqs, toks, host, event, t0)

    def _step_ahead(self) -> list:
        """Launch the next step (if every sequence may run ahead and nothing waits to be admitted), then read the
        step in flight back and emit its tokens."""
        cur, self._ahead = self._ahead, None
        nxt = [s for s in cur.seqs if self._continues(s)] if not self._admissible() else []
        if nxt:
            self._ahead = self._launch(nxt, cur)
        return self._read_back(cur)

    def _read_back(self, cur: Launched) -> list:
        if cur.event is not None:
            cur.event.synchronize()
        results = []
        for s, tok in zip(cur.seqs, cur.host.tolist()):
            if self.seqs.get(s.req_id) is not s:         # aborted while in flight
                continue
            n = self._accept(s, [tok])
            s.last = tok
            results.append((s, n))
        now = time.perf_counter()
        st = self.stats
        st.steps += 1
        st.ahead_steps += 1
        st.decode_batches[len(cur.seqs)] = st.decode_batches.get(len(cur.seqs), 0) + 1
        st.decode_tokens += sum(n for _, n in results)
        st.decode_s += now - max(cur.t_launch, self._ahead_done)
        self._ahead_done = now
        outs = [self._step_output(s, [s.last] if n else [], None, None) for s, n in results]
        for s, _ in results:
            if s.finished:
                self._drop(s)
        self.running = [s for s in self.running if not s.finished and self.seqs.get(s.req_id) is s]
        return outs

    def _drain(self) -> None:
        """Wait for the step in flight and forget it (shutdown)."""
        if self._ahead is not None and self._ahead.event is not None:
            self._ahead.event.synchronize()
        self._ahead = None
