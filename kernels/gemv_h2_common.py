"""The packed-half2 (f16x2) GEMV skeleton shared by the formats' h2 variants (`gemv_nvfp4_h2`, `gemv_q6_k_h2`).

A format supplies
  LOAD(w0..w5, rows, g, wm, G) -> state    its fp32 kernel's tile load (`gemv_common` convention)
  TILE(accs, ups, state, g, xm, t0, T, x_ptr, stride_xt, T_TILE, H2_MODE, XPRE, G) -> accs
      per T column: f16x2 weight pairs (j, j+4) of every 16-weight group times `x_pairs` with HFMA2, the
      f16 block sum to fp32 (`lanes_f32`) times the group's scale, added to accs[tt] [BN, BG] fp32
and UP_BIAS / BACK_BIAS for `row_scale`: activations are scaled by a power of two per (CTA, T column) so
that the f16 block sums cannot overflow, and the fp32 result is multiplied back at the end.
XPRE: x_ptr holds prepared activations (`ninfer_kernels.x16`: f16 pairs already scaled per 128-chunk, |x'| <
2**14, and each chunk's back factor): the tile loads its pairs (`x16_pairs`) and folds the chunk's back into the
block scale (`x16_back`). A format's f16 weights must then keep a 16-weight block sum of |x'| < 2**14 products in f16
range (NVFP4's carry 2**-14; Q6_K's are scaled by 2**-8 on prepared input), and XPRE_BACK is the power of two that
undoes that scaling at the end.

The f16x2 FMA, the f32 -> f16x2 pack and the f16 lane sum are inline PTX (sm_53+, so the V100 path too;
`cvt.rn.f16x2.f32` is sm_80+, two `cvt.rn.f16.f32` below). The interpreter cannot run PTX: H2_MODE = EMULATE
computes the same f16 roundings with Triton ops (fp32 FMA, then round to f16: identical except for
double-rounding ties), so every format's decode logic is tested on CPU.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .gemv_common import _finish, _load_tile, _tile_g, _zeros, ld
from .pdl import pdl_wait

EMULATE, PTX_SM70, PTX_SM80 = 1, 2, 3      # H2_MODE values
MAX_T_TILE = 8                             # f16x2 accumulators and x pairs per column: beyond 8 tl.dot wins
_EMULATE, _PTX_SM80, _MAX_T = tl.constexpr(EMULATE), tl.constexpr(PTX_SM80), tl.constexpr(MAX_T_TILE)
_LANE = tl.constexpr(0xFFFF)


@triton.jit
def lane_f32(bits):
    """The f16 in the low 16 bits of int32 `bits`, as fp32."""
    return (bits & _LANE).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def f16_bits(v):
    return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & _LANE


@triton.jit
def hfma2(a, b, c, H2_MODE: tl.constexpr):
    """Lane-wise a * b + c on f16x2 bit patterns (int32)."""
    if H2_MODE == _EMULATE:
        lo = lane_f32(a) * lane_f32(b) + lane_f32(c)
        hi = lane_f32(a >> 16) * lane_f32(b >> 16) + lane_f32(c >> 16)
        return f16_bits(lo) | (f16_bits(hi) << 16)
    else:
        return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def hmul2(a, b, H2_MODE: tl.constexpr):
    """Lane-wise a * b on f16x2 bit patterns (int32)."""
    if H2_MODE == _EMULATE:
        return f16_bits(lane_f32(a) * lane_f32(b)) | (f16_bits(lane_f32(a >> 16) * lane_f32(b >> 16)) << 16)
    else:
        return tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def pack2(lo, hi, H2_MODE: tl.constexpr):
    """f16x2 bits (lo in the low lane) of two fp32 tensors, rounded to nearest even."""
    if H2_MODE == _EMULATE:
        return f16_bits(lo) | (f16_bits(hi) << 16)
    elif H2_MODE == _PTX_SM80:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .f16 l, h; cvt.rn.f16.f32 l, $1; cvt.rn.f16.f32 h, $2; mov.b32 $0, {l, h}; }",
            "=r,f,f", [lo, hi], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def lanes_f32(acc, H2_MODE: tl.constexpr):
    """The sum of both f16 lanes of int32 `acc` (added in f16: one more 2**-11 rounding), as fp32."""
    if H2_MODE == _EMULATE:
        return (lane_f32(acc) + lane_f32(acc >> 16)).to(tl.float16).to(tl.float32)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .f16 l, h, s; mov.b32 {l, h}, $1; add.rn.f16 s, l, h; cvt.f32.f16 $0, s; }",
            "=f,r", [acc], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def row_scale(x_ptr, row, k_lo, k_hi, BLOCK: tl.constexpr, UP_BIAS: tl.constexpr, BACK_BIAS: tl.constexpr):
    """(up, back) for one activation row over this CTA's K range, from E, the fp32 exponent field of the
    slice's largest |x| (clamped to [13, 253] so both factors stay finite normals):
    up = 2**(UP_BIAS - 127 - E), back = 2**(E + BACK_BIAS - 127). One cooperative pass (every thread a
    strided share of the slice), before the weights."""
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + row + k, mask=k < k_hi, other=0.0).to(tl.float32)))
    e = tl.minimum(tl.maximum((tl.max(amax, axis=0).to(tl.int32, bitcast=True) >> 23) & 0xFF, 13), 253)
    return ((-e + UP_BIAS) << 23).to(tl.float32, bitcast=True), ((e + BACK_BIAS) << 23).to(tl.float32, bitcast=True)


@triton.jit
def x_pairs(x_ptr, row, g, xm, up, H2_MODE: tl.constexpr):
    """x[g*16 + i] * up of one activation row as 8 f16x2 vectors [BG] in the weight-pair order
    ((0,4), (1,5), (2,6), (3,7), (8,12), ...)."""
    base = x_ptr + row + g * 16
    v = ()
    for i in tl.static_range(16):
        v = v + (ld(base + i, xm).to(tl.float32) * up,)
    p = ()
    for h in tl.static_range(2):
        for j in tl.static_range(4):
            p = p + (pack2(v[8 * h + j], v[8 * h + j + 4], H2_MODE),)
    return p


@triton.jit
def x16_pairs(x_ptr, row, g, xm):
    """`x_pairs` from a prepared activation row (int32 words, `ninfer_kernels.x16`): its 8 words of group g."""
    base = x_ptr + row + g * 8
    p = ()
    for i in tl.static_range(8):
        p = p + (ld(base + i, xm),)
    return p


@triton.jit
def x16_back(x_ptr, row, g, xm, G):
    """fp32 back factor of group g's 128-activation chunk in a prepared row (K = 16 G)."""
    return ld(x_ptr + row + G * 8 + g // 8, xm).to(tl.float32, bitcast=True)


@triton.jit
def column_pairs(x_ptr, row, g, xm, up, scale, G, H2_MODE: tl.constexpr, XPRE: tl.constexpr):
    """(the 8 f16x2 activation pairs of group g of one T column, the block scale times what the pairs need):
    XPRE: the prepared pairs and their chunk's back; else x scaled by this CTA's `up` (`x_pairs`)."""
    if XPRE:
        return x16_pairs(x_ptr, row, g, xm), scale * x16_back(x_ptr, row, g, xm, G)[None, :]
    else:
        return x_pairs(x_ptr, row, g, xm, up, H2_MODE), scale


@triton.jit
def _step(accs, ups, st, g0, g_hi, t0, T, x_ptr, stride_xt, TILE: tl.constexpr, T_TILE: tl.constexpr,
          BLOCK_G: tl.constexpr, EVEN_G: tl.constexpr, H2_MODE: tl.constexpr, XPRE: tl.constexpr, G):
    g = _tile_g(g0, BLOCK_G, 2)
    if EVEN_G:
        return TILE(accs, ups, st, g, None, t0, T, x_ptr, stride_xt, T_TILE, H2_MODE, XPRE, G)
    else:
        return TILE(accs, ups, st, g, g < g_hi, t0, T, x_ptr, stride_xt, T_TILE, H2_MODE, XPRE, G)


@triton.jit
def _row_scales(x_ptr, t0, T, stride_xt, g_lo, g_hi, UP_BIAS: tl.constexpr, BACK_BIAS: tl.constexpr,
                T_TILE: tl.constexpr, XPRE: tl.constexpr, XPRE_BACK: tl.constexpr):
    """(ups, backs): per T column the activation scaling into f16 and its inverse (`row_scale`)."""
    ups, backs = (), ()
    for tt in tl.static_range(T_TILE):
        if XPRE:   # the chunks' backs are in the block scales; what is left is the weights' power of two
            w = tl.full([], (XPRE_BACK + 127) << 23, tl.int32).to(tl.float32, bitcast=True)
            ups, backs = ups + (w,), backs + (w,)
        else:
            up, back = row_scale(x_ptr, tl.minimum(t0 + tt, T - 1) * stride_xt, g_lo * 16, g_hi * 16, 512,
                                 UP_BIAS, BACK_BIAS)
            ups, backs = ups + (up,), backs + (back,)
    return ups, backs


@triton.jit
def _loop(x_ptr, w0, w1, w2, w3, rows, t0, g_lo, g_hi, G, T, stride_xt, LOAD: tl.constexpr, TILE: tl.constexpr,
          UP_BIAS: tl.constexpr, BACK_BIAS: tl.constexpr, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_G: tl.constexpr, EVEN_G: tl.constexpr, STAGES: tl.constexpr, H2_MODE: tl.constexpr,
          XPRE: tl.constexpr, XPRE_BACK: tl.constexpr):
    """acc [BLOCK_N, T_TILE] fp32 in true units (before the per-tensor scale). At T_TILE = 1 (one stage) a
    barrier after each tile's loads keeps them issued together: without it ptxas spreads a tile's 16-byte
    loads over the decode to save registers and the memory latency is exposed several times per tile. On the
    H200 that made T=1 2-12 % faster and T=2 5-25 % slower (more live registers), hence T=1 only
    (bench/NOTES.md §5; the fp32 loop of gemv_common, used at T=1 only by IQ3_S, was not measured pinned).
    STAGES: 1 load then decode; > 1 Triton's cp.async pipeline that deep (an L2 prefetch of the next tile
    instead was never the tuner's pick on the H200: bench/NOTES.md §9)."""
    ups, backs = _row_scales(x_ptr, t0, T, stride_xt, g_lo, g_hi, UP_BIAS, BACK_BIAS, T_TILE, XPRE, XPRE_BACK)
    accs = _zeros(T_TILE, BLOCK_N, BLOCK_G)
    for g0 in tl.range(g_lo, g_hi, BLOCK_G, num_stages=STAGES):   # as gemv_common._fma_loop
        st = _load_tile(w0, w1, w2, w3, None, None, rows, _tile_g(g0, BLOCK_G, 2), g_hi, G, LOAD, EVEN_G)
        if STAGES == 1 and T_TILE == 1:
            tl.debug_barrier()
        accs = _step(accs, ups, st, g0, g_hi, t0, T, x_ptr, stride_xt, TILE, T_TILE, BLOCK_G, EVEN_G, H2_MODE,
                     XPRE, G)
    cols = tl.arange(0, T_TILE)
    acc = tl.zeros([BLOCK_N, T_TILE], tl.float32)
    for tt in tl.static_range(T_TILE):
        acc = tl.where(cols[None, :] == tt, tl.sum(accs[tt], axis=1)[:, None] * backs[tt], acc)
    return acc


@triton.jit
def h2_body(x_ptr, w0, w1, w2, w3, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split, stride_xt,
            stride_ot, stride_rt, LOAD: tl.constexpr, TILE: tl.constexpr, UP_BIAS: tl.constexpr,
            BACK_BIAS: tl.constexpr, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
            USE_SPLIT: tl.constexpr, EPI: tl.constexpr, EVEN_G: tl.constexpr, STAGES: tl.constexpr,
            H2_MODE: tl.constexpr, XPRE: tl.constexpr, XPRE_BACK: tl.constexpr, PDL: tl.constexpr):
    """Grid and split-K exactly as `gemv_common.gemv_body` (same launcher, workspace and epilogue); PDL as in
    `ninfer_kernels.pdl`: the wait comes first (loading the first weight tile before it cost the T=1 loop 32
    registers, one CTA per SM, and decode 17 %: bench/NOTES.md §16), `finish_at` triggers."""
    tl.static_assert(T_TILE <= _MAX_T)
    pdl_wait(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)      # tail rows re-read the last row and are never stored
    t0 = tl.program_id(2) * T_TILE
    g_per = tl.cdiv(tl.cdiv(G, split), BLOCK_G) * BLOCK_G
    g_lo = tl.program_id(1) * g_per
    g_hi = tl.minimum(G, g_lo + g_per)
    acc = _loop(x_ptr, w0, w1, w2, w3, rows, t0, g_lo, g_hi, G, T, stride_xt, LOAD, TILE, UP_BIAS, BACK_BIAS,
                T_TILE, BLOCK_N, BLOCK_G, EVEN_G, STAGES, H2_MODE, XPRE, XPRE_BACK)
    _finish(acc * fscale, t0 + tl.arange(0, T_TILE), offs_n, N, T, split, out_ptr, stride_ot, res_ptr, stride_rt,
            ws_ptr, cnt_ptr, EPI, USE_SPLIT, PDL)


def h2_mode(device: torch.device) -> int:
    """The H2_MODE for launches on `device` (EMULATE in the interpreter and off CUDA)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or device.type != "cuda":
        return EMULATE
    return PTX_SM80 if torch.cuda.get_device_capability(device) >= (8, 0) else PTX_SM70


class H2Kernel:
    """Binds H2_MODE so the generic launcher (`gemv_launch`) treats an h2 kernel like the other kernels. Its
    __name__ is the format's own kernel's: both variants compete for the same tuner key. `check(cfg)`, if given,
    raises KernelInputError for a tile the variant cannot run (the launcher calls it before every launch)."""

    def __init__(self, jit, name: str, mode: int, per_thread: bool = False, check=None):
        self.__name__, self.jit, self.mode, self.extra_consts = name, jit, mode, {"H2_MODE": mode}
        self.per_thread = per_thread   # [32 * NW] tensors: the launcher passes NW = num_warps
        self.check = check

    def __getitem__(self, grid):
        return lambda *a, **kw: self.jit[grid](*a, H2_MODE=self.mode, **kw)

    def warmup(self, *a, grid, **kw):
        return self.jit.warmup(*a, grid=grid, H2_MODE=self.mode, **kw)


def factory(jit, name: str, per_thread: bool = False, check=None):
    """`device -> H2Kernel` with one launcher object per H2_MODE (for `gemv_launch.register_h2`)."""
    made: dict = {}

    def make(device: torch.device) -> H2Kernel:
        mode = h2_mode(device)
        if mode not in made:
            made[mode] = H2Kernel(jit, name, mode, per_thread, check)
        return made[mode]
    return make


def compile_consts(cc: int) -> dict:
    """The H2_MODE a compile check for CUDA capability `cc` uses."""
    return {"H2_MODE": PTX_SM80 if cc >= 80 else PTX_SM70}

