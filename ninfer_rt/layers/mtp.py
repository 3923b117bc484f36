"""MTP draft module (reference §11): fc over [norm_emb(embed(next token)) ; norm_hidden(target hidden)]
(embedding half first) -> one full-attention decoder layer with its own KV layer -> mtp.norm. The embedding
and lm_head are the main model's. A column-split fc (TP) takes this rank's input slice and all-reduces."""
from __future__ import annotations

import torch

from . import linear, vec
from .attention import FullAttention
from .mlp import Mlp


class MtpModule:
    def __init__(self, cfg, weights: dict, tp, kv_layer: int):
        self.fc = linear(weights, "mtp.fc.weight")
        self.norm_emb = vec(weights, "mtp.pre_fc_norm_embedding.weight")
        self.norm_hidden = vec(weights, "mtp.pre_fc_norm_hidden.weight")
        self.norm = vec(weights, "mtp.norm.weight")
        p = "mtp.layers.0."
        self.in_ln = vec(weights, f"{p}input_layernorm.weight")
        self.post_ln = vec(weights, f"{p}post_attention_layernorm.weight")
        self.attn = FullAttention(cfg, weights, p, tp, kv_layer)
        self.mlp = Mlp(weights, p, tp)
        self.split = self.fc.shape[1] != 2 * cfg.hidden_size
        self.cfg, self.tp = cfg, tp

    def __call__(self, ops, emb, hidden, ctx, kv):
        eps = self.cfg.rms_norm_eps
        u = torch.cat([ops.rmsnorm(emb, self.norm_emb, eps, True),          # embedding half first
                       ops.rmsnorm(hidden, self.norm_hidden, eps, True)], dim=-1)
        if self.split:
            w = self.fc.shape[1]
            u = self.tp.all_reduce(ops.linear(u[:, self.tp.rank * w:(self.tp.rank + 1) * w].contiguous(), self.fc))
        else:
            u = ops.linear(u, self.fc)
        x = ops.rmsnorm(u, self.in_ln, eps, True)
        x, r = ops.add_rmsnorm(self.attn(ops, x, ctx, kv), u, self.post_ln, eps)
        d, _ = ops.add_rmsnorm(self.mlp(ops, x), r, self.norm, eps)
        return d
