"""Torch reference of the Gated DeltaNet pieces: causal conv, gates, recurrent and chunked delta rule.

Everything is computed in fp32. Per-sequence Python loops: this is the readable reference the Triton
kernels are checked against, not a fast path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import GdnMeta

CHUNK = 64


def _bounds(meta: GdnMeta):
    start = 0
    for b, t in enumerate(meta.seq_lens):
        yield b, start, t
        start += t


def causal_conv(x, w, conv_pool, meta: GdnMeta, snapshots=None):
    ck = w.shape[1]
    wf = w.float()
    y = torch.empty_like(x)
    for b, s, t in _bounds(meta):
        slot = meta.slots[b:b + 1]
        window = torch.cat([conv_pool.index_select(0, slot)[0], x[s:s + t].float()])   # [ck-1+T, C]
        taps = window.unfold(0, ck, 1)                                                  # [T, C, ck]
        y[s:s + t] = F.silu((taps * wf).sum(-1)).to(x.dtype)
        snap = meta.snap_index_host[b]
        if snap < 0:
            conv_pool.index_copy_(0, slot, window[t:][None])
        else:
            # window after token i = inputs i+1 .. i+ck-1 of `window`
            snapshots[snap:snap + t] = window.unfold(0, ck - 1, 1)[1:].transpose(1, 2)
    return y


def gdn_gates(a, b, A_log, dt_bias):
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def _prepare(q, k, hv: int):
    """l2-normalise q, k per head (fp32), scale q by dk^-0.5, expand key heads to value heads."""
    qf, kf = q.float(), k.float()
    qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
    rep = hv // q.shape[1]
    return qf.repeat_interleave(rep, dim=1), kf.repeat_interleave(rep, dim=1)


def _recurrent_block(S, q, k, v, g, beta, snaps):
    """S [B, H, dk, dv]; q, k [B, T, H, dk]; v [B, T, H, dv]; g, beta [B, T, H]. Returns o [B, T, H, dv]."""
    o = torch.empty_like(v)
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        pred = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        delta = beta[:, t, :, None] * (v[:, t] - pred)
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        o[:, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, t])
        if snaps is not None:
            snaps[:, t] = S
    return o, S


def gdn_recurrent(q, k, v, g, beta, state_pool, meta: GdnMeta, snapshots=None):
    hv = v.shape[1]
    qf, kf = _prepare(q, k, hv)
    vf = v.float()
    out = torch.empty_like(v)
    lens = set(meta.seq_lens)
    if len(lens) == 1:          # decode / verify: all sequences advance together
        groups = [list(range(len(meta.seq_lens)))]
    else:
        groups = [[b] for b in range(len(meta.seq_lens))]
    cu = [0]
    for t in meta.seq_lens:
        cu.append(cu[-1] + t)
    for grp in groups:
        t = meta.seq_lens[grp[0]]
        rows = torch.cat([torch.arange(cu[b], cu[b] + t) for b in grp]).to(q.device)
        shp = (len(grp), t)
        take = lambda a: a.index_select(0, rows).reshape(*shp, *a.shape[1:])   # noqa: E731
        slots = meta.slots[grp[0]:grp[-1] + 1]
        snap_rows = [meta.snap_index_host[b] for b in grp]
        snaps = (torch.empty(*shp, *state_pool.shape[1:], device=v.device)
                 if max(snap_rows) >= 0 else None)
        o, S = _recurrent_block(state_pool.index_select(0, slots), take(qf), take(kf), take(vf),
                                take(g.float()), take(beta.float()), snaps)
        out.index_copy_(0, rows, o.reshape(-1, *o.shape[2:]).to(v.dtype))
        for j, b in enumerate(grp):
            if snap_rows[j] < 0:
                state_pool.index_copy_(0, meta.slots[b:b + 1], S[j:j + 1])
            else:
                snapshots[snap_rows[j]:snap_rows[j] + t] = snaps[j]
    return out


def _chunk_seq(S, q, k, v, g, beta):
    """One sequence, heads first: q, k [H, T, dk], v [H, T, dv], g, beta [H, T]; S [H, dk, dv]."""
    outs = []
    for c0 in range(0, q.shape[1], CHUNK):
        qc, kc, vc = q[:, c0:c0 + CHUNK], k[:, c0:c0 + CHUNK], v[:, c0:c0 + CHUNK]
        bc, gam = beta[:, c0:c0 + CHUNK], g[:, c0:c0 + CHUNK].cumsum(-1)      # log of cumulative decay
        n = qc.shape[1]
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        diff = (gam[:, :, None] - gam[:, None, :]).masked_fill(~lower, float("-inf"))
        decay = diff.exp()                                   # exp(gam_t - gam_s) for s <= t, else 0
        # delta rule inside the chunk: (I + A) D = beta * (V - Gamma * K S0), A strictly lower
        a = (bc[:, :, None] * (kc @ kc.transpose(1, 2)) * decay).tril(-1)
        eye = torch.eye(n, device=q.device).expand_as(a)
        rhs = bc[..., None] * (vc - gam.exp()[..., None] * (kc @ S))
        d = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        outs.append(gam.exp()[..., None] * (qc @ S) + ((qc @ kc.transpose(1, 2)) * decay) @ d)
        tail = (gam[:, -1:] - gam).exp()[..., None]          # decay from each token to the chunk end
        S = gam[:, -1].exp()[:, None, None] * S + (kc * tail).transpose(1, 2) @ d
    return torch.cat(outs, dim=1), S


def gdn_chunk(q, k, v, g, beta, state_pool, meta: GdnMeta):
    if any(i >= 0 for i in meta.snap_index_host):
        raise ValueError("gdn_chunk: snapshots are only produced by gdn_recurrent")
    hv = v.shape[1]
    qf, kf = _prepare(q, k, hv)
    out = torch.empty_like(v)
    for b, s, t in _bounds(meta):
        slot = meta.slots[b:b + 1]
        heads = [a[s:s + t].float().transpose(0, 1) for a in (qf, kf, v, g, beta)]
        o, S = _chunk_seq(state_pool.index_select(0, slot)[0], *heads)
        out[s:s + t] = o.transpose(0, 1).to(v.dtype)
        state_pool.index_copy_(0, slot, S[None])
    return out
