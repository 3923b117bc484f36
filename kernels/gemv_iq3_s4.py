"""GGML IQ3_S as 4-bit offset codes: a load-time repack that trades 22 % more bytes for a decode without a table.

Why: every IQ3_S GEMV looks its 9-bit grid indices up in a table (`gemv_iq3_s`: L1; `gemv_iq3_s_h2` and the warp-MMA
variant: shared memory, two barriers per tile). On the H200 that held IQ3_S at 22-40 % of copy bandwidth while the
table-free formats reached 47-76 % (bench/NOTES.md §8, §26). An IQ3_S weight is d * (1 + 2 * s4) * c with c one of
the 16 odd integers -15..15 (a grid coordinate 1..15 with its sign), so it fits a 4-bit code v = (c + 15) / 2 and
c = 2v - 15. The default since s45 (`layout()`; NINFER_IQ3S_LAYOUT=grid keeps the grid planes): on an H100 the
27B iq3_s decode went from 107 to 138 tok/s with it (bench/NOTES.md §46). The artifact's bytes and FORMAT.md are
unchanged: the repack happens at load time.

Planes (`repack_iq3_s4`; 134 bytes per 256 weights against the blocks' 110), row-major, per 16-weight group g:
  codes int64 [N, K/16]  two int32 words, the low one weights 16g..16g+7, the high one 16g+8..16g+15; in a word,
                         weight j's code at bits 4j+1..4j+4 mod 32 (the word of codes n = sum v_j << 4j rotated
                         left by 1: weight 7's top bit is bit 0)
  sc    u8    [N, K/64]  4-bit sub-block scales, even sub-block in the low nibble (as `gemv_iq3_s`)
  d     fp16  [N, K/256] super-block scales
Why that bit order: weights (j, j + 4) of a word, the f16x2 pair order of `gemv_h2_common.x_pairs`, the prepared
activations (`x16`) and the warp-MMA lanes, sit 16 bits apart, each code 2v at bits 1..4 or 5..8 of its half
after no shift (j = 0, 1) or one rotate by 8 (j = 2, 3), so a word of 8 weights costs one rotate, four `lop3` and
four HFMA2 (`gemv_iq3_s4_h2`). sm_90 SASS of the T = 1 packed-half2 loop on prepared activations: 316 instructions
per 128 weights per thread (2.5 per weight; the grid variant 570, NVFP4's 2.8 per weight), 71 registers against 123;
the warp-MMA T tile 8: 680 instructions against 1048.
This module's fp32 kernel (T > 8 on sm_70, prefill, the dequantizer) reads 2v - 15 as (2v | 0x4B000000) -
(2**23 + 15) in fp32, one FADD.
"""
from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

from .gemv_common import dequant_body, even_groups, gemv_body, ld, ld_pair, pairwise
from .gemv_iq3_s import (BLOCK_BYTES, QK, dequant_iq3_s, gemv_iq3_s, iq3_s_gemv_kernel, permute_signs, repack_iq3_s,
                         unpack_iq3_s)
from .gemv_iq3_s import _weights as iq3_s_weights
from .gemv_iq3_s import H2_TILES as IQ3_S_H2_TILES
from .gemv_launch import KernelInputError, check_weight, check_x, dequant, gemv, register_h2, register_variant
from .pdl import pdl_wait

GS = 16
LAYOUT_ENV = "NINFER_IQ3S_LAYOUT"
LAYOUTS = ("codes4", "grid")     # the default first: this module's planes
_GS = tl.constexpr(GS)
_ONE = tl.constexpr(1.0)
_MAGIC = tl.constexpr(0x4B000000)          # float bits of 2**23
_OFFSET = tl.constexpr(8388608.0 + 15.0)   # 2**23 + 15


def layout() -> str:
    """NINFER_IQ3S_LAYOUT: the planes IQ3_S weights are repacked into at load time: 'codes4' (the default: this
    module, 4.19 bits per weight) or 'grid' (`gemv_iq3_s`, the blocks' own 3.44 bits per weight)."""
    v = os.environ.get(LAYOUT_ENV, LAYOUTS[0])
    if v not in LAYOUTS:
        raise KernelInputError(f"{LAYOUT_ENV}={v!r}: expected one of {', '.join(LAYOUTS)}")
    return v


def is_codes4(packed: dict) -> bool:
    """Whether repacked IQ3_S planes are this module's (else `gemv_iq3_s`'s)."""
    return "codes" in packed


@triton.jit
def _load(codes, sc, d, w3, w4, w5, rows, g, wm, G):
    r = rows[:, None]
    q = ld(codes + r * G + g[None, :], wm)
    ge = even_groups(g)
    h = ge // 2                                                 # 32-weight sub-block index
    s4 = (ld_pair(sc + r * (G // 4) + (h // 2)[None, :], ge, wm, G).to(tl.int32) >> (4 * (h % 2))[None, :]) & 0xF
    s = pairwise(ld_pair(d + r * (G // 16) + (h // 8)[None, :], ge, wm, G).to(tl.float32)
                 * (1 + 2 * s4).to(tl.float32))
    return q.to(tl.int32), (q >> 32).to(tl.int32), s


@triton.jit
def _raw(st, i: tl.constexpr):
    a, b, s = st
    if i < 8:
        w = a
    else:
        w = b
    j: tl.constexpr = i % 8
    if j == 7:     # bits 29..31 and 0
        v2 = ((w >> 28) & 0xE) | ((w << 4) & 0x10)
    else:
        v2 = (w >> (4 * j)) & 0x1E
    return (v2 | _MAGIC).to(tl.float32, bitcast=True) - _OFFSET


@triton.jit
def _scale(st):
    a, b, s = st
    return s


@triton.jit
def iq3_s4_gemv_kernel(x_ptr, codes, sc, d, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split,
                       stride_xt, stride_ot, stride_rt, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_G: tl.constexpr, USE_SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
                       DOT_KIND: tl.constexpr, EPI: tl.constexpr, EVEN_G: tl.constexpr,
                       FOLD: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_wait(PDL)    # ninfer_kernels.pdl: before any load or store; finish_at triggers after the K loop
    gemv_body(x_ptr, codes, sc, d, None, None, None, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale,
              T, N, G, split, stride_xt, stride_ot, stride_rt, _load, _raw, _scale, _GS, _ONE, _ONE,
              T_TILE, BLOCK_N, BLOCK_G, USE_SPLIT, USE_DOT, DOT_KIND, EPI, EVEN_G, FOLD, STAGES, PDL=PDL)


@triton.jit
def iq3_s4_dequant_kernel(codes, sc, d, out_ptr, fscale, N, G, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    dequant_body(codes, sc, d, None, None, None, out_ptr, fscale, N, G, _load, _raw, _scale, _GS, _ONE, _ONE,
                 BLOCK_N, BLOCK_G)


def _h2_kernel(device):
    from .gemv_iq3_s4_h2 import h2_kernel     # imported on first use: it reuses this module's tile load
    return h2_kernel(device)


def _mma_kernel(device):
    from .gemv_iq3_s4_mma import mma_kernel
    return mma_kernel(device)


# the h2 variant's tiles: per thread like `gemv_iq3_s_h2` (a whole number of rows per thread), so that one's H200
# winners, and at T = 1 eight rows per thread too (sm_90: 128 registers; the grid variant needed 230 there)
H2_TILES = {**IQ3_S_H2_TILES, 1: IQ3_S_H2_TILES[1] + ((128, 16, 4, 1),)}
register_h2(iq3_s4_gemv_kernel.__name__, _h2_kernel, H2_TILES)   # T <= 8 candidates include the h2 variant
register_variant("mma", iq3_s4_gemv_kernel.__name__, _mma_kernel)   # sm_80+, T <= 16: the warp-MMA variant


def _code_tables(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(grid coordinates int64 [512, 4], inverse int64 [4096]: the index of the grid point whose coordinates
    (c - 1) / 2 are the 3-bit fields of the key, -1 where no point has them) on `device`."""
    from ninfer_formats.codecs.iq3_s_tables import grid_values
    g = grid_values().astype(np.int64)
    key = ((g - 1) // 2 << (3 * np.arange(4))).sum(axis=1)
    assert len(np.unique(key)) == 512, "IQ3_S grid points must be distinct"
    inv = np.full(4096, -1, np.int64)
    inv[key] = np.arange(512)
    return torch.from_numpy(g).to(device), torch.from_numpy(inv).to(device)


def _words(v: torch.Tensor) -> torch.Tensor:
    """4-bit codes int64 [n, K] -> the codes plane int64 [n, K/16] (module docstring)."""
    n, K = v.shape
    nib = (v.reshape(n, K // 8, 8) << (4 * torch.arange(8, device=v.device))).sum(dim=-1)   # disjoint: sum == or
    rot = ((nib << 1) | (nib >> 31)) & 0xFFFFFFFF
    w = rot.reshape(n, K // 16, 2)
    return w[..., 0] | (w[..., 1] << 32)                  # the high word's top bit lands in int64's sign bit


def _repack_rows(b: torch.Tensor, grid: torch.Tensor) -> tuple:
    n, nb = b.shape[0], b.shape[1] // BLOCK_BYTES
    b = b.reshape(n, nb, BLOCK_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).reshape(n, nb)
    idx = b[..., 2:66].reshape(n, nb * 64).to(torch.int64)
    qh = b[..., 66:74].reshape(n, nb * 8, 1).to(torch.int64)
    idx = idx | (((qh >> torch.arange(8, device=b.device)) & 1) << 8).reshape(n, nb * 64)
    signs = b[..., 74:106].reshape(n, nb * 32, 1).to(torch.int64)
    neg = ((signs >> torch.arange(8, device=b.device)) & 1).reshape(n, nb * QK)       # bit j of byte l: weight 8l + j
    c = grid[idx].reshape(n, nb * QK) * (1 - 2 * neg)
    sc = b[..., 106:110].reshape(n, nb * 4).contiguous()
    return _words((c + 15) // 2), sc, d


CODES4_BLOCK_BYTES = QK // 2 + QK // 64 + 2     # per 256 weights: 4-bit codes, 4-bit sub-block scales, fp16 d


def repack_growth(N: int, K: int) -> int:
    """Device bytes the `layout()` repack of an [N, K] IQ3_S weight adds to its blocks' once they are released
    (0 for the grid planes, which keep the blocks' bytes)."""
    return N * (K // QK) * (CODES4_BLOCK_BYTES - BLOCK_BYTES) if layout() == "codes4" else 0


def repack_iq3_s4(blocks: torch.Tensor, K: int, *, chunk_rows: int = 1024) -> dict:
    """GGML IQ3_S rows u8 [N, K/256*110] -> {"codes", "sc", "d"} (module docstring)."""
    if K % QK or not isinstance(blocks, torch.Tensor) or blocks.dim() != 2 or blocks.dtype != torch.uint8 \
            or blocks.shape[1] != K // QK * BLOCK_BYTES:
        got = (tuple(blocks.shape), blocks.dtype) if isinstance(blocks, torch.Tensor) else type(blocks).__name__
        raise KernelInputError(f"repack_iq3_s4: blocks must be u8 [N, {K // QK * BLOCK_BYTES}] for K={K} "
                               f"(K a multiple of {QK}), got {got}")
    grid = _code_tables(blocks.device)[0]
    parts = [_repack_rows(blocks[r:r + chunk_rows], grid) for r in range(0, blocks.shape[0], chunk_rows)]
    codes, sc, d = (torch.cat(p) for p in zip(*parts))
    return {"codes": codes, "sc": sc, "d": d}


def _codes(codes: torch.Tensor) -> torch.Tensor:
    """The codes plane int64 [n, K/16] -> 4-bit codes int64 [n, K]."""
    n = codes.shape[0]
    w = torch.stack([codes & 0xFFFFFFFF, (codes >> 32) & 0xFFFFFFFF], dim=-1)     # [n, K/16, 2] words
    nib = ((w >> 1) | (w << 31)) & 0xFFFFFFFF                                      # rotate right by 1
    return ((nib[..., None] >> (4 * torch.arange(8, device=codes.device))) & 0xF).reshape(n, -1)


def _unpack_rows(codes: torch.Tensor, sc: torch.Tensor, d: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    n = codes.shape[0]
    c = 2 * _codes(codes) - 15                                                 # signed coordinates [n, K]
    mag = ((c.abs() - 1) // 2).reshape(n, -1, 4)
    idx = inv[(mag << (3 * torch.arange(4, device=c.device))).sum(dim=-1)]      # [n, K/4] 9-bit grid indices
    if bool((idx < 0).any()):
        raise KernelInputError("unpack_iq3_s4: a 4-weight group is not an IQ3_S grid point "
                               "(the codes plane is corrupt)")
    qs = (idx & 0xFF).to(torch.uint8).reshape(n, -1).view(torch.int32)
    qh = (((idx >> 8) & 1).reshape(n, -1, 8) << torch.arange(8, device=c.device)).sum(dim=-1).to(torch.uint8)
    neg = (c < 0).to(torch.int64).reshape(n, -1, 16)
    s16 = (neg << torch.arange(16, device=c.device)).sum(dim=-1)
    signs = permute_signs(torch.where(s16 >= 32768, s16 - 65536, s16).to(torch.int16))
    return unpack_iq3_s({"qs": qs, "signs": signs, "qh": qh, "sc": sc, "d": d})


def unpack_iq3_s4(packed: dict, rows: torch.Tensor | None = None, *, chunk_rows: int = 1024) -> torch.Tensor:
    """The inverse of `repack_iq3_s4`: GGML blocks u8 [N, K/256*110] (or only `rows`, int64) on the planes' device,
    built `chunk_rows` rows at a time (its int64 temporaries are 8 bytes per weight)."""
    codes, sc, d = (packed[k] if rows is None else packed[k].index_select(0, rows) for k in ("codes", "sc", "d"))
    inv = _code_tables(codes.device)[1]
    parts = [_unpack_rows(codes[r:r + chunk_rows], sc[r:r + chunk_rows], d[r:r + chunk_rows], inv)
             for r in range(0, codes.shape[0], chunk_rows)]
    return torch.cat(parts) if parts else torch.empty((0, d.shape[1] * BLOCK_BYTES), dtype=torch.uint8,
                                                      device=codes.device)


# ---- either layout: what `dispatch` and `x16` call for an IQ3_S weight (NINFER_IQ3S_LAYOUT decides the planes) ----


def repack_iq3_s_any(blocks: torch.Tensor, K: int) -> dict:
    """IQ3_S blocks -> the planes NINFER_IQ3S_LAYOUT names (`repack_iq3_s` or `repack_iq3_s4`)."""
    return (repack_iq3_s4 if layout() == "codes4" else repack_iq3_s)(blocks, K)


def unpack_iq3_s_any(packed: dict, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The GGML blocks back from either layout's planes."""
    return (unpack_iq3_s4 if is_codes4(packed) else unpack_iq3_s)(packed, rows)


def gemv_iq3_s_any(x, packed: dict, out=None, residual=None, *, plans=None):
    """`gemv_iq3_s4` or `gemv_iq3_s`, whichever reads `packed`."""
    return (gemv_iq3_s4 if is_codes4(packed) else gemv_iq3_s)(x, packed, out, residual, plans=plans)


def dequant_iq3_s_any(packed: dict, K: int, dtype=torch.float16):
    """`dequant_iq3_s4` or `dequant_iq3_s`, whichever reads `packed`."""
    return (dequant_iq3_s4 if is_codes4(packed) else dequant_iq3_s)(packed, K, dtype)


def kernel_and_weights(packed: dict, K: int, device, what: str) -> tuple:
    """(the GEMV kernel that reads `packed`, its checked weight arguments)."""
    if is_codes4(packed):
        return iq3_s4_gemv_kernel, _weights(packed, K, device, what)[1]
    return iq3_s_gemv_kernel, iq3_s_weights(packed, K, device, what)[1]


def kernel_name(packed: dict | None) -> str:
    """The tuner name of the GEMV of an IQ3_S weight repacked into `packed` (None: not yet, so of the planes
    NINFER_IQ3S_LAYOUT will give it)."""
    codes4 = is_codes4(packed) if packed is not None else layout() == "codes4"
    return (iq3_s4_gemv_kernel if codes4 else iq3_s_gemv_kernel).__name__


def _weights(packed: dict, K: int, device, what: str):
    if K % QK:
        raise KernelInputError(f"{what}: K={K} is not a multiple of {QK}")
    codes = packed.get("codes")
    n = codes.shape[0] if isinstance(codes, torch.Tensor) and codes.dim() == 2 else -1
    return n, (check_weight(codes, "codes", (n, K // GS), (torch.int64,), what, device),
               check_weight(packed.get("sc"), "sc", (n, K // 64), (torch.uint8,), what, device),
               check_weight(packed.get("d"), "d", (n, K // QK), (torch.float16,), what, device))


def gemv_iq3_s4(x, packed: dict, out=None, residual=None, *, config=None, plans=None):
    """x [T, K] fp16/bf16/fp32, packed = repack_iq3_s4(blocks, K) -> [T, N] in x.dtype."""
    x = check_x(x, None, "gemv_iq3_s4")
    K = x.shape[1]
    n, w = _weights(packed, K, x.device, "gemv_iq3_s4")
    return gemv(iq3_s4_gemv_kernel, w, x, n, K // GS, GS, 1.0, out, residual, config, "gemv_iq3_s4", plans=plans)


def dequant_iq3_s4(packed: dict, K: int, dtype=torch.float16):
    """Dense [N, K] `dtype` weights from the codes planes."""
    dev = packed["codes"].device
    n, w = _weights(packed, K, dev, "dequant_iq3_s4")
    return dequant(iq3_s4_dequant_kernel, w, n, K // GS, GS, 1.0, dtype, dev)


def kernel_for(fmt: str = "iq3_s4", dequant: bool = False):
    """(kernel, signature of its weight arguments, extra constexprs) for compile checks."""
    sig = {"codes": "*i64", "sc": "*u8", "d": "*fp16"}
    return (iq3_s4_dequant_kernel if dequant else iq3_s4_gemv_kernel), sig, {}
