"""NVFP4 dequant-GEMV with packed half2 arithmetic (T <= 8): the decode-path variant of `gemv_nvfp4`.

Why: the fp32 variant spends ~3 integer ops + 1 FFMA per weight (0.29 warp-instructions per packed byte, an
H200 issues ~0.25 per byte at full bandwidth). Here two weights share most instructions (0.17 per byte; on
the H200 T=1 went from 39-63 % to 38-79 % of copy bandwidth, bench/NOTES.md §4):

* weights -> f16x2 without a table: the 16-bit lanes of a code word hold nibbles j and j+4 at the same
  offset; after one rotate and two bit-selects per word move every sign 3 bits up, one shift + mask per pair
  puts the E2M1 magnitude bits at f16 bits 11..9 and the sign at bit 15 (~11 ops per 8 weights). As an IEEE
  half that is e2m1 * 2**-14 exactly (E2M1's e = 0 codes are f16 subnormals, which the f16 units keep);
* activations -> f16x2: x' = x * 2**k per (CTA, T column), k from the largest |x| of the CTA's K slice
  (`gemv_h2_common.row_scale`) so that |x'| < 2**14: no overflow for any input, ~11 significant bits;
  activations below 2**-28 of that row's slice maximum become f16 subnormals (their products, < 2**-14 of
  the largest, lose relative precision, not the sum);
* 8 HFMA2 per 16-weight block accumulate in f16 (|block sum| < 96 by construction), then one conversion
  to fp32 and one FFMA with the E4M3 block scale; blocks accumulate in fp32; 2**14 / 2**k at the end.
Precision: a block sum carries ~1e-3 relative rounding (f16), below bf16's own 4e-3 output rounding.
The sign split is PTX too (`shf.l.wrap` + two `lop3`: ptxas otherwise splits each select in two).
Weights as in `gemv_nvfp4` (its chunk-major planes, read by its tile load); skeleton in `gemv_h2_common`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gemv_common import _tset, e4m3_magnitude
from .gemv_h2_common import _EMULATE, column_pairs, compile_consts, factory, h2_body, hfma2, lanes_f32
from .gemv_nvfp4 import _load

_PAIR = tl.constexpr(0x8E008E00)           # f16 bits 15 and 11..9 of both lanes
_UP_BIAS = tl.constexpr(267)               # up = 2**(140 - E): |x'| < 2**14
_BACK_BIAS = tl.constexpr(1)               # back = 2**(E - 126) = 2**14 / up (the weights carry 2**-14)
_XPRE_BACK = tl.constexpr(14)              # on prepared input: the weights' 2**-14 undone


@triton.jit
def _split_signs(q, H2_MODE: tl.constexpr):
    """(even, odd) int32 words for `_wpair`: the magnitude bits of the even (odd) nibbles in place and each
    nibble's sign 3 bits above its own position (from q rotated left by 3, which keeps nibble 7's sign)."""
    if H2_MODE == _EMULATE:
        u = q.to(tl.uint32, bitcast=True)
        rot3 = (u << 3) | (u >> 29)
        even = (u & 0x07070707) | (rot3 & 0xF8F8F8F8)
        odd = (u & 0x70707070) | (rot3 & 0x8F8F8F8F)
        return even, odd
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 r; shf.l.wrap.b32 r, $2, $2, 3; lop3.b32 $0, $2, r, 0x07070707, 0xE4; "
            "lop3.b32 $1, $2, r, 0x70707070, 0xE4; }",
            "=r,=r,r", [q], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)


@triton.jit
def _wpair(even, odd, j: tl.constexpr):
    """f16x2 bits of weights (j, j + 4) of a code word (nibble i at bits 4i..4i+3), from `_split_signs`:
    one shift puts both the magnitude (at bits 11..9) and the sign (at bit 15) of each lane in place."""
    if j == 0:
        w = even << 9
    elif j == 1:
        w = odd << 5
    elif j == 2:
        w = even << 1
    else:
        w = (odd >> 3) | (odd << 29)     # rotate: nibble 7's sign came around to bit 2
    return (w & _PAIR).to(tl.int32, bitcast=True)


@triton.jit
def _tile(accs, ups, st, g, xm, t0, T, x_ptr, stride_xt, T_TILE: tl.constexpr, H2_MODE: tl.constexpr,
          XPRE: tl.constexpr, G):
    lo, hi, sb = st                       # gemv_nvfp4's tile load: code words split in halves, scale bytes
    sc = e4m3_magnitude(sb)
    le, lo_odd = _split_signs(lo, H2_MODE)
    he, hi_odd = _split_signs(hi, H2_MODE)
    for tt in tl.static_range(T_TILE):
        p, s = column_pairs(x_ptr, tl.minimum(t0 + tt, T - 1) * stride_xt, g, xm, ups[tt], sc, G, H2_MODE, XPRE)
        acc = hfma2(_wpair(le, lo_odd, 0), p[0][None, :], tl.zeros_like(lo), H2_MODE)
        for j in tl.static_range(1, 4):
            acc = hfma2(_wpair(le, lo_odd, j), p[j][None, :], acc, H2_MODE)
        for j in tl.static_range(4):
            acc = hfma2(_wpair(he, hi_odd, j), p[4 + j][None, :], acc, H2_MODE)
        accs = _tset(accs, tt, accs[tt] + lanes_f32(acc, H2_MODE) * s)
    return accs


@triton.jit
def nvfp4_h2_gemv_kernel(x_ptr, codes, scales, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split,
                         stride_xt, stride_ot, stride_rt, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_G: tl.constexpr, USE_SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
                         DOT_KIND: tl.constexpr, EPI: tl.constexpr, EVEN_G: tl.constexpr,
                         FOLD: tl.constexpr, STAGES: tl.constexpr, H2_MODE: tl.constexpr,
                         XPRE: tl.constexpr, PDL: tl.constexpr = 0):
    # USE_DOT / DOT_KIND / FOLD are accepted for the shared launcher and unused here. XPRE: x_ptr holds prepared
    # activations (ninfer_kernels.x16, int32 words), stride_xt in words. PDL: ninfer_kernels.pdl
    h2_body(x_ptr, codes, scales, N, None, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split,
            stride_xt, stride_ot, stride_rt, _load, _tile, _UP_BIAS, _BACK_BIAS, T_TILE, BLOCK_N, BLOCK_G,
            USE_SPLIT, EPI, EVEN_G, STAGES, H2_MODE, XPRE, _XPRE_BACK, PDL)


h2_kernel = factory(nvfp4_h2_gemv_kernel, "nvfp4_gemv_kernel")   # gemv_nvfp4 registers it (lazily)


def kernel_for(fmt: str = "nvfp4_h2", dequant: bool = False, cc: int = 90):
    """(kernel, signature of its weight arguments, extra constexprs) for compile checks."""
    if dequant:
        raise ValueError("nvfp4_h2 has no dequantizer of its own (gemv_nvfp4's serves both)")
    return nvfp4_h2_gemv_kernel, {"codes": "*i64", "scales": "*u8"}, compile_consts(cc)
