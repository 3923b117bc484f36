"""GGML IQ3_S fused dequant-GEMV / skinny GEMM: y[T, N] = x[T, K] @ W[N, K]^T (+ residual).

Load-time repack (`repack_iq3_s`, same 110 bytes per 256 weights): the 2-byte-aligned GGML blocks are split
into planar arrays, each row-major over the row's weights, indexed by 16-weight group g:
  qs    int32 [N, K/16]  low 8 bits of the grid index of the four 4-weight groups of g (one byte each)
  signs int16 [N, K/16]  sign bits of g's four 4-weight groups k, permuted: weights 4k, 4k+1, 4k+2, 4k+3 at
                         bits 7-k, 3-k, 15-k, 11-k (`SIGN_BITS`; the order `gemv_iq3_s_h2` reads)
  qh    u8    [N, K/32]  bit 8 of the grid indices, bit k = group k of the 32-weight sub-block
  sc    u8    [N, K/64]  4-bit sub-block scales, even sub-block in the low nibble
  d     fp16  [N, K/256] super-block scales
Lookup table "grid" (built once per device from `ninfer_formats.codecs.iq3_s_tables.grid_values`), int32:
* words 0..8191 (this kernel): entry idx + 512 * s (idx the 9-bit grid index, s the 4-weight group's sign
  bits in the order (1, 0, 3, 2) of its coordinates: what `_sign_nibble` gathers from the permuted word) is
  the grid point with the signs applied, one byte per coordinate stored as 128 + signed coordinate -- 32 KB,
  L1-resident. One gather per 4 weights then replaces the grid lookup and the sign handling, and a weight is
  one byte extract: byte | 0x4B000000 is the float 2**23 + 128 + signed coordinate, one FADD from the value
  (no int->float conversion). w = d * (1 + 2 * s4) * coordinate * sign.
* words 8192..8703 (`gemv_iq3_s_h2`): entry idx holds the four unsigned coordinates in the f16x2 bit fields
  that variant decodes (its docstring).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv_common import dequant_body, even_groups, gemv_body, ld, ld_pair, pairwise
from .gemv_launch import KernelInputError, check_weight, check_x, dequant, gemv, register_h2, register_variant
from .pdl import pdl_wait

GS = 16
QK = 256
BLOCK_BYTES = 110
_GS = tl.constexpr(GS)
_ONE = tl.constexpr(1.0)
_MAGIC = tl.constexpr(0x4B000000)          # float bits of 2**23
_OFFSET = tl.constexpr(8388608.0 + 128.0)
SIGNED_WORDS = 512 * 16                    # the signed table of this kernel
H2_WORDS = 512                             # the unsigned table of gemv_iq3_s_h2, after it
TABLE_SIZE = SIGNED_WORDS + H2_WORDS
SIGN_BITS = tuple((7 - k, 3 - k, 15 - k, 11 - k) for k in range(4))   # [k][j]: bit of weight 4k + j
_NIBBLE_ORDER = (1, 0, 3, 2)               # signed-table sign bit b is coordinate _NIBBLE_ORDER[b]'s sign
_TABLE: dict = {}


def grid_table(device) -> torch.Tensor:
    """int32 [TABLE_SIZE] on `device` (cached): the signed table, then the h2 variant's (module docstring)."""
    key = str(device)
    if key not in _TABLE:
        import numpy as np
        from ninfer_formats.codecs.iq3_s_tables import grid_values
        from .gemv_iq3_s_h2 import h2_grid_words
        g = grid_values().astype(np.int64)                                   # [512, 4] coordinates 1..15
        bit = np.argsort(_NIBBLE_ORDER)                                      # coordinate j's sign bit
        s = (np.arange(16)[:, None] >> bit) & 1                              # [16, 4] sign of coordinate j
        v = 128 + np.where(s[:, None, :] == 1, -g[None], g[None])            # [16, 512, 4] in 113..143
        words = (v << (8 * np.arange(4))).sum(axis=-1).reshape(SIGNED_WORDS)
        words = np.concatenate([words, h2_grid_words(g)]).astype(np.uint32).view(np.int32)
        _TABLE[key] = torch.from_numpy(words).to(device)
    return _TABLE[key]


def permute_signs(signs: torch.Tensor) -> torch.Tensor:
    """int16 sign words (bit i = weight 16g + i, GGML order) -> the repacked order `SIGN_BITS`."""
    s = signs.to(torch.int32) & 0xFFFF
    out = torch.zeros_like(s)
    for k in range(4):
        for j in range(4):
            out |= ((s >> (4 * k + j)) & 1) << SIGN_BITS[k][j]
    return torch.where(out >= 32768, out - 65536, out).to(torch.int16)


@triton.jit
def _sign_nibble(sg, k: tl.constexpr):
    """The signed table's 4 sign bits of 4-weight group k: the permuted word's bits 3-k, 7-k, 11-k, 15-k
    (coordinates 1, 0, 3, 2) moved together by one multiply (the four products land on distinct bits)."""
    return ((((sg >> (3 - k)) & 0x1111) * 0x1248) >> 12) & 0xF


@triton.jit
def _signed_group(qs, qh4, sg, table, k: tl.constexpr):
    idx = ((qs >> (8 * k)) & 0xFF) | (((qh4 >> k) & 1) << 8) | (_sign_nibble(sg, k) << 9)
    return tl.load(table + idx)


@triton.jit
def _load(qs, signs, qh, sc, d, grid, rows, g, wm, G):
    r = rows[:, None]
    q = ld(qs + r * G + g[None, :], wm)
    sg = ld(signs + r * G + g[None, :], wm).to(tl.int32)
    ge = even_groups(g)
    h = ge // 2                                                 # 32-weight sub-block index
    qh4 = pairwise(ld_pair(qh + r * (G // 2) + h[None, :], ge, wm, G).to(tl.int32)) >> (4 * (g % 2))[None, :]
    s4 = (ld_pair(sc + r * (G // 4) + (h // 2)[None, :], ge, wm, G).to(tl.int32) >> (4 * (h % 2))[None, :]) & 0xF
    s = pairwise(ld_pair(d + r * (G // 16) + (h // 8)[None, :], ge, wm, G).to(tl.float32)
                 * (1 + 2 * s4).to(tl.float32))
    return (_signed_group(q, qh4, sg, grid, 0), _signed_group(q, qh4, sg, grid, 1),
            _signed_group(q, qh4, sg, grid, 2), _signed_group(q, qh4, sg, grid, 3), s)


@triton.jit
def _raw(st, i: tl.constexpr):
    v0, v1, v2, v3, s = st
    if i // 4 == 0:
        v = v0
    elif i // 4 == 1:
        v = v1
    elif i // 4 == 2:
        v = v2
    else:
        v = v3
    return (((v >> (8 * (i % 4))) & 0xFF) | _MAGIC).to(tl.float32, bitcast=True) - _OFFSET


@triton.jit
def _scale(st):
    v0, v1, v2, v3, s = st
    return s


@triton.jit
def iq3_s_gemv_kernel(x_ptr, qs, signs, qh, sc, d, grid, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G,
                      split, stride_xt, stride_ot, stride_rt, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_G: tl.constexpr, USE_SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
                      DOT_KIND: tl.constexpr, EPI: tl.constexpr, EVEN_G: tl.constexpr,
                      FOLD: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_wait(PDL)    # ninfer_kernels.pdl: before any load or store; finish_at triggers after the K loop
    gemv_body(x_ptr, qs, signs, qh, sc, d, grid, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale,
              T, N, G, split, stride_xt, stride_ot, stride_rt, _load, _raw, _scale, _GS, _ONE, _ONE,
              T_TILE, BLOCK_N, BLOCK_G, USE_SPLIT, USE_DOT, DOT_KIND, EPI, EVEN_G, FOLD, STAGES, PDL=PDL)


@triton.jit
def iq3_s_dequant_kernel(qs, signs, qh, sc, d, grid, out_ptr, fscale, N, G, BLOCK_N: tl.constexpr,
                         BLOCK_G: tl.constexpr):
    dequant_body(qs, signs, qh, sc, d, grid, out_ptr, fscale, N, G, _load, _raw, _scale, _GS, _ONE, _ONE,
                 BLOCK_N, BLOCK_G)


def _h2_kernel(device):
    from .gemv_iq3_s_h2 import h2_kernel     # imported on first use: it imports this module's table layout
    return h2_kernel(device)


# the h2 variant's tiles (block_n, block_g, num_warps, num_stages; per-thread kernel: a thread holds one 32-weight
# sub-block column of R = block_n * block_g / (64 * num_warps) rows), trimmed to what won on the H200 (bench/NOTES.md
# §8: R = 2..4; R = 8, block_g 8 and a register double buffer lost 5-30 %; §9: an L2 prefetch never won).
# T >= 8: its activation work per weight (converted per thread, shared by its rows only) exceeds the fp32
# kernel's (sm_90: 15 per weight)
H2_TILES = {1: ((64, 16, 4, 1), (32, 16, 2, 1), (32, 16, 4, 1)), 2: ((64, 16, 4, 1), (128, 16, 4, 1)),
            4: ((64, 16, 4, 1),), 8: (), 16: ()}
register_h2(iq3_s_gemv_kernel.__name__, _h2_kernel, H2_TILES)   # T <= 8 candidates include the h2 variant


def _mma_kernel(device):
    from .gemv_iq3_s_mma import mma_kernel
    return mma_kernel(device)


# the warp-MMA variant's tiles (as `gemv_tiles._DECODE_MMA_TILES`), T = 1 too: against the h2 variant, whose
# gathers and 16 HFMA2 per sub-block cap it at 22-40 % of copy bandwidth (bench/NOTES.md §8). Its rows hold 11
# values per chunk after the gather, so 64-row tiles join (sm_90, T tile 8: n128 147 registers, 214 double-buffered;
# n64 80 / 127)
_MMA_T1_8 = ((64, 8, 4, 2), (64, 8, 4, 1), (128, 8, 4, 1), (128, 8, 4, 2))
MMA_TILES = {1: _MMA_T1_8[:3], 2: _MMA_T1_8, 4: _MMA_T1_8, 8: _MMA_T1_8, 16: ((128, 8, 4, 1), (64, 8, 4, 1))}
register_variant("mma", iq3_s_gemv_kernel.__name__, _mma_kernel, MMA_TILES)   # sm_80+, T <= 16


def _repack_rows(b: torch.Tensor) -> tuple:
    n, nb = b.shape[0], b.shape[1] // BLOCK_BYTES
    b = b.reshape(n, nb, BLOCK_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).reshape(n, nb)
    qs = b[..., 2:66].reshape(n, nb * 64).contiguous().view(torch.int32)
    qh = b[..., 66:74].reshape(n, nb * 8).contiguous()
    signs = permute_signs(b[..., 74:106].reshape(n, nb * 32).contiguous().view(torch.int16))
    sc = b[..., 106:110].reshape(n, nb * 4).contiguous()
    return qs, signs, qh, sc, d


def repack_iq3_s(blocks: torch.Tensor, K: int, *, chunk_rows: int = 8192) -> dict:
    """GGML IQ3_S rows u8 [N, K/256*110] -> {"qs", "signs", "qh", "sc", "d", "grid"} (module docstring;
    "grid" is the shared lookup table)."""
    if K % QK or not isinstance(blocks, torch.Tensor) or blocks.dim() != 2 or blocks.dtype != torch.uint8 \
            or blocks.shape[1] != K // QK * BLOCK_BYTES:
        got = (tuple(blocks.shape), blocks.dtype) if isinstance(blocks, torch.Tensor) else type(blocks).__name__
        raise KernelInputError(f"repack_iq3_s: blocks must be u8 [N, {K // QK * BLOCK_BYTES}] for K={K} "
                               f"(K a multiple of {QK}), got {got}")
    parts = [_repack_rows(blocks[r:r + chunk_rows]) for r in range(0, blocks.shape[0], chunk_rows)]
    qs, signs, qh, sc, d = (torch.cat(p) for p in zip(*parts))
    return {"qs": qs, "signs": signs, "qh": qh, "sc": sc, "d": d, "grid": grid_table(blocks.device)}


def unpermute_signs(words: torch.Tensor) -> torch.Tensor:
    """The inverse of `permute_signs`."""
    s = words.to(torch.int32) & 0xFFFF
    out = torch.zeros_like(s)
    for k in range(4):
        for j in range(4):
            out |= ((s >> SIGN_BITS[k][j]) & 1) << (4 * k + j)
    return torch.where(out >= 32768, out - 65536, out).to(torch.int16)


def unpack_iq3_s(packed: dict, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of `repack_iq3_s`: GGML blocks u8 [N, K/256*110] (or only `rows`, int64) on the planes' device."""
    qs, signs, qh, sc, d = (packed[k] if rows is None else packed[k].index_select(0, rows)
                            for k in ("qs", "signs", "qh", "sc", "d"))
    n, nb = d.shape
    parts = (d.contiguous().view(torch.uint8), qs.contiguous().view(torch.uint8), qh,
             unpermute_signs(signs).view(torch.uint8), sc)
    return torch.cat([p.reshape(n, nb, -1) for p in parts], dim=-1).reshape(n, nb * BLOCK_BYTES)


def _weights(packed: dict, K: int, device, what: str):
    if K % QK:
        raise KernelInputError(f"{what}: K={K} is not a multiple of {QK}")
    qs = packed.get("qs")
    n = qs.shape[0] if isinstance(qs, torch.Tensor) and qs.dim() == 2 else -1
    g = K // GS
    return n, (check_weight(qs, "qs", (n, g), (torch.int32,), what, device),
               check_weight(packed.get("signs"), "signs", (n, g), (torch.int16,), what, device),
               check_weight(packed.get("qh"), "qh", (n, K // 32), (torch.uint8,), what, device),
               check_weight(packed.get("sc"), "sc", (n, K // 64), (torch.uint8,), what, device),
               check_weight(packed.get("d"), "d", (n, K // QK), (torch.float16,), what, device),
               check_weight(packed.get("grid"), "grid", (TABLE_SIZE,), (torch.int32,), what, device))


def gemv_iq3_s(x, packed: dict, out=None, residual=None, *, config=None, plans=None):
    """x [T, K] fp16/bf16/fp32, packed = repack_iq3_s(blocks, K) -> [T, N] in x.dtype."""
    x = check_x(x, None, "gemv_iq3_s")
    K = x.shape[1]
    n, w = _weights(packed, K, x.device, "gemv_iq3_s")
    return gemv(iq3_s_gemv_kernel, w, x, n, K // GS, GS, 1.0, out, residual, config, "gemv_iq3_s", plans=plans)


def check_h2_tile(cfg) -> None:
    """The per-thread h2 kernel holds one 32-weight sub-block column per thread: block_g in 2..16 and a whole,
    power-of-two number of rows per thread (block_n * block_g / (64 * num_warps))."""
    rows, rem = divmod(cfg.block_n * cfg.block_g, 64 * cfg.num_warps)
    if not 2 <= cfg.block_g <= 16 or rem or rows < 1 or rows & (rows - 1):
        raise KernelInputError(f"IQ3_S GEMV: the h2 variant needs block_g in 2..16 and block_n * block_g a "
                               f"power-of-two multiple of 64 * num_warps, got block_n={cfg.block_n}, "
                               f"block_g={cfg.block_g}, num_warps={cfg.num_warps}")


def dequant_iq3_s(packed: dict, K: int, dtype=torch.float16):
    """Dense [N, K] `dtype` weights from repacked IQ3_S arrays."""
    dev = packed["qs"].device
    n, w = _weights(packed, K, dev, "dequant_iq3_s")
    return dequant(iq3_s_dequant_kernel, w, n, K // GS, GS, 1.0, dtype, dev)


def kernel_for(fmt: str = "iq3_s", dequant: bool = False):
    """(kernel, signature of its weight arguments, extra constexprs) for compile checks."""
    sig = {"qs": "*i32", "signs": "*i16", "qh": "*u8", "sc": "*u8", "d": "*fp16", "grid": "*i32"}
    return (iq3_s_dequant_kernel if dequant else iq3_s_gemv_kernel), sig, {}
