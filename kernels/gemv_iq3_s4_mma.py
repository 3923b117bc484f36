"""IQ3_S 4-bit-code dequant-GEMV on tensor cores (T = 1..16, sm_80+): the `mma` variant of `gemv_iq3_s4`.

Skeleton and lane layout: `gemv_mma_body`. A lane's 32 weights of a chunk (groups gk + 2q, gk + 2q + 1) are one
IQ3_S sub-block, so per row it loads the two groups' codes (two int64, the words 0..3 of its 32 weights), the
sub-block's scale nibble and the row's super-block d (one per 256 weights, so one per chunk of 128). MMA pair
4w + j is weights (8w + j, 8w + j + 4): exactly pair j of word w in `gemv_iq3_s4_h2.word_pairs`, so no table, no
gather and no recombination of halves. Each pair (2v - 15) * 2**-9 is multiplied by (1 + 2 * s4) as f16x2
(|product| <= 465 * 2**-9, exact); the MMA sums a chunk in fp32, d of each row multiplies the result (`ROW_FACTOR`)
and 2**9 goes into fscale.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gemv_h2_common import compile_consts, factory, hmul2
from .gemv_iq3_s4_h2 import _UNSCALE, sub_block_pairs
from .gemv_mma_body import mma_body, no_prep
from .pdl import pdl_wait



@triton.jit
def _load_row(wts, row, gk, q, G):
    """(codes of groups gk + 2q, +1 [NT, 2] int64, the sub-block's 4-bit scale, the row's d for this chunk)."""
    codes, sc, d = wts
    off = tl.multiple_of(row * G + gk + 2 * q, 2)
    h = gk // 2 + q
    return (tl.load(codes + off[:, None] + tl.arange(0, 2)[None, :]),
            (tl.load(sc + row * (G // 4) + h // 2).to(tl.int32) >> (4 * (q % 2))) & 0xF,
            tl.load(d + row * (G // 16) + gk // 16))


@triton.jit
def _row_pairs(wr, base: tl.constexpr, MODE: tl.constexpr):
    """16 f16x2 A pairs (weight / d) of one row: pair 4w + j = pair j of word w."""
    qa, qb = tl.split(wr[base])
    s = (1 + 2 * wr[base + 1]).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    s2 = s | (s << 16)
    words = (qa.to(tl.int32), (qa >> 32).to(tl.int32), qb.to(tl.int32), (qb >> 32).to(tl.int32))
    w = sub_block_pairs(words, MODE)
    p = ()
    for i in tl.static_range(16):
        p = p + (hmul2(w[i], s2, MODE),)
    return p


@triton.jit
def _row_factor(wr, base: tl.constexpr):
    return wr[base + 2].to(tl.float32)


@triton.jit
def iq3_s4_mma_gemv_kernel(x_ptr, codes, sc, d, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split,
                           stride_xt, stride_ot, stride_rt, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_G: tl.constexpr, USE_SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
                           DOT_KIND: tl.constexpr, EPI: tl.constexpr, EVEN_G: tl.constexpr,
                           FOLD: tl.constexpr, STAGES: tl.constexpr, H2_MODE: tl.constexpr, NW: tl.constexpr,
                           XPRE: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_wait(PDL)    # ninfer_kernels.pdl: before any load or store; finish_at triggers after the K loop
    # USE_DOT / DOT_KIND / FOLD / EVEN_G are accepted for the shared launcher and unused here
    mma_body(x_ptr, (codes, sc, d), None, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale * _UNSCALE, T, N, G, split,
             stride_xt, stride_ot, stride_rt, T_TILE, BLOCK_N, BLOCK_G, USE_SPLIT, EPI, STAGES, H2_MODE, NW, XPRE,
             _load_row, no_prep, 3, _row_pairs, _row_factor, True, PDL=PDL)


# gemv_iq3_s4 registers it (lazily)
mma_kernel = factory(iq3_s4_mma_gemv_kernel, "iq3_s4_gemv_kernel", per_thread=True)


def kernel_for(fmt: str = "iq3_s4_mma", dequant: bool = False, cc: int = 90):
    """(kernel, signature of its weight arguments, extra constexprs) for compile checks."""
    if dequant:
        raise ValueError("iq3_s4_mma has no dequantizer of its own (gemv_iq3_s4's serves both)")
    return iq3_s4_mma_gemv_kernel, {"codes": "*i64", "sc": "*u8", "d": "*fp16"}, {**compile_consts(cc), "NW": 4}
