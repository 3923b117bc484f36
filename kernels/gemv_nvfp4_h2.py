"""NVFP4 dequant-GEMV with packed half2 arithmetic (T <= 8): the decode-path variant of `gemv_nvfp4`.

Why: the fp32 variant spends ~3 integer ops + 1 FFMA per weight (0.29 warp-instructions per packed byte, an
H200 issues ~0.25 per byte at full bandwidth). Here two weights share most instructions (0.17 per byte; on
the H200 T=1 went from 39-63 % to 38-79 % of copy bandwidth, bench/NOTES.md §4):

* weights -> f16x2 without a table: the 16-bit lanes of a code word hold nibbles j and j+4 at the same
  offset; after one rotate and two bit-selects per word move every sign 3 bits up, one shift + mask per pair
  puts the E2M1 magnitude bits at f16 bits 11..9 and the sign at bit 15 (~11 ops per 8 weights). As an IEEE
  half that is e2m1 * 2**-14 exactly (E2M1's e = 0 codes are f16 subnormals, which the f16 units keep);
* activations -> f16x2: x' = x * 2**k per (CTA, T column), k from the largest |x| of the CTA's K slice
  (one cooperative pass before the weights) so that |x'| < 2**14: no overflow for any input, ~11
  significant bits; activations below 2**-28 of that row's slice maximum become f16 subnormals (their
  products, < 2**-14 of the largest, lose relative precision, not the sum);
* 8 HFMA2 per 16-weight block accumulate in f16 (|block sum| < 96 by construction), then one conversion
  to fp32 and one FFMA with the E4M3 block scale; blocks accumulate in fp32; 2**-k at the end.
Precision: a block sum carries ~1e-3 relative rounding (f16), below bf16's own 4e-3 output rounding.

The f16x2 FMA, the f32 -> f16x2 pack, the sign split (`shf.l.wrap` + `lop3`) and the f16 lane sum are inline
PTX (all sm_53+, so the V100 path too, except `cvt.rn.f16x2.f32`: sm_80+, two `cvt.rn.f16.f32` below).
The interpreter cannot run PTX: H2_MODE = EMULATE
computes the same f16 roundings with Triton ops (fp32 FMA, then round to f16: identical except for
double-rounding ties), so the decode logic is tested on CPU.
Same launch signature and split-K epilogue as the other GEMV kernels (`gemv_common`); weights as in
`gemv_nvfp4` (codes int64 [N, K/16], E4M3 scales u8 [N, K/16]).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv_common import _finish, _tile_g, _tset, _zeros, e4m3_magnitude, ld

EMULATE, PTX_SM70, PTX_SM80 = 1, 2, 3      # H2_MODE values
MAX_T_TILE = 8                             # f16x2 accumulators and x pairs per column: beyond 8 tl.dot wins
_EMULATE, _PTX_SM80, _MAX_T = tl.constexpr(EMULATE), tl.constexpr(PTX_SM80), tl.constexpr(MAX_T_TILE)
_PAIR = tl.constexpr(0x8E008E00)           # f16 bits 15 and 11..9 of both lanes
_LANE = tl.constexpr(0xFFFF)


@triton.jit
def _split_signs(q, H2_MODE: tl.constexpr):
    """(even, odd) int32 words for `_wpair`: the magnitude bits of the even (odd) nibbles in place and each
    nibble's sign 3 bits above its own position (from q rotated left by 3, which keeps nibble 7's sign).
    On the GPU one funnel shift and two 3-input bit-selects (ptxas otherwise splits each select in two)."""
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
def _lane_f32(bits):
    """The f16 in the low 16 bits of int32 `bits`, as fp32."""
    return (bits & _LANE).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_bits(v):
    return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & _LANE


@triton.jit
def _hfma2(a, b, c, H2_MODE: tl.constexpr):
    """Lane-wise a * b + c on f16x2 bit patterns (int32)."""
    if H2_MODE == _EMULATE:
        lo = _lane_f32(a) * _lane_f32(b) + _lane_f32(c)
        hi = _lane_f32(a >> 16) * _lane_f32(b >> 16) + _lane_f32(c >> 16)
        return _f16_bits(lo) | (_f16_bits(hi) << 16)
    else:
        return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _pack2(lo, hi, H2_MODE: tl.constexpr):
    """f16x2 bits (lo in the low lane) of two fp32 tensors, rounded to nearest even."""
    if H2_MODE == _EMULATE:
        return _f16_bits(lo) | (_f16_bits(hi) << 16)
    elif H2_MODE == _PTX_SM80:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .f16 l, h; cvt.rn.f16.f32 l, $1; cvt.rn.f16.f32 h, $2; mov.b32 $0, {l, h}; }",
            "=r,f,f", [lo, hi], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _lanes_f32(acc, H2_MODE: tl.constexpr):
    """The sum of both f16 lanes of int32 `acc` (added in f16: one more 2**-11 rounding), as fp32."""
    if H2_MODE == _EMULATE:
        return (_lane_f32(acc) + _lane_f32(acc >> 16)).to(tl.float16).to(tl.float32)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .f16 l, h, s; mov.b32 {l, h}, $1; add.rn.f16 s, l, h; cvt.f32.f16 $0, s; }",
            "=f,r", [acc], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _row_scale(x_ptr, row, k_lo, k_hi, BLOCK: tl.constexpr):
    """(up, back) for one activation row over this CTA's K range: up = 2**(140-E) for amax in
    [2**(E-127), 2**(E-126)) makes |x * up| < 2**14, back = 2**14 / up undoes it (E clamped so both stay
    finite). One cooperative pass over the slice (every thread a strided share), before the weights."""
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + row + k, mask=k < k_hi, other=0.0).to(tl.float32)))
    e = tl.minimum(tl.maximum((tl.max(amax, axis=0).to(tl.int32, bitcast=True) >> 23) & 0xFF, 13), 253)
    return ((267 - e) << 23).to(tl.float32, bitcast=True), ((e + 1) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _x_pairs(x_ptr, row, g, xm, up, H2_MODE: tl.constexpr):
    """x[g*16 + i] * up of one activation row as 8 f16x2 vectors [BG] in the weight-pair order
    ((0,4), (1,5), (2,6), (3,7), (8,12), ...)."""
    base = x_ptr + row + g * 16
    v = ()
    for i in tl.static_range(16):
        v = v + (ld(base + i, xm).to(tl.float32) * up,)
    p = ()
    for h in tl.static_range(2):
        for j in tl.static_range(4):
            p = p + (_pack2(v[8 * h + j], v[8 * h + j + 4], H2_MODE),)
    return p


@triton.jit
def _h2_tile(accs, ups, lo, hi, sc, g, xm, t0, T, x_ptr, stride_xt, T_TILE: tl.constexpr, H2_MODE: tl.constexpr):
    le, lo_odd = _split_signs(lo, H2_MODE)
    he, hi_odd = _split_signs(hi, H2_MODE)
    for tt in tl.static_range(T_TILE):
        p = _x_pairs(x_ptr, tl.minimum(t0 + tt, T - 1) * stride_xt, g, xm, ups[tt], H2_MODE)
        acc = _hfma2(_wpair(le, lo_odd, 0), p[0][None, :], tl.zeros_like(lo), H2_MODE)
        for j in tl.static_range(1, 4):
            acc = _hfma2(_wpair(le, lo_odd, j), p[j][None, :], acc, H2_MODE)
        for j in tl.static_range(4):
            acc = _hfma2(_wpair(he, hi_odd, j), p[4 + j][None, :], acc, H2_MODE)
        accs = _tset(accs, tt, accs[tt] + _lanes_f32(acc, H2_MODE) * sc)
    return accs


@triton.jit
def _h2_load(codes, scales, rows, g0, g_hi, G, BLOCK_G: tl.constexpr, EVEN_G: tl.constexpr):
    """Code words (int64) and scale bytes (int32) of the tile at g0; masked groups read code 0 (weight 0)."""
    g = _tile_g(g0, BLOCK_G, 2)
    off = rows[:, None] * G + g[None, :]
    if EVEN_G:
        return tl.load(codes + off), tl.load(scales + off).to(tl.int32)
    else:
        wm = (g < g_hi)[None, :]
        return tl.load(codes + off, mask=wm, other=0), tl.load(scales + off, mask=wm, other=0).to(tl.int32)


@triton.jit
def _h2_step(accs, ups, words, sb, g0, g_hi, t0, T, x_ptr, stride_xt, T_TILE: tl.constexpr, BLOCK_G: tl.constexpr,
             EVEN_G: tl.constexpr, H2_MODE: tl.constexpr):
    g = _tile_g(g0, BLOCK_G, 2)
    lo, hi, sc = words.to(tl.int32), (words >> 32).to(tl.int32), e4m3_magnitude(sb)
    if EVEN_G:
        return _h2_tile(accs, ups, lo, hi, sc, g, None, t0, T, x_ptr, stride_xt, T_TILE, H2_MODE)
    else:
        return _h2_tile(accs, ups, lo, hi, sc, g, g < g_hi, t0, T, x_ptr, stride_xt, T_TILE, H2_MODE)


@triton.jit
def nvfp4_h2_gemv_kernel(x_ptr, codes, scales, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split,
                         stride_xt, stride_ot, stride_rt, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_G: tl.constexpr, USE_SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
                         DOT_KIND: tl.constexpr, HAS_RES: tl.constexpr, EVEN_G: tl.constexpr,
                         FOLD: tl.constexpr, PREFETCH: tl.constexpr, H2_MODE: tl.constexpr):
    # USE_DOT / DOT_KIND / FOLD are accepted for the shared launcher and unused here
    tl.static_assert(T_TILE <= _MAX_T)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)      # tail rows re-read the last row and are never stored
    t0 = tl.program_id(2) * T_TILE
    g_per = tl.cdiv(tl.cdiv(G, split), BLOCK_G) * BLOCK_G
    g_lo = tl.program_id(1) * g_per
    g_hi = tl.minimum(G, g_lo + g_per)
    ups, backs = (), ()
    for tt in tl.static_range(T_TILE):
        up, back = _row_scale(x_ptr, tl.minimum(t0 + tt, T - 1) * stride_xt, g_lo * 16, g_hi * 16, 512)
        ups, backs = ups + (up,), backs + (back,)
    accs = _zeros(T_TILE, BLOCK_N, BLOCK_G)
    if PREFETCH:   # the next tile's words are in flight while this one is decoded (see gemv_common._fma_loop)
        last = g_lo + ((g_hi - g_lo - 1) // BLOCK_G) * BLOCK_G
        words, sb = _h2_load(codes, scales, rows, g_lo, g_hi, G, BLOCK_G, EVEN_G)
        for g0 in range(g_lo, g_hi, BLOCK_G):
            words_n, sb_n = _h2_load(codes, scales, rows, tl.minimum(g0 + BLOCK_G, last), g_hi, G, BLOCK_G, EVEN_G)
            tl.debug_barrier()
            accs = _h2_step(accs, ups, words, sb, g0, g_hi, t0, T, x_ptr, stride_xt, T_TILE, BLOCK_G, EVEN_G, H2_MODE)
            words, sb = words_n, sb_n
    else:
        for g0 in range(g_lo, g_hi, BLOCK_G):
            words, sb = _h2_load(codes, scales, rows, g0, g_hi, G, BLOCK_G, EVEN_G)
            accs = _h2_step(accs, ups, words, sb, g0, g_hi, t0, T, x_ptr, stride_xt, T_TILE, BLOCK_G, EVEN_G, H2_MODE)
    cols = tl.arange(0, T_TILE)
    acc = tl.zeros([BLOCK_N, T_TILE], tl.float32)
    for tt in tl.static_range(T_TILE):
        acc = tl.where(cols[None, :] == tt, tl.sum(accs[tt], axis=1)[:, None] * backs[tt], acc)
    _finish(acc * fscale, t0 + cols, offs_n, N, T, split, out_ptr, stride_ot, res_ptr, stride_rt, ws_ptr,
            cnt_ptr, HAS_RES, USE_SPLIT)


def h2_mode(device: torch.device) -> int:
    """The H2_MODE for launches on `device` (EMULATE in the interpreter and off CUDA)."""
    import os
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or device.type != "cuda":
        return EMULATE
    return PTX_SM80 if torch.cuda.get_device_capability(device) >= (8, 0) else PTX_SM70


class H2Kernel:
    """Binds H2_MODE per device so the generic launcher (`gemv_launch`) treats this like the other kernels.
    Its __name__ is the fp32 kernel's: both variants compete for the same tuner key."""

    __name__ = "nvfp4_gemv_kernel"

    def __init__(self, mode: int):
        self.mode, self.jit, self.extra_consts = mode, nvfp4_h2_gemv_kernel, {"H2_MODE": mode}

    def __getitem__(self, grid):
        return lambda *a, **kw: nvfp4_h2_gemv_kernel[grid](*a, H2_MODE=self.mode, **kw)

    def warmup(self, *a, grid, **kw):
        return nvfp4_h2_gemv_kernel.warmup(*a, grid=grid, H2_MODE=self.mode, **kw)


_BY_MODE: dict = {}


def h2_kernel(device: torch.device) -> H2Kernel:
    mode = h2_mode(device)
    if mode not in _BY_MODE:
        _BY_MODE[mode] = H2Kernel(mode)
    return _BY_MODE[mode]


def kernel_for(fmt: str = "nvfp4_h2", dequant: bool = False, cc: int = 90):
    """(kernel, signature of its weight arguments, extra constexprs) for compile checks."""
    if dequant:
        raise ValueError("nvfp4_h2 has no dequantizer of its own (gemv_nvfp4's serves both)")
    return nvfp4_h2_gemv_kernel, {"codes": "*i64", "scales": "*u8"}, \
        {"H2_MODE": PTX_SM80 if cc >= 80 else PTX_SM70}
