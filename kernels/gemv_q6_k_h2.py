"""GGML Q6_K dequant-GEMV with packed half2 arithmetic (T <= 8): the decode-path variant of `gemv_q6_k`.

Same repacked arrays as `gemv_q6_k` (ql int64, qh int32, sc int8, d fp16 per row and 16-weight group) and
the same assembly of complete 6-bit codes, four to an int32 word (weights 2b, 2b+1, 8+2b, 9+2b in byte b of
four words). Then, per word, bytes (0, 2) and (1, 3) become f16x2 pairs without a conversion: a code byte
under the exponent 0x64 is the half 1024 + code exactly, and one HFMA2 (x 1.0 - 1056) leaves code - 32 in
[-32, 31], exact. The pairs are weights (j, j+4) and (8+j, 12+j), the order of `gemv_h2_common.x_pairs`.
Activations are scaled to |x'| < 2**6 per (CTA, T column), so a 16-weight block sum stays below 2**15 in
f16; the fp32 block sum takes the GGML scale sc * d; 2**-k at the end. Skeleton: `gemv_h2_common`.
XPRE (prepared activations, `ninfer_kernels.x16`: |x'| < 2**14, no per-CTA pass over x): the same HFMA2 with
(2**-8, -1056 * 2**-8) gives (code - 32) * 2**-8, still exact (4 + code / 256 is an f16 in [4, 8)), so the block
sums keep the same f16 range; the chunk's back joins the block scale and 2**8 comes back at the end.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gemv_common import _tset
from .gemv_h2_common import column_pairs, compile_consts, factory, h2_body, hfma2, lanes_f32
from .gemv_q6_k import _load

_LOW = tl.constexpr(0x00FF00FF)            # bytes 0 and 2 of a word, one per f16 lane
_EXP = tl.constexpr(0x64006400)            # f16 exponent of 1024 in both lanes
_ONE2 = tl.constexpr(0x3C003C00)           # f16x2 (1, 1)
_NEG2 = tl.constexpr(-467606496)           # f16x2 (-1056, -1056) = 0xE420E420 as int32
_UP_BIAS = tl.constexpr(259)               # up = 2**(132 - E): |x'| < 2**6
_BACK_BIAS = tl.constexpr(-5)              # back = 2**(E - 132) = 1 / up
_XONE2 = tl.constexpr(0x1C001C00)          # f16x2 (2**-8, 2**-8): the weights' scale on prepared input
_XNEG2 = tl.constexpr(-1004485600)         # f16x2 (-4.125, -4.125) = 0xC420C420 as int32: -1056 * 2**-8
_XPRE_BACK = tl.constexpr(8)               # on prepared input: the weights' 2**-8 undone


@triton.jit
def _pairs(w, H2_MODE: tl.constexpr, XPRE: tl.constexpr):
    """f16x2 (code - 32) of bytes (0, 2) and of bytes (1, 3) of a word of four 6-bit codes (times 2**-8: XPRE)."""
    if XPRE:
        one, neg = tl.full(w.shape, _XONE2, tl.int32), tl.full(w.shape, _XNEG2, tl.int32)
    else:
        one, neg = tl.full(w.shape, _ONE2, tl.int32), tl.full(w.shape, _NEG2, tl.int32)
    p02 = hfma2((w & _LOW) | _EXP, one, neg, H2_MODE)
    p13 = hfma2(((w >> 8) & _LOW) | _EXP, one, neg, H2_MODE)
    return p02, p13


@triton.jit
def _tile(accs, ups, st, g, xm, t0, T, x_ptr, stride_xt, T_TILE: tl.constexpr, H2_MODE: tl.constexpr,
          XPRE: tl.constexpr, G):
    qe_a, qo_a, qe_b, qo_b, sw = st      # gemv_q6_k's tile load: complete codes, fp32 scale sc * d
    e0, e2 = _pairs(qe_a, H2_MODE, XPRE)     # weights (0,4), (2,6)
    o1, o3 = _pairs(qo_a, H2_MODE, XPRE)     # (1,5), (3,7)
    e8, e10 = _pairs(qe_b, H2_MODE, XPRE)    # (8,12), (10,14)
    o9, o11 = _pairs(qo_b, H2_MODE, XPRE)    # (9,13), (11,15)
    for tt in tl.static_range(T_TILE):
        p, s = column_pairs(x_ptr, tl.minimum(t0 + tt, T - 1) * stride_xt, g, xm, ups[tt], sw, G, H2_MODE, XPRE)
        acc = hfma2(e0, p[0][None, :], tl.zeros_like(qe_a), H2_MODE)
        acc = hfma2(o1, p[1][None, :], acc, H2_MODE)
        acc = hfma2(e2, p[2][None, :], acc, H2_MODE)
        acc = hfma2(o3, p[3][None, :], acc, H2_MODE)
        acc = hfma2(e8, p[4][None, :], acc, H2_MODE)
        acc = hfma2(o9, p[5][None, :], acc, H2_MODE)
        acc = hfma2(e10, p[6][None, :], acc, H2_MODE)
        acc = hfma2(o11, p[7][None, :], acc, H2_MODE)
        accs = _tset(accs, tt, accs[tt] + lanes_f32(acc, H2_MODE) * s)
    return accs


@triton.jit
def q6_k_h2_gemv_kernel(x_ptr, ql, qh, sc, d, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split,
                        stride_xt, stride_ot, stride_rt, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_G: tl.constexpr, USE_SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
                        DOT_KIND: tl.constexpr, EPI: tl.constexpr, EVEN_G: tl.constexpr,
                        FOLD: tl.constexpr, STAGES: tl.constexpr, H2_MODE: tl.constexpr, XPRE: tl.constexpr,
                        PDL: tl.constexpr = 0):
    # USE_DOT / DOT_KIND / FOLD are accepted for the shared launcher and unused here. XPRE: x_ptr holds prepared
    # activations (ninfer_kernels.x16, int32 words), stride_xt in words. PDL: ninfer_kernels.pdl
    h2_body(x_ptr, ql, qh, sc, d, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split, stride_xt,
            stride_ot, stride_rt, _load, _tile, _UP_BIAS, _BACK_BIAS, T_TILE, BLOCK_N, BLOCK_G, USE_SPLIT,
            EPI, EVEN_G, STAGES, H2_MODE, XPRE, _XPRE_BACK, PDL)


h2_kernel = factory(q6_k_h2_gemv_kernel, "q6_k_gemv_kernel")   # gemv_q6_k registers it (lazily)


def kernel_for(fmt: str = "q6_k_h2", dequant: bool = False, cc: int = 90):
    """(kernel, signature of its weight arguments, extra constexprs) for compile checks."""
    if dequant:
        raise ValueError("q6_k_h2 has no dequantizer of its own (gemv_q6_k's serves both)")
    return q6_k_h2_gemv_kernel, {"ql": "*i64", "qh": "*i32", "sc": "*i8", "d": "*fp16"}, compile_consts(cc)
