"""`TorchOps`: the pure-torch reference backend (CPU tests, correctness oracle for the Triton backend).

Quantized linear weights are dequantized with the numpy reference codecs on first use and the dense copy
(in the activation dtype) is cached on the QWeight under `cache["torch"]` — memory-hungry, but this path is
the reference, not the fast path. Embedding tables that are quantized are dequantized per batch (rows only).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import AttnMeta, GdnMeta, Ops
from ..weights import QWeight, dequantize
from . import torch_gdn


def _norm(xf: torch.Tensor, eps: float) -> torch.Tensor:
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


class TorchOps(Ops):
    name = "torch"

    def _dense(self, w: QWeight, dtype: torch.dtype) -> torch.Tensor:
        if not w.quantized and w.data["w"].dtype == dtype:
            return w.data["w"]
        key = ("torch", dtype)
        if key not in w.cache:
            w.cache[key] = dequantize(w).to(dtype)
        return w.cache[key]

    def linear(self, x, w):
        return x @ self._dense(w, x.dtype).t()

    def embedding(self, ids, table, dtype):
        if isinstance(table, QWeight):
            if not table.quantized:
                return table.data["w"].index_select(0, ids).to(dtype)
            uniq, inv = torch.unique(ids, return_inverse=True)
            return dequantize(table.select_rows(uniq)).to(dtype)[inv]
        return table.index_select(0, ids).to(dtype)

    def rmsnorm(self, x, w, eps, plus_one):
        gain = 1.0 + w.float() if plus_one else w.float()
        return (_norm(x.float(), eps) * gain).to(x.dtype)

    def add_rmsnorm(self, x, residual, w, eps, plus_one=True):
        r = residual + x
        return self.rmsnorm(r, w, eps, plus_one), r

    def gated_rmsnorm(self, o, z, w, eps):
        return (_norm(o.float(), eps) * w.float() * F.silu(z.float())).to(o.dtype)

    def silu_mul(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.silu(gate.float()) * up.float()).to(gate_up.dtype)

    def sigmoid_gate(self, o, gate):
        return (o.float() * torch.sigmoid(gate.float())).to(o.dtype)

    # ---- attention ----
    def rope(self, q, k, positions, rotary_dim, theta, mrope_section=None):
        half = rotary_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=q.device).float() / rotary_dim))
        if positions.dim() == 1:
            ang = positions.float()[:, None] * inv_freq
        else:
            ang3 = positions.float()[..., None] * inv_freq              # [3, T, half]
            axis = torch.zeros(half, dtype=torch.long, device=q.device)
            j = torch.arange(half, device=q.device)
            sec = mrope_section or (half, 0, 0)
            axis[(j % 3 == 1) & (j < 3 * sec[1])] = 1
            axis[(j % 3 == 2) & (j < 3 * sec[2])] = 2
            ang = ang3.gather(0, axis.expand(ang3.shape[1], half)[None]).squeeze(0)
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]            # [T, 1, half]

        def rot(x):
            xf = x.float()
            x1, x2 = xf[..., :half], xf[..., half:rotary_dim]
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., rotary_dim:]], dim=-1)
            return out.to(x.dtype)
        return rot(q), rot(k)

    def kv_write(self, k_cache, v_cache, k, v, slot_mapping):
        hk, d = k_cache.shape[-2:]
        k_cache.view(-1, hk, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, hk, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    def attention(self, q, k_cache, v_cache, meta: AttnMeta, scale):
        hq, hk = q.shape[1], k_cache.shape[2]
        out = torch.empty_like(q)
        start = 0
        for b, (t, kv) in enumerate(zip(meta.seq_lens, meta.kv_lens)):
            pages = meta.block_tables[b, : -(-kv // meta.page_size)].long()
            kb = k_cache.index_select(0, pages).flatten(0, 1)[:kv].float().repeat_interleave(hq // hk, dim=1)
            vb = v_cache.index_select(0, pages).flatten(0, 1)[:kv].float().repeat_interleave(hq // hk, dim=1)
            qb = q[start:start + t].float()
            s = torch.einsum("thd,lhd->htl", qb, kb) * scale
            qpos = torch.arange(kv - t, kv, device=q.device)
            mask = torch.arange(kv, device=q.device)[None, :] > qpos[:, None]
            p = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1)
            out[start:start + t] = torch.einsum("htl,lhd->thd", p, vb).to(q.dtype)
            start += t
        return out

    # ---- gated deltanet ----
    def causal_conv(self, x, w, conv_pool, meta: GdnMeta, snapshots=None):
        return torch_gdn.causal_conv(x, w, conv_pool, meta, snapshots)

    def gdn_gates(self, a, b, A_log, dt_bias):
        return torch_gdn.gdn_gates(a, b, A_log, dt_bias)

    def gdn_recurrent(self, q, k, v, g, beta, state_pool, meta: GdnMeta, snapshots=None):
        return torch_gdn.gdn_recurrent(q, k, v, g, beta, state_pool, meta, snapshots)

    def gdn_chunk(self, q, k, v, g, beta, state_pool, meta: GdnMeta):
        return torch_gdn.gdn_chunk(q, k, v, g, beta, state_pool, meta)
