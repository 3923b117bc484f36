"""Packed-half2 decode into tl.dot: the T = 2..16 path of the h2 formats (MTP verify, batched decode).

Why: the fp32 dot path (`gemv_common._dot_loop`) builds every weight as an fp32 (decode, block scale, cast
to bf16): ~5 instructions per weight, about three times the T = 1 h2 kernel's, and the H200 ran T = 4..16
at ~2x the T = 1 time although the weight bytes are the same (bench/NOTES.md §5). Here a format builds the
fp16 weight tile from f16x2 pairs with its block scale applied by one HMUL2 per pair (~2 instructions per
weight) and the MMA accumulates in fp32, so the cost per weight no longer grows with T up to the 16 columns
of one MMA tile.

A format supplies
  LOAD(w0, w1, rows, g0, g_hi, G, BLOCK_G, EVEN_G) -> state   the tile at group g0 (every load pipelinable:
                                                           cp.async moves 4, 8 or 16 bytes, no fewer)
  WTILE(st, H2_MODE) -> fp16 [BLOCK_N, BLOCK_G * 16]    the weights / fscale * 2**-W_EXP in the pair order
and W_BACK = 2**W_EXP. The pair order: column 2m + b of a 16-weight block holds weight 8 (m // 4) + m % 4 + 4b
(m = 0..7, b = 0..1), i.e. the f16x2 pairs (j, j + 4) of the h2 decode side by side, so that each pair word is
one register of the MMA operand as it is (natural order cost one byte permute per pair); the activations are
loaded in natural order and permuted the same way in registers. Activations: per tile and T column a power of two `up` from the largest |x| of the tile maps x into
f16 (|x * up| < 2**14; values below 2**-38 of the tile's largest become f16 subnormals, their products far
below the sum's fp32 rounding); each tile's MMA result is added to the fp32 accumulator times W_BACK / up
(exact: powers of two). Per tile, not per CTA slice: a pass over the slice before the loop was a chain of
dependent L2 round trips (~20 at T = 4) that made the first version 30 % slower than the fp32 dot path.
Grid, split-K workspace and epilogue as `gemv_common.gemv_body`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gemv_common import _finish

_UP_BIAS = tl.constexpr(267)      # up = 2**(140 - E) for the fp32 exponent field E of the slice's max |x|


@triton.jit
def _ups(xt):
    """Per column of the activation tile xt [BK, T_TILE] (fp32): up = 2**(140 - E), E the fp32 exponent field
    of the column's largest |x|, clamped to [13, 253] so that up and 1 / up stay finite normals."""
    e = (tl.max(tl.abs(xt), axis=0).to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.minimum(tl.maximum(e, 13), 253)
    return ((-e + _UP_BIAS) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _dot_loop(x_ptr, w0, w1, w2, w3, rows, t, g_lo, g_hi, G, T, stride_xt, LOAD: tl.constexpr,
              WTILE: tl.constexpr, W_BACK: tl.constexpr, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_G: tl.constexpr, EVEN_G: tl.constexpr, H2_MODE: tl.constexpr):
    acc = tl.zeros([BLOCK_N, T_TILE], tl.float32)
    for g0 in range(g_lo, g_hi, BLOCK_G):
        w = WTILE(LOAD(w0, w1, rows, g0, g_hi, G, BLOCK_G, EVEN_G), H2_MODE)
        k = g0 * 16 + tl.arange(0, BLOCK_G * 16)
        xt = tl.load(x_ptr + t[None, :] * stride_xt + k[:, None],
                     mask=(k < g_hi * 16)[:, None] & (t < T)[None, :], other=0.0)
        # into the pair order: each run of 8 activations [2 (b), 4 (a)] becomes [4 (a), 2 (b)]
        xt = tl.reshape(tl.permute(tl.reshape(xt.to(tl.float32), [BLOCK_G * 2, 2, 4, T_TILE]), (0, 2, 1, 3)),
                        [BLOCK_G * 16, T_TILE])
        up = _ups(xt)
        d = tl.dot(w, (xt * up[None, :]).to(tl.float16))
        acc += d * ((1.0 / up) * W_BACK)[None, :]     # exact: powers of two
    return acc


@triton.jit
def h2_dot_body(x_ptr, w0, w1, w2, w3, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split, stride_xt,
                stride_ot, stride_rt, LOAD: tl.constexpr, WTILE: tl.constexpr, W_BACK: tl.constexpr,
                T_TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, USE_SPLIT: tl.constexpr,
                HAS_RES: tl.constexpr, EVEN_G: tl.constexpr, H2_MODE: tl.constexpr):
    tl.static_assert(T_TILE >= 16 and BLOCK_N >= 16)     # tl.dot's smallest tile
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)      # tail rows re-read the last row and are never stored
    t = tl.program_id(2) * T_TILE + tl.arange(0, T_TILE)
    g_per = tl.cdiv(tl.cdiv(G, split), BLOCK_G) * BLOCK_G
    g_lo = tl.program_id(1) * g_per
    g_hi = tl.minimum(G, g_lo + g_per)
    acc = _dot_loop(x_ptr, w0, w1, w2, w3, rows, t, g_lo, g_hi, G, T, stride_xt, LOAD, WTILE, W_BACK, T_TILE,
                    BLOCK_N, BLOCK_G, EVEN_G, H2_MODE)
    _finish(acc * fscale, t, offs_n, N, T, split, out_ptr, stride_ot, res_ptr,
            stride_rt, ws_ptr, cnt_ptr, HAS_RES, USE_SPLIT)
