"""Warp-level tensor-core GEMV pieces: `mma.sync.m16n8k16` on fragments each thread builds from its own bytes.

Why not `tl.dot`: Triton builds the decoded weight tile in registers and moves it into the MMA operand layout
through shared memory (2 bytes per weight stored and re-read against 0.56 read from HBM for NVFP4), which held
the T = 2..16 GEMVs at 1.5-2.1x the T = 1 time (bench/NOTES.md §6). Here the K order inside an MMA is free:
thread (g = lane / 4, q = lane % 4) supplies A's rows g and g + 8 and B's column g at the MMA's virtual k slots
{2q, 2q+1, 2q+8, 2q+9}; whatever real weights it puts there, it puts the activations of the same real k into
B, so each thread decodes only bytes it loaded itself and no data crosses threads before the MMA.

The kernels are written per thread: every tensor has one element per thread, shape [NT] = [32 * NW], element
e = thread e (warp e // 32, lane e % 32 -- Triton's blocked layout for such a tensor; the compile tests check
that every inline-asm operand's layout in the compiled TTGIR is that one: `compile_check.lane_layouts_bad`). The warp-collective steps are inline PTX (`MODE` = PTX_SM80) or, in the interpreter and for the sm_70
compile check, the same arithmetic written as Triton ops over [NW, 8, 4] views (element order is lane order
there; the launcher never offers this variant below sm_80).

Activations enter the MMA as f16: per chunk of K and per T column the quad that holds the column (its four
lanes) takes a power of two from its largest |x| (`quad_max` + `x_scale`) so that |x'| < 2**15, and the
chunk's fp32 result is multiplied back (`col_back`: D's columns 2q, 2q+1 are other quads' columns).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gemv_h2_common import _PTX_SM80, lane_f32


@triton.jit
def _quads(v, NW: tl.constexpr):
    return tl.reshape(v, [NW, 8, 4])


@triton.jit
def _flat(v, NW: tl.constexpr):
    return tl.reshape(v, [NW * 32])


@triton.jit
def _emu_mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, NW: tl.constexpr):
    """`mma` written as Triton ops."""
    bs = (_quads(lane_f32(b0), NW), _quads(lane_f32(b0 >> 16), NW), _quads(lane_f32(b1), NW),
          _quads(lane_f32(b1 >> 16), NW))
    out = ()
    for half in tl.static_range(2):
        if half == 0:
            lo, hi = a0, a2
        else:
            lo, hi = a1, a3
        at = (_quads(lane_f32(lo), NW), _quads(lane_f32(lo >> 16), NW), _quads(lane_f32(hi), NW),
              _quads(lane_f32(hi >> 16), NW))
        d = tl.zeros([NW, 8, 8], tl.float32)
        for e in tl.static_range(4):   # d[w, row, col] += sum_q A[w, row, q, e] * B[w, col, q, e]
            d += tl.sum(at[e][:, :, None, :] * bs[e][:, None, :, :], axis=3)
        even, odd = tl.split(tl.reshape(d, [NW, 8, 4, 2]))
        out = out + (_flat(even, NW), _flat(odd, NW))
    return out[0] + c0, out[1] + c1, out[2] + c2, out[3] + c3


@triton.jit
def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, NW: tl.constexpr, MODE: tl.constexpr):
    """One m16n8k16 f16 MMA with fp32 accumulation, D = A @ B + C: (d0, d1, d2, d3) of this thread. a0/a2: A row g at
    k slots (2q, 2q+1) / (2q+8, 2q+9), a1/a3 the same for row g+8; b0/b1: B column g at those slots (f16x2 bits,
    the lower k in the low half); d0, d1 = D[g, 2q], D[g, 2q+1]; d2, d3 = D[g+8, 2q], D[g+8, 2q+1] (c0..c3 likewise)."""
    if MODE != _PTX_SM80:
        return _emu_mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, NW)
    else:
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
            "{$10, $11, $12, $13};", "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
            [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3], dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True, pack=1)


@triton.jit
def quad_max(bits, NW: tl.constexpr, MODE: tl.constexpr):
    """Max of non-negative int32 `bits` over the four lanes of each quad (lanes 4g..4g+3)."""
    if MODE != _PTX_SM80:
        m = tl.max(_quads(bits, NW), axis=2)
        return _flat(tl.broadcast_to(m[:, :, None], [NW, 8, 4]), NW)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; shfl.sync.bfly.b32 t, $1, 1, 0x1f, -1; max.s32 $0, $1, t; "
            "shfl.sync.bfly.b32 t, $0, 2, 0x1f, -1; max.s32 $0, $0, t; }",
            "=r,r", [bits], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def col_back(v, NW: tl.constexpr, MODE: tl.constexpr):
    """(value of column 2q, value of column 2q+1) for a per-quad value v (quad g holds column g's)."""
    if MODE != _PTX_SM80:
        per_col = tl.max(_quads(v, NW), axis=2)               # every lane of a quad holds the same value
        even, odd = tl.split(tl.reshape(per_col, [NW, 4, 2]))  # columns 2q, 2q+1 for q = 0..3
        return (_flat(tl.broadcast_to(even[:, None, :], [NW, 8, 4]), NW),
                _flat(tl.broadcast_to(odd[:, None, :], [NW, 8, 4]), NW))
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 q, s; mov.u32 q, %laneid; and.b32 q, q, 3; shl.b32 s, q, 3; "
            "shfl.sync.idx.b32 $0, $2, s, 0x1f, -1; add.u32 s, s, 4; shfl.sync.idx.b32 $1, $2, s, 0x1f, -1; }",
            "=f,=f,f", [v], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def x_scale(amax_bits):
    """(up, back) powers of two for a quad's chunk whose largest |x| has fp32 bits `amax_bits`: |x * up| < 2**15
    (f16 max 65504), back = 1 / up; the exponent is clamped so both stay finite normals (an all-zero chunk gets
    up = 2**126)."""
    e = tl.minimum(tl.maximum((amax_bits >> 23) & 0xFF, 15), 254)
    return ((268 - e) << 23).to(tl.float32, bitcast=True), ((e - 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def split_all(v, LOG: tl.constexpr):
    """[NT, 2**LOG] (a row held by one thread) -> tuple of 2**LOG [NT] tensors in column order: each level halves
    every part into its even and odd columns and lists all even halves first, which keeps part i = column i."""
    parts = (v,)
    for lvl in tl.static_range(LOG):
        evens, odds = (), ()
        for i in tl.static_range(1 << lvl):
            a, b = tl.split(tl.reshape(parts[i], [v.shape[0], 1 << (LOG - 1 - lvl), 2]))
            evens, odds = evens + (a,), odds + (b,)
        parts = evens + odds
    out = ()
    for c in tl.static_range(1 << LOG):
        out = out + (tl.reshape(parts[c], [v.shape[0]]),)
    return out


@triton.jit
def join_tree(vals, LOG: tl.constexpr):
    """Tuple of 2**LOG [NT] tensors -> one [NT, 2, ..., 2] tensor, each thread's values in its own registers (tl.join
    adds a dimension held by the thread); the last dimension is the top of the tree (first half / second half)."""
    parts = vals
    for lvl in tl.static_range(LOG):
        nxt = ()
        for i in tl.static_range(1 << (LOG - 1 - lvl)):
            nxt = nxt + (tl.join(parts[2 * i], parts[2 * i + 1]),)
        parts = nxt
    return parts[0]


@triton.jit
def split_tree(t, LOG: tl.constexpr):
    """The inverse of `join_tree`: splitting the last dimension first returns the values in their joined order."""
    parts = (t,)
    for lvl in tl.static_range(LOG):
        nxt = ()
        for i in tl.static_range(1 << lvl):
            a, b = tl.split(parts[i])
            nxt = nxt + (a, b)
        parts = nxt
    return parts


@triton.jit
def stack_all(vals, LOG: tl.constexpr):
    """Tuple of 2**LOG [NT] tensors -> [NT, 2**LOG] (`join_tree` flattened); the inverse order of `split_all` is not
    needed: stack every operand alike."""
    return tl.reshape(join_tree(vals, LOG), [vals[0].shape[0], 1 << LOG])
