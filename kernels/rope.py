"""Partial NeoX rotary embedding of q and k in one launch (reference §6).

One program per (token, block of heads); q heads come first, then k heads. Dims [0, rotary_dim) are
rotated in pairs (j, j + rotary_dim/2); dims past rotary_dim are copied. Angles are fp32
(`position * inv_freq`, with inv_freq computed exactly as the torch reference does), cos/sin are libdevice's
full-range versions, so long positions keep their accuracy.

Positions are [T] (text) or [3, T] (interleaved MRoPE): frequency j reads row 1 if j % 3 == 1 and
j < 3 * section[1], row 2 if j % 3 == 2 and j < 3 * section[2], else row 0. Text positions are the same
code path with a zero row stride.

With `norm` the heads are RMS-normalised ((1 + w) gains, the attention's q/k norms) before the rotation, in
the same program: one launch instead of three for the attention layer's q/k preparation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ops_common import KernelInputError, pow2
from .pdl import pdl_enter, pdl_kw

HEADS_PER_PROGRAM = 4
_INV_FREQ: dict = {}


@triton.jit
def rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, inv_ptr, qw_ptr, kw_ptr, Hq, Hk, sq_t, sq_h, sk_t, sk_h,
                pos_row, sec1, sec2, D, eps,
                HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
                BLOCK_H: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)   # ninfer_kernels.pdl: before any load or store
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    axis = tl.where((j % 3 == 1) & (j < 3 * sec1), 1, tl.where((j % 3 == 2) & (j < 3 * sec2), 2, 0))
    pos = tl.load(pos_ptr + axis.to(tl.int64) * pos_row + t, mask=jm, other=0).to(tl.float32)
    ang = pos * tl.load(inv_ptr + j, mask=jm, other=0.0)
    cos = tl.cos(ang)[None, :]
    sin = tl.sin(ang)[None, :]
    is_q = h < Hq
    hk = tl.where(is_q, 0, h - Hq)
    ok = h < Hq + Hk
    # q and k heads share one tile; a row's source/destination is chosen per head
    src = tl.where(is_q, t * sq_t + h * sq_h, t * sk_t + hk * sk_h)[:, None]
    dst = tl.where(is_q, (t * Hq + h) * D, (t * Hk + hk) * D)[:, None]
    mq = (is_q & ok)[:, None]
    mk = ((~is_q) & ok)[:, None]
    m2 = jm[None, :]
    jj = j[None, :]
    p = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, :]
    pm = p < D
    x1 = _ld(q_ptr, k_ptr, src + jj, mq & m2, mk & m2)
    x2 = _ld(q_ptr, k_ptr, src + jj + HALF, mq & m2, mk & m2)
    xp = _ld(q_ptr, k_ptr, src + p, mq & pm, mk & pm)
    if NORM:
        # the heads' (1 + w) RMSNorm, rounded to the activation dtype as the unfused norm's output is
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xp * xp, axis=1)
        inv = tl.rsqrt(ss / D + eps)[:, None]
        isq = is_q[:, None]
        x1 = _norm(x1, inv, qw_ptr, kw_ptr, jj, isq, m2, qo_ptr)
        x2 = _norm(x2, inv, qw_ptr, kw_ptr, jj + HALF, isq, m2, qo_ptr)
        xp = _norm(xp, inv, qw_ptr, kw_ptr, p, isq, pm, qo_ptr)
    _st(qo_ptr, ko_ptr, dst + jj, x1 * cos - x2 * sin, mq & m2, mk & m2)
    _st(qo_ptr, ko_ptr, dst + jj + HALF, x2 * cos + x1 * sin, mq & m2, mk & m2)
    _st(qo_ptr, ko_ptr, dst + p, xp, mq & pm, mk & pm)


@triton.jit
def _norm(x, inv, qw_ptr, kw_ptr, off, isq, m, out_ptr):
    wq = tl.load(qw_ptr + off, mask=m, other=0.0).to(tl.float32)
    wk = tl.load(kw_ptr + off, mask=m, other=0.0).to(tl.float32)
    return (x * inv * (1.0 + tl.where(isq, wq, wk))).to(out_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _ld(q_ptr, k_ptr, off, mq, mk):
    a = tl.load(q_ptr + off, mask=mq, other=0.0).to(tl.float32)
    b = tl.load(k_ptr + off, mask=mk, other=0.0).to(tl.float32)
    return tl.where(mq, a, b)


@triton.jit
def _st(qo_ptr, ko_ptr, off, val, mq, mk):
    tl.store(qo_ptr + off, val.to(qo_ptr.dtype.element_ty), mask=mq)
    tl.store(ko_ptr + off, val.to(ko_ptr.dtype.element_ty), mask=mk)


def inv_freq(rotary_dim: int, theta: float, device) -> torch.Tensor:
    """theta^(-2j/rotary_dim) in fp32, computed the way the torch backend does (so angles match bit for bit)."""
    key = (rotary_dim, float(theta), str(device))
    if key not in _INV_FREQ:
        _INV_FREQ[key] = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=device).float() / rotary_dim))
    return _INV_FREQ[key]


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float,
         mrope_section: tuple[int, ...] | None = None, norm: tuple | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D] -> rotated copies (contiguous, same dtypes). norm = (q_w, k_w, eps): each
    head is first RMS-normalised with the (1 + w) gains q_w / k_w [D] (fp32) -- the q/k norms in one launch."""
    t, hq, d = q.shape
    hk = k.shape[1]
    if rotary_dim % 2 or not 0 < rotary_dim <= d or k.shape[0] != t or k.shape[2] != d:
        raise KernelInputError(f"rope: rotary_dim {rotary_dim} / q {tuple(q.shape)} / k {tuple(k.shape)} mismatch")
    if norm is not None and (norm[0].shape != (d,) or norm[1].shape != (d,) or q.dtype != k.dtype):
        raise KernelInputError(f"rope: norm gains {tuple(norm[0].shape)} / {tuple(norm[1].shape)} do not match "
                               f"head dim {d} (or q {q.dtype} vs k {k.dtype})")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    qo, ko = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if positions.dim() == 1:
        pos, row, sec = positions.contiguous(), 0, (0, 0)
    else:
        pos = positions.contiguous()
        row = pos.stride(0)
        s = tuple(mrope_section) if mrope_section else (rotary_dim // 2, 0, 0)
        sec = (s[1], s[2])
    if pos.shape[-1] != t:
        raise KernelInputError(f"rope: positions {tuple(positions.shape)} do not cover {t} tokens")
    half = rotary_dim // 2
    if t:
        block_h = min(HEADS_PER_PROGRAM, pow2(hq + hk))
        grid = (t, triton.cdiv(hq + hk, block_h))
        inv = inv_freq(rotary_dim, theta, q.device)
        qw, kw, eps = norm if norm is not None else (inv, inv, 0.0)    # gains unread without NORM
        rope_kernel[grid](q, k, qo, ko, pos, inv, qw, kw, hq, hk,
                          q.stride(0), q.stride(1), k.stride(0), k.stride(1), row, sec[0], sec[1], d, float(eps),
                          HALF=half, BLOCK_HALF=pow2(half), BLOCK_PASS=pow2(d - rotary_dim),
                          BLOCK_H=block_h, NORM=norm is not None, num_warps=4, **pdl_kw(q.device))
    return qo, ko


def compile_specs(act: str):
    sig = {"q_ptr": f"*{act}", "k_ptr": f"*{act}", "qo_ptr": f"*{act}", "ko_ptr": f"*{act}", "pos_ptr": "*i64",
           "inv_ptr": "*fp32", "qw_ptr": "*fp32", "kw_ptr": "*fp32", "Hq": "i32", "Hk": "i32", "sq_t": "i64",
           "sq_h": "i64", "sk_t": "i64", "sk_h": "i64", "pos_row": "i64", "sec1": "i32", "sec2": "i32", "D": "i32",
           "eps": "fp32"}
    return [(rope_kernel, sig, {"HALF": 32, "BLOCK_HALF": 32, "BLOCK_PASS": 256, "BLOCK_H": HEADS_PER_PROGRAM,
                                "NORM": n}) for n in (False, True)]
