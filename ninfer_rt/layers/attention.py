"""Gated full attention (reference §5): per-head [q | gate] q_proj, QK (1+w) norms, partial RoPE, paged
GQA attention, sigmoid output gate, o_proj row-parallel (+ all-reduce)."""
from __future__ import annotations

from . import fused, linear, vec


class FullAttention:
    def __init__(self, cfg, weights: dict, prefix: str, tp, kv_layer: int):
        a = f"{prefix}self_attn."
        self.qkv = fused(weights, [f"{a}q_proj.weight", f"{a}k_proj.weight", f"{a}v_proj.weight"])
        self.o = linear(weights, f"{a}o_proj.weight")
        self.q_norm, self.k_norm = vec(weights, f"{a}q_norm.weight"), vec(weights, f"{a}k_norm.weight")
        self.hq, self.hk = cfg.num_attention_heads // tp.size, cfg.num_key_value_heads // tp.size
        self.d = cfg.head_dim
        self.split = (2 * self.hq * self.d, self.hk * self.d, self.hk * self.d)
        self.cfg, self.tp, self.kv_layer = cfg, tp, kv_layer

    def __call__(self, ops, x, ctx, kv):
        t, d, c = x.shape[0], self.d, self.cfg
        qg, k, v = ops.linear(x, self.qkv).split(self.split, dim=-1)
        qg = qg.view(t, self.hq, 2 * d)                 # per head: [q (D) | gate (D)]
        k_cache, v_cache = kv.k[self.kv_layer], kv.v[self.kv_layer]
        q = ops.qk_norm_rope_store(qg[..., :d], k.reshape(t, self.hk, d), v.reshape(t, self.hk, d), self.q_norm,
                                   self.k_norm, c.rms_norm_eps, ctx.positions, c.rotary_dim, c.rope_theta,
                                   c.mrope_section, k_cache, v_cache, ctx.attn.slot_mapping)
        o = ops.gated_attention(q, k_cache, v_cache, ctx.attn, d ** -0.5, qg[..., d:]).reshape(t, self.hq * d)
        return self.tp.all_reduce(ops.linear(o, self.o))
