"""A step's MTP rounds through one round graph (`ninfer_rt.graph_round`, sampled ones `graph_round_sampled`): the
`Core` side.

A mixin of `ninfer_rt.engine_core.Core` (every rank runs it alike): it reads the Core's `graphs`, `_forward` and
`_target_argmax`, and sets `_argmax` (the verdict's argmax, read back with the drafts) and `_decided` (a sampled
round's verdicts, decided in its graph: `graph_round_sampled`).
"""
from __future__ import annotations

import torch

from . import graph_round
from .model import Output
from .step_out import StepOut


class Rounds:
    def _round(self, dec: list, chain: bool):
        """The step's decode rounds drafted and verified by one graph (`graph_round`): (their Output, the packed
        drafts and argmax), or None. Every rank decides alike: from the plan and the runner's state."""
        if not (chain and dec and self.graphs is not None and self.graphs.cfg.round_drafts):
            return None
        k = dec[0][1]
        # a chain's rows are plain: greedy ones, or sampled ones that the sampled round graphs draw (`graph_round`
        # names what they cannot hold; TP followers hold the plan's parameters and generator states)
        if any(kk != k or s.vision is not None or s.mtp_logits is None for s, kk in dec):
            return None
        got = self.graphs.round([graph_round.RoundRow(s.last, s.state, s.mtp_logits, s.mtp_hidden, s.params,
                                                      s.generator, s.counts) for s, _ in dec], k)
        if got is not None:
            for s, _ in dec:
                s.q = []
        return got

    def _round_rest(self, dec, pre, inputs, dec_out: Output, packed: torch.Tensor) -> tuple[StepOut, list]:
        """After a round graph: the step's prefill chunks, then one read-back of the drafts, the round's argmax
        and any final chunk's (the verdict's argmax: `self._argmax`) -> (the step's outputs, host drafts)."""
        parts = [(0, dec_out)]
        if inputs:
            packed = packed.clone()        # the chunks may replay graphs, which share the round's memory pool
            parts += [(lo + len(dec), o) for lo, o in self._forward(inputs, 0).parts]
        out = StepOut(parts)
        rest = self._target_argmax(dec, pre, out, skip=len(dec))
        if rest is not None and rest.numel():
            packed = torch.cat([packed, rest])
        sampled = any(s.params is not None and not s.params.greedy for s, _ in dec)
        drafts, am, self._decided, tail = graph_round.read_back(packed, len(dec), self.graphs._pad(len(dec)),
                                                                dec[0][1], sampled)
        self._argmax = None if rest is None else am + tail
        return out, drafts
