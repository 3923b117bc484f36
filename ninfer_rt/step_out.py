"""The outputs of one engine step's forwards, addressed by the step's sequence index."""
from __future__ import annotations

import torch

from .model import Output


class StepOut:
    """The outputs of a step's forwards, addressed by the step's sequence index (no device work, no sync)."""

    def __init__(self, parts: list[tuple[int, Output]]):
        self.parts = parts                 # (index of the part's first sequence, Output), ascending

    def _find(self, i: int) -> tuple[Output, int]:
        for lo, out in reversed(self.parts):
            if i >= lo:
                return out, i - lo
        raise IndexError(i)

    def seq_logits(self, i: int) -> torch.Tensor:
        out, j = self._find(i)
        return out.seq_logits(j)

    def seq_hidden(self, i: int) -> torch.Tensor:
        out, j = self._find(i)
        return out.hidden[out.cu_seqlens[j]:out.cu_seqlens[j + 1]]
