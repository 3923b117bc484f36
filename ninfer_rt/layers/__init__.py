"""Model building blocks; each takes its weights at construction and the ops backend at call time."""
from __future__ import annotations

import torch

from ninfer_formats.errors import LoadError

from ..weights import QWeight, as_qweight


def get(weights: dict, name: str):
    try:
        return weights[name]
    except KeyError:
        raise LoadError(f"tensor {name}: missing") from None


def vec(weights: dict, name: str) -> torch.Tensor:
    """A small replicated tensor (norm gains, A_log, dt_bias, conv taps), kept in fp32."""
    w = get(weights, name)
    if isinstance(w, QWeight):
        raise LoadError(f"tensor {name}: stored as {w.fmt}; only plain formats are supported here")
    return w.float()


def linear(weights: dict, name: str) -> QWeight:
    return as_qweight(get(weights, name), name)


def fused(weights: dict, names: list[str]) -> QWeight:
    """Row-wise fusion of projections that read the same input (one GEMM instead of several)."""
    return QWeight.concat_rows([linear(weights, n) for n in names], name="+".join(names))
