"""Partial NeoX rotary embedding of q and k in one launch (reference §6).

One program per (token, block of heads); q heads come first, then k heads. Dims [0, rotary_dim) are
rotated in pairs (j, j + rotary_dim/2); dims past rotary_dim are copied. Angles are fp32
(`position * inv_freq`, with inv_freq computed exactly as the torch reference does), cos/sin are libdevice's
full-range versions, so long positions keep their accuracy.

Positions are [T] (text) or [3, T] (interleaved MRoPE): frequency j reads row 1 if j % 3 == 1 and
j < 3 * section[1], row 2 if j % 3 == 2 and j < 3 * section[2], else row 0. Text positions are the same
code path with a zero row stride.

With `norm` the heads are RMS-normalised ((1 + w) gains, the attention's q/k norms) before the rotation, in
the same program: one launch instead of three for the attention layer's q/k preparation. With `store`
(`qk_norm_rope_store`) the rotated k heads go straight into the paged KV cache at the tokens' slots, and the k
heads' programs copy v there too: the cache store without a launch of its own (negative slots: not stored).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_write import check_store
from .ops_common import KernelInputError, pow2
from .pdl import pdl_enter, pdl_kw

HEADS_PER_PROGRAM = 4
_INV_FREQ: dict = {}


@triton.jit
def rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, inv_ptr, qw_ptr, kw_ptr, v_ptr, vc_ptr, slot_ptr, Hq, Hk,
                sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, pos_row, sec1, sec2, D, eps,
                HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
                BLOCK_H: tl.constexpr, NORM: tl.constexpr, STORE: tl.constexpr, BLOCK_D: tl.constexpr = 16,
                PDL: tl.constexpr = 0):
    """STORE: ko_ptr is the K cache [slots, Hk, D], vc_ptr the V cache, k head rows go to slot_ptr[t]."""
    pdl_enter(PDL)   # ninfer_kernels.pdl: before any load or store
    t = tl.program_id(0).to(tl.int64)
    if STORE:
        krow = tl.load(slot_ptr + t).to(tl.int64)
    else:
        krow = t
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    axis = tl.where((j % 3 == 1) & (j < 3 * sec1), 1, tl.where((j % 3 == 2) & (j < 3 * sec2), 2, 0))
    pos = tl.load(pos_ptr + axis.to(tl.int64) * pos_row + t, mask=jm, other=0).to(tl.float32)
    freq = tl.load(inv_ptr + j, mask=jm, other=0.0)
    is_q = h < Hq
    hk = tl.where(is_q, 0, h - Hq)
    ok = h < Hq + Hk
    # q and k heads share one tile; a row's source/destination is chosen per head
    src = tl.where(is_q, t * sq_t + h * sq_h, t * sk_t + hk * sk_h)[:, None]
    dst = tl.where(is_q, (t * Hq + h) * D, (krow * Hk + hk) * D)[:, None]
    mq = (is_q & ok)[:, None]
    # loads do not wait for the slot (the k rows are read whether or not they are stored): one dependent
    # round trip fewer; only the stores are masked by a negative slot (a vector compare)
    mkl = ((~is_q) & ok)[:, None]
    mk = mkl & ((h * 0 + krow) >= 0)[:, None]
    m2 = jm[None, :]
    jj = j[None, :]
    p = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, :]
    pm = p < D
    # every load up front (heads, gains, v): each one issued after a reduction or a store would be one more
    # dependent memory round trip in a kernel that is nothing but latency
    x1 = _ld(q_ptr, k_ptr, src + jj, mq & m2, mkl & m2)
    x2 = _ld(q_ptr, k_ptr, src + jj + HALF, mq & m2, mkl & m2)
    xp = _ld(q_ptr, k_ptr, src + p, mq & pm, mkl & pm)
    if STORE:
        dd = tl.arange(0, BLOCK_D)[None, :]
        mv = mk & (dd < D)
        v = tl.load(v_ptr + (t * sv_t + hk * sv_h)[:, None] + dd, mask=mkl & (dd < D))
    if NORM:
        isq = is_q[:, None]
        g1, g2 = _gain(qw_ptr, kw_ptr, jj, isq, m2), _gain(qw_ptr, kw_ptr, jj + HALF, isq, m2)
        gp = _gain(qw_ptr, kw_ptr, p, isq, pm)
    # cos / sin only now: libdevice's full-range versions are ~1000 instructions with branches, and ptxas
    # does not move the loads above them (s24 SASS: the head loads came after the whole range reduction)
    ang = pos * freq
    cos = tl.cos(ang)[None, :]
    sin = tl.sin(ang)[None, :]
    if NORM:
        # the heads' (1 + w) RMSNorm, rounded to the activation dtype as the unfused norm's output is
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xp * xp, axis=1)
        inv = tl.rsqrt(ss / D + eps)[:, None]
        x1 = (x1 * inv * g1).to(qo_ptr.dtype.element_ty).to(tl.float32)
        x2 = (x2 * inv * g2).to(qo_ptr.dtype.element_ty).to(tl.float32)
        xp = (xp * inv * gp).to(qo_ptr.dtype.element_ty).to(tl.float32)
    _st(qo_ptr, k_ptr, ko_ptr, dst + jj, x1 * cos - x2 * sin, mq & m2, mk & m2)
    _st(qo_ptr, k_ptr, ko_ptr, dst + jj + HALF, x2 * cos + x1 * sin, mq & m2, mk & m2)
    _st(qo_ptr, k_ptr, ko_ptr, dst + p, xp, mq & pm, mk & pm)
    if STORE:
        tl.store(vc_ptr + dst + dd, v.to(vc_ptr.dtype.element_ty), mask=mv)


@triton.jit
def _gain(qw_ptr, kw_ptr, off, isq, m):
    """(1 + w) of each head's norm at columns off (q gains on q rows, k gains on k rows)."""
    wq = tl.load(qw_ptr + off, mask=m, other=0.0).to(tl.float32)
    wk = tl.load(kw_ptr + off, mask=m, other=0.0).to(tl.float32)
    return 1.0 + tl.where(isq, wq, wk)


@triton.jit
def _ld(q_ptr, k_ptr, off, mq, mk):
    a = tl.load(q_ptr + off, mask=mq, other=0.0).to(tl.float32)
    b = tl.load(k_ptr + off, mask=mk, other=0.0).to(tl.float32)
    return tl.where(mq, a, b)


@triton.jit
def _st(qo_ptr, k_ptr, ko_ptr, off, val, mq, mk):
    """k is rounded to its own dtype first, as an unfused rotation followed by a cache store would."""
    tl.store(qo_ptr + off, val.to(qo_ptr.dtype.element_ty), mask=mq)
    tl.store(ko_ptr + off, val.to(k_ptr.dtype.element_ty).to(ko_ptr.dtype.element_ty), mask=mk)


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
    return _launch(q, k, positions, rotary_dim, theta, mrope_section, norm, None)


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       rotary_dim: int, theta: float, mrope_section: tuple[int, ...] | None, norm: tuple,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """`rope(..., norm=norm)` whose rotated k, and v [T, Hk, D], go into k_cache / v_cache [num_pages, page_size,
    Hk, D] at the flat slots slot_mapping [T] (as `kv_write`; negative slots skipped); returns the rotated q."""
    check_store(k_cache, v_cache, k, v, slot_mapping, "qk_norm_rope_store")
    v = v if v.stride(-1) == 1 else v.contiguous()
    return _launch(q, k, positions, rotary_dim, theta, mrope_section, norm,
                   (v, k_cache, v_cache, slot_mapping))[0]


def _positions(positions: torch.Tensor, rotary_dim: int, mrope_section, t: int):
    """(positions, their axis-row stride, MRoPE sections 1 and 2)."""
    if positions.dim() == 1:
        pos, row, sec = positions.contiguous(), 0, (0, 0)
    else:
        pos = positions.contiguous()
        row = pos.stride(0)
        s = tuple(mrope_section) if mrope_section else (rotary_dim // 2, 0, 0)
        sec = (s[1], s[2])
    if pos.shape[-1] != t:
        raise KernelInputError(f"rope: positions {tuple(positions.shape)} do not cover {t} tokens")
    return pos, row, sec


def _launch(q, k, positions, rotary_dim, theta, mrope_section, norm, store):
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
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    pos, row, sec = _positions(positions, rotary_dim, mrope_section, t)
    if store is None:
        ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        v, vc, slots = k, k, pos                                    # unread without STORE
    else:
        v, ko, vc, slots = store
    if t:
        block_h = min(HEADS_PER_PROGRAM, pow2(hq + hk))
        inv = inv_freq(rotary_dim, theta, q.device)
        qw, kw, eps = norm if norm is not None else (inv, inv, 0.0)    # gains unread without NORM
        rope_kernel[(t, triton.cdiv(hq + hk, block_h))](
            q, k, qo, ko, pos, inv, qw, kw, v, vc, slots, hq, hk, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), v.stride(0), v.stride(1), row, sec[0], sec[1], d, float(eps), HALF=rotary_dim // 2,
            BLOCK_HALF=pow2(rotary_dim // 2), BLOCK_PASS=pow2(d - rotary_dim), BLOCK_H=block_h,
            NORM=norm is not None, STORE=store is not None, BLOCK_D=pow2(d), num_warps=4, **pdl_kw(q.device))
    return qo, (ko if store is None else None)


def compile_specs(act: str):
    sig = {"q_ptr": f"*{act}", "k_ptr": f"*{act}", "qo_ptr": f"*{act}", "ko_ptr": f"*{act}", "pos_ptr": "*i64",
           "inv_ptr": "*fp32", "qw_ptr": "*fp32", "kw_ptr": "*fp32", "v_ptr": f"*{act}", "vc_ptr": f"*{act}",
           "slot_ptr": "*i64", "Hq": "i32", "Hk": "i32", "sq_t": "i64", "sq_h": "i64", "sk_t": "i64", "sk_h": "i64",
           "sv_t": "i64", "sv_h": "i64", "pos_row": "i64", "sec1": "i32", "sec2": "i32", "D": "i32", "eps": "fp32"}
    return [(rope_kernel, sig, {"HALF": 32, "BLOCK_HALF": 32, "BLOCK_PASS": 256, "BLOCK_H": HEADS_PER_PROGRAM,
                                "NORM": n, "STORE": st, "BLOCK_D": 256}) for n, st in ((False, False), (True, False),
                                                                                      (True, True))]
