"""SwiGLU MLP: down(silu(gate(x)) * up(x)); gate/up fused, down row-parallel (+ all-reduce)."""
from __future__ import annotations

from . import fused, linear


class Mlp:
    def __init__(self, weights: dict, prefix: str, tp):
        self.gate_up = fused(weights, [f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"])
        self.down = linear(weights, f"{prefix}mlp.down_proj.weight")
        self.tp = tp

    def __call__(self, ops, x):
        return self.tp.all_reduce(ops.linear(ops.linear_swiglu(x, self.gate_up), self.down))
