"""Comparison helpers shared by the numerical tests (one definition of the relative-L2 metric)."""
import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error ||a - b|| / ||b|| in float64 (b all-zero counts as a tiny norm, not a division by 0)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
