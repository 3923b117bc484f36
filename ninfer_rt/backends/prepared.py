"""Prepared activations handed from the kernel that produced them to the linear layer that reads them.

The norms and gates in front of every quantized linear layer (rmsnorm / add_rmsnorm, silu_mul, sigmoid_gate,
gated_rmsnorm) can write their output's prepared form (`ninfer_kernels.x16`) beside it for nearly nothing;
reading that instead of bf16 makes the f16 GEMV variants 7-20 % faster (bench/NOTES.md §10). The Ops interface
passes plain tensors, so `PreparedMemo` remembers the last few (output, prepared) pairs and `linear` asks for
its input's: found only while the output is alive, unmodified (torch's version counter) and read whole, with
the same rows and K, so a stale or partial match is impossible by construction rather than by convention.
"""
from __future__ import annotations

import weakref
from collections import deque

import torch

from ninfer_kernels.x16 import CHUNK, empty_prepared, words_per_row

MAX_ROWS = 16       # the prepared GEMVs serve T <= 16 (decode, verify, small batches); prefill rows never match
_KEEP = 4           # outputs remembered: a linear reads what the op just before it produced


class PreparedMemo:
    def __init__(self):
        self._entries: deque = deque(maxlen=_KEEP)

    @staticmethod
    def wanted(rows: int, K: int) -> bool:
        return 1 <= rows <= MAX_ROWS and K > 0 and K % CHUNK == 0

    @staticmethod
    def buffer(rows: int, K: int, device) -> torch.Tensor:
        return empty_prepared(rows, K, device)

    def remember(self, y: torch.Tensor, xp: torch.Tensor) -> None:
        """y: the producer's output (any shape, contiguous) whose rows of K = xp's K are what xp stands for."""
        self._entries.append((weakref.ref(y), y.data_ptr(), y._version, y.numel(), y.dtype, xp))

    def find(self, x: torch.Tensor) -> torch.Tensor | None:
        """The prepared form of x (read as [rows, x.shape[-1]]) if a remembered output is exactly x's memory."""
        ptr, n, K = x.data_ptr(), x.numel(), x.shape[-1]
        for ref, y_ptr, version, numel, dtype, xp in reversed(self._entries):
            y = ref()
            if y is None or y_ptr != ptr or numel != n or dtype != x.dtype:
                continue
            if y._version == version and x._version == version and x.is_contiguous() \
                    and xp.shape[0] * K == n and xp.shape[1] == words_per_row(K):
                return xp
        return None
