"""Tensor-parallel group interface used by the model; `LocalGroup` is TP1.

The multi-process torch.distributed group implements the same four members. The model calls
`all_reduce` after every row-parallel projection (o_proj, out_proj, down_proj, a column-split mtp.fc) and
`all_gather_last` on vocab-parallel logits; every rank then adds the residual itself.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class TPGroup(ABC):
    size: int
    rank: int

    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over ranks; may reuse `x`'s storage; returns the sum (same shape and dtype)."""

    @abstractmethod
    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x [..., n] along the last dim in rank order -> [..., size * n]."""


class LocalGroup(TPGroup):
    """Single device: both collectives are the identity."""

    size = 1
    rank = 0

    def all_reduce(self, x):
        return x

    def all_gather_last(self, x):
        return x
