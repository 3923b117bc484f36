"""Rank r > 0 of a tensor-parallel engine: it applies rank 0's plans and receives its decisions (the step protocol
is in engine_core's docstring), drawing only a chain's sampled drafts itself, from the generator states the plan
carries."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .engine_core import Core, Plan, Verdict

if TYPE_CHECKING:
    from .vision.prompt import VisionPrompt


class Follower(Core):
    """Rank r > 0: applies rank 0's plans and receives its decisions until told to stop."""

    @torch.no_grad()
    def run(self) -> None:
        while True:
            msg = self.tp.broadcast_object(None)
            if msg.pop("op") == "stop":
                break
            plan = Plan(**msg)
            self._apply_membership(plan)
            self._take_draws(plan.draws)
            self._execute(plan)
        for s in list(self.seqs.values()):
            self._drop(s)
        self._close_graphs()

    def _take_draws(self, draws: list) -> None:
        """A chain step's sampled rows: the leader's parameters and each generator's state at the step's start,
        so this rank's draws are the leader's (protocol step 2)."""
        for rid, params, state in draws:
            s = self.seqs[rid]
            s.params = params
            if s.generator is None:
                s.generator = torch.Generator(device=self.model.device)
            s.generator.set_state(state)

    def _decide_drafts(self, j, items):
        return self.tp.broadcast(torch.empty(len(items), dtype=torch.long)).tolist()

    def _receive_vision(self, meta: dict) -> VisionPrompt:
        from .vision.prompt import VisionPrompt
        embeds = self.tp.broadcast(torch.empty(meta["embeds_shape"], dtype=meta["embeds_dtype"]))
        return VisionPrompt.from_meta(meta, embeds.to(self.model.device))

    def _decide_verdicts(self, dec, drafts, pre, out):
        n = len(dec) + len(pre)
        if not n:
            return []
        rows = self.tp.broadcast(torch.empty(n, 4, dtype=torch.long)).tolist()
        return [Verdict(a, t, e, bool(f)) for a, t, e, f in rows]
