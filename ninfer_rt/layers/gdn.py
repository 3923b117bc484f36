"""Gated DeltaNet mixer (reference §7): in_proj qkv|z and b|a fused, causal conv + SiLU, gated delta rule
(chunked for prefill, recurrent for decode / verify snapshots), gated RMSNorm, out_proj row-parallel."""
from __future__ import annotations

import torch

from . import fused, linear, vec


class GatedDeltaNet:
    def __init__(self, cfg, weights: dict, prefix: str, tp, gdn_layer: int):
        a = f"{prefix}linear_attn."
        self.in_qkvz = fused(weights, [f"{a}in_proj_qkv.weight", f"{a}in_proj_z.weight"])
        self.in_ba = fused(weights, [f"{a}in_proj_b.weight", f"{a}in_proj_a.weight"])
        self.out = linear(weights, f"{a}out_proj.weight")
        self.conv_w = vec(weights, f"{a}conv1d.weight")
        self.A_log, self.dt_bias = vec(weights, f"{a}A_log"), vec(weights, f"{a}dt_bias")
        self.norm_w = vec(weights, f"{a}norm.weight")
        self.nk = cfg.linear_num_key_heads // tp.size
        self.nv = cfg.linear_num_value_heads // tp.size
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.cfg, self.tp, self.layer = cfg, tp, gdn_layer

    def gate_params(self) -> tuple:
        """What `Ops.norm_ba_gates` takes to compute this layer's gates with its input norm."""
        return self.in_ba, self.A_log, self.dt_bias

    def __call__(self, ops, x, ctx, pool, gates=None):
        """gates: the Branch `Ops.norm_ba_gates` gave with x, else started here."""
        t, nk, nv, dk, dv = x.shape[0], self.nk, self.nv, self.dk, self.dv
        kd, vd = nk * dk, nv * dv
        if gates is None:
            # the gates read only x: started first, so a backend can run them beside the GEMV and the conv
            gates = ops.gdn_ba_gates_branch(x, *self.gate_params())
        qkv, z = ops.linear(x, self.in_qkvz).split((2 * kd + vd, vd), dim=-1)
        snap_conv = None if ctx.snap_conv is None else ctx.snap_conv[self.layer]
        done = None
        if len(ctx.gdn_groups) == 1 and ctx.gdn_groups[0][0] == "recurrent":     # decode / verify: fused
            meta = ctx.gdn_groups[0][1]
            snaps = None if ctx.snap_rec is None else ctx.snap_rec[self.layer]
            o, done = ops.gdn_conv_recurrent(qkv, self.conv_w, pool.conv[self.layer], gates, pool.rec[self.layer],
                                             meta, snap_conv, snaps)
        else:
            y = ops.causal_conv(qkv, self.conv_w, pool.conv[self.layer], ctx.gdn, snap_conv)
            q, k, v = y.split((kd, kd, vd), dim=-1)
            q, k, v = q.reshape(t, nk, dk), k.reshape(t, nk, dk), v.reshape(t, nv, dv)
            o = self._core(ops, (q, k, v, *gates.join()), ctx, pool.rec[self.layer])
        o = ops.gated_rmsnorm(o, z.reshape(t, nv, dv), self.norm_w, self.cfg.rms_norm_eps)
        out = self.tp.all_reduce(ops.linear(o.reshape(t, vd), self.out))
        if done is not None:
            done.join()              # the conv windows are whole again before the step goes on
        return out

    def _core(self, ops, args, ctx, state):
        snaps = None if ctx.snap_rec is None else ctx.snap_rec[self.layer]
        if len(ctx.gdn_groups) == 1:
            kind, meta = ctx.gdn_groups[0]
            return self._run(ops, kind, args, state, meta, snaps)
        out = torch.empty_like(args[2])
        for kind, meta in ctx.gdn_groups:          # mixed batch: prefill chunks + decode/verify rows
            sub = tuple(x.index_select(0, meta.rows) for x in args)
            out.index_copy_(0, meta.rows, self._run(ops, kind, sub, state, meta, snaps))
        return out

    @staticmethod
    def _run(ops, kind, args, state, meta, snaps):
        if kind == "chunk":
            return ops.gdn_chunk(*args, state, meta)
        return ops.gdn_recurrent(*args, state, meta, snaps)
