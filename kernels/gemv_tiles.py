"""Which launch configurations the GEMV tuner tries for a shape (`candidates`; the first is the default): tile
tables per T bucket and GPU kind, trimmed to what won on the H200 (bench/NOTES.md), and the K splits that fill
the device (`auto_split`, `fill_splits`)."""
from __future__ import annotations

import torch
import triton

from .gemv_config import GemvConfig, interpreting, next_pow2, sm_count
from .gemv_h2_select import H2_STATE


def auto_split(n_ctas: int, g_tiles: int, sms: int, waves: int = 4) -> int:
    """K splits so that about `waves` CTAs per SM exist: row blocks alone rarely fill an H200 at N ~ 5k,
    and a streaming kernel needs several resident CTAs per SM to keep enough loads in flight. At most 16,
    except for a handful of row blocks (the GDN b/a projections, 48-96 rows), where split-K is the only
    parallelism and 16 splits leave each CTA streaming several tiles in a row: up to 64 (6.2 -> 5.7 us on
    the H200, bench/NOTES.md §8)."""
    if n_ctas >= waves * sms:
        return 1
    return max(1, min(64 if n_ctas <= 8 else 16, g_tiles, triton.cdiv(waves * sms, n_ctas)))


def fill_splits(n_ctas: int, g_tiles: int, sms: int) -> set[int]:
    """K splits that leave every CTA resident in one wave at 4 or 8 CTAs per SM (the h2 tiles' occupancy at
    128 / 64 rows): `auto_split` rounds up, which can spill a few CTAs into a second, mostly idle wave (attn_qkv
    at 128 rows: 5 splits = 560 CTAs for 528 slots, 15 % slower on the H200 than 3 splits = 336)."""
    return {max(1, min(16, g_tiles, (per * sms) // n_ctas)) for per in (4, 8)}


# decode candidates per T bucket, trimmed to what won on the H200 (bench/NOTES.md): (block_n, block_g, num_warps,
# num_stages) elementwise tiles (block_g = 16 groups is 144..208 bytes of a row per step, 2 groups = one 16-byte
# load per thread; num_stages 1 = load then decode, >= 2 = the weight loads cp.async-pipelined that deep, which
# lost 1.1-2x on every NVFP4 shape and won two Q6_K ones) and (block_n, K per step, num_warps) tl.dot tiles
# (sm_80+; sm_70 only from T = 4). T >= 8 never won elementwise; T = 1..2 never won with tl.dot.
_DECODE_TILES = {1: ((64, 16, 4, 1), (64, 16, 2, 1), (128, 16, 4, 1)),
                 2: ((64, 16, 4, 1), (64, 16, 2, 1), (128, 16, 4, 1)),
                 4: ((128, 16, 4, 1), (64, 16, 4, 1)),
                 8: ((64, 16, 4, 1),),
                 16: ()}
_DECODE_DOT_TILES = {1: (), 2: (), 4: ((64, 256, 4), (128, 256, 8)),
                     8: ((64, 256, 4), (128, 128, 4), (128, 256, 8)),
                     16: ((64, 256, 4), (128, 128, 4), (128, 256, 8))}
# packed-half2 tiles (block_n, block_g, num_warps, num_stages): more rows per thread amortize the per-group
# activation scaling and packing (gemv_nvfp4_h2); for T <= 2 the first two also get fewer / more K splits.
# num_stages 1 = load then decode, 3 = cp.async pipeline (gemv_h2_common._loop)
_DECODE_H2_TILES = {1: ((128, 16, 4, 1), (64, 16, 4, 1), (256, 16, 8, 1), (256, 16, 4, 1), (128, 16, 4, 3)),
                    2: ((128, 16, 4, 1), (64, 16, 4, 1), (256, 16, 8, 1), (128, 16, 4, 3)),
                    4: ((64, 16, 4, 1), (128, 16, 4, 1)),
                    8: ((64, 16, 4, 1),),
                    16: ()}
# warp-MMA tiles (block_n, block_g, num_warps, num_stages) per T bucket, trimmed to what won on the H200 (bench/
# NOTES.md §7): 16 rows per warp and m-tile, 8 groups (128 weights) per chunk; num_stages 1 = load then decode,
# 2 = the next step's loads issued before this step's decode (gemv_mma_body._k_loop), 3 = two steps ahead (new
# in §11: within noise of 2 in §12). T = 1 never won (h2 does); block_g 16 never won and its double buffer needs
# 196-255 registers and 40-65 s of ptxas per variant. (128, 8, 8, 2): one m-tile per warp, 8 warps (new in §14).
_MMA_T2_8 = ((128, 8, 4, 2), (256, 8, 4, 2), (128, 8, 4, 3), (128, 8, 8, 2))
_DECODE_MMA_TILES = {1: (), 2: _MMA_T2_8, 4: _MMA_T2_8, 8: _MMA_T2_8, 16: ((256, 8, 4, 1), (128, 8, 4, 1))}
# prefill tiles (block_n, K per step, num_warps, num_stages, t_tile)
_PREFILL_TILES = ((128, 64, 8, 3, 64), (128, 64, 4, 3, 32), (64, 64, 4, 3, 64), (128, 128, 8, 2, 128))
# sm_70: tl.dot lowers to FMAs that keep a thread's rows and columns of the whole K step in registers, so
# K = 64..256 per step spilled 150 B - 3.2 KB to the stack (32-255 registers); FMA_DOT_K weights per step and
# T tiles <= 32 compile to 168-210 registers and no stack (compile_check). No cp.async there: one stage.
FMA_DOT_K = 32
_DECODE_DOT_TILES_FMA = {b: ((64, FMA_DOT_K, 4), (128, FMA_DOT_K, 8)) if b >= 4 else () for b in (1, 2, 4, 8, 16)}
_PREFILL_TILES_FMA = ((64, FMA_DOT_K, 4, 1, 32), (128, FMA_DOT_K, 8, 1, 32), (64, FMA_DOT_K, 4, 1, 16))


def dot_block_g(k_step: int, GS: int) -> int:
    """Groups per tl.dot step for a tile that steps `k_step` weights (at least one group)."""
    return max(1, k_step // GS)


def candidates(T: int, N: int, G: int, GS: int, x_dtype, device: torch.device, h2: bool = False,
               mma: bool = False, h2_tiles: dict | None = None, mma_tiles: dict | None = None) -> list[GemvConfig]:
    """Configs for [T, K] x [N, K]^T (G = K / GS groups); the first is the default. h2 / mma: the kernel has a
    packed-half2 / warp-MMA variant (`variant`), whose tiles are added for T <= 8 / 2 <= T <= 16 (mma: sm_80+) with
    fp16/bf16 activations (both round activations to f16; fp32 activations ask for fp32 products); h2_tiles /
    mma_tiles: that variant's own tile table (`h2_tiles(kernel)`, `mma_tiles(kernel)`)."""
    if interpreting() or device.type != "cuda":
        # the interpreter pays per program and per op, not per element: few, large tiles
        return [GemvConfig(min(64, next_pow2(N)), max(min(64, next_pow2(G)), 16 // GS), use_dot=T > 16)]
    cc = torch.cuda.get_device_capability(device)
    sms = sm_count(device)
    fma_dot = cc < (8, 0)
    if T > 16:  # prefill: a GEMM with the decode fused into the A-operand load
        return [GemvConfig(bn, dot_block_g(bk, GS), w, st, 1, True, tt)
                for bn, bk, w, st, tt in (_PREFILL_TILES_FMA if fma_dot else _PREFILL_TILES)]
    b = next_pow2(T)
    out = [GemvConfig(bn, bg, w, st, auto_split(triton.cdiv(N, bn), triton.cdiv(G, bg), sms))
           for bn, bg, w, st in _DECODE_TILES[b]]
    if h2 and not H2_STATE["off"] and x_dtype != torch.float32:   # fp32 activations keep fp32 products
        # T <= 2: with 1-3 resident CTAs per SM the default's ~4 CTAs per SM can leave a partial last wave; and
        # ~16 per SM (several waves of the 128-row tile): the 34816-row gate/up ran 5 % faster split 7-8 ways than
        # the unsplit 64-row tile (the others gave it 1-4 splits), and the decode step ~120 us faster (NOTES §32)
        for i, (bn, bg, w, st) in enumerate((h2_tiles or _DECODE_H2_TILES)[b]):
            n, g = triton.cdiv(N, bn), triton.cdiv(G, bg)
            splits = [auto_split(n, g, sms, wv) for wv in ((4, 2, 8, 16) if b <= 2 and i < 2 else (4,))]
            if b <= 2 and i < 2:
                splits += sorted(fill_splits(n, g, sms) - set(splits))
            out += [GemvConfig(bn, bg, w, st, sp, h2=True) for sp in splits]
    if mma and not H2_STATE["mma_off"] and cc >= (8, 0) and x_dtype != torch.float32:
        for bn, bg, w, st in (mma_tiles or _DECODE_MMA_TILES)[b]:
            if G % bg == 0:
                n = triton.cdiv(N, bn)
                # the double-buffered tiles hold ~72 registers (on 16-word-aligned prepared rows, `x16_layout`: 114
                # on unaligned ones): 7 CTAs per SM fit where 4 waves leave ~4
                waves = (4, 7) if 2 <= b <= 8 else (4,)
                out += [GemvConfig(bn, bg, w, st, sp, mma=True)
                        for sp in dict.fromkeys(auto_split(n, G // bg, sms, wv) for wv in waves)]
    if x_dtype != torch.float32:
        # tensor cores on sm_80+; on sm_70 tl.dot is an FMA loop, still worth measuring for T >= 4
        for bn, bk, w in (_DECODE_DOT_TILES_FMA if fma_dot else _DECODE_DOT_TILES)[b]:
            bg, st = dot_block_g(bk, GS), 1 if fma_dot else 3
            out.append(GemvConfig(bn, bg, w, st, auto_split(triton.cdiv(N, bn), triton.cdiv(G, bg), sms, 2), True))
    if not out:  # fp32 activations at T = 16 (no tl.dot tile): the smallest elementwise tile
        out.append(GemvConfig(32, 16, 4, 1, auto_split(triton.cdiv(N, 32), triton.cdiv(G, 16), sms)))
    return list(dict.fromkeys(out))  # drop duplicates, keep order
