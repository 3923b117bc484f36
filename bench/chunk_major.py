"""Does a chunk-major weight layout speed up the NVFP4 GEMVs? An experiment on the GPU (bench/NOTES.md §12).

The T = 2..8 MMA loop reads, per K step, 64 bytes (128 weights) of each of its rows: runs of 64 bytes 2.5 KB
apart (K = 5120), 128-256 rows at a time. §5 found the contiguous bytes per row per step to be what the memory
side of the T = 1 loop lives on (64 B per row: 18 us where 256 B took 13 us, same bytes). A load-time repack to
chunk-major order -- codes int64 [G/8, N, 8] and scales u8 [G/8, N, 8] (chunk c of row n at (c * N + n) * 64
bytes) -- makes one K step of a 128-row tile a single 8 KB run. This script times the production kernels
(`gemv_nvfp4_mma` for T >= 2 and, at T = 1, `gemv_nvfp4_h2` and the MMA one) against the same code reading the
chunk-major copy, same tiles and splits (the shipped prepared-input config and its neighbours), on prepared
activations as the decode step feeds them, and checks that both layouts give the same output.

    python bench/chunk_major.py [--shapes attn_qkv mlp_gate_up ...] [--T 1 4 8] [--out $OUT/chunk_major.json]
    python bench/chunk_major.py --smoke     # CPU + Triton interpreter, one tiny shape: exercises this script only

Records: {"name", "shape", "T", "config", "us_row", "us_chunk", "pct_copy_bw_row", "pct_copy_bw_chunk",
"max_abs_diff", "copy_tbps", "gpu"}.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from types import SimpleNamespace

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE:  # must precede the first ninfer_kernels import
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import xpre  # noqa: E402  (bench/xpre.py: shapes, timing, shipped configs)
from ninfer_formats.atomic import write_json_atomic  # noqa: E402
from ninfer_kernels import gemv_launch as gl  # noqa: E402
from ninfer_kernels.gemv_h2_common import factory, h2_body  # noqa: E402
from ninfer_kernels.gemv_mma_body import mma_body, no_prep  # noqa: E402
from ninfer_kernels.gemv_nvfp4_h2 import _BACK_BIAS, _UP_BIAS, _tile  # noqa: E402
from ninfer_kernels.gemv_nvfp4_mma import _W_EXP, _no_factor, _row_pairs  # noqa: E402

DEV = xpre.DEV
NAME = "nvfp4_chunk_major_kernel"       # the base kernel the experimental MMA variant is registered under


@triton.jit
def _load_row_cm(wts, row, gk, q, G):
    """`gemv_nvfp4_mma._load_row` on the chunk-major copy: chunk gk // 8 of row `row` starts at word
    (gk // 8 * N + row) * 8."""
    codes, scales, N = wts
    off = tl.multiple_of((gk // 8 * N + row) * 8 + 2 * q, 2)
    return (tl.load(codes + off[:, None] + tl.arange(0, 2)[None, :]),
            tl.load(scales.to(tl.pointer_type(tl.int16)) + off // 2))


@triton.jit
def nvfp4_cm_kernel(x_ptr, codes, scales, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split, stride_xt,
                    stride_ot, stride_rt, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                    USE_SPLIT: tl.constexpr, USE_DOT: tl.constexpr, DOT_KIND: tl.constexpr,
                    HAS_RES: tl.constexpr, EVEN_G: tl.constexpr, FOLD: tl.constexpr, STAGES: tl.constexpr,
                    H2_MODE: tl.constexpr, NW: tl.constexpr, XPRE: tl.constexpr):
    mma_body(x_ptr, (codes, scales, N), None, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale * _W_EXP, T, N, G, split,
             stride_xt, stride_ot, stride_rt, T_TILE, BLOCK_N, BLOCK_G, USE_SPLIT, HAS_RES, STAGES, H2_MODE, NW,
             XPRE, _load_row_cm, no_prep, 2, _row_pairs, _no_factor, False)


@triton.jit
def _load_cm(codes, scales, n, w3, w4, w5, rows, g, wm, G):
    """`gemv_nvfp4._load` (the h2 loop's tile load) on the chunk-major copy, n = N. g is a whole tile of 8k groups
    from a multiple of 8: runs of 8 groups (64 code bytes, 8 scale bytes) are contiguous."""
    k = tl.arange(0, g.shape[0])
    c0 = tl.min(g, axis=0) // 8              # the tile's first chunk (a whole tile starts on a chunk)
    off = ((c0 + k // 8) * (n * 8))[None, :] + rows[:, None] * 8 + (k % 8)[None, :]
    off = tl.max_contiguous(tl.multiple_of(off, [1, 2]), [1, 2])   # the production tile layout: 2 groups a thread
    words = tl.load(codes + off) if wm is None else tl.load(codes + off, mask=wm, other=0)
    s = (tl.load(scales + off) if wm is None else tl.load(scales + off, mask=wm, other=0)).to(tl.int32)
    return words.to(tl.int32), (words >> 32).to(tl.int32), s


@triton.jit
def nvfp4_h2_cm_kernel(x_ptr, codes, scales, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split, stride_xt,
                       stride_ot, stride_rt, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                       USE_SPLIT: tl.constexpr, USE_DOT: tl.constexpr, DOT_KIND: tl.constexpr,
                       HAS_RES: tl.constexpr, EVEN_G: tl.constexpr, FOLD: tl.constexpr, STAGES: tl.constexpr,
                       H2_MODE: tl.constexpr, XPRE: tl.constexpr):
    h2_body(x_ptr, codes, scales, N, None, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split, stride_xt,
            stride_ot, stride_rt, _load_cm, _tile, _UP_BIAS, _BACK_BIAS, T_TILE, BLOCK_N, BLOCK_G, USE_SPLIT,
            HAS_RES, EVEN_G, STAGES, H2_MODE, XPRE)


_BASE = SimpleNamespace(__name__=NAME)       # what the launcher looks variants up by
gl.register_variant("mma", NAME, factory(nvfp4_cm_kernel, NAME, per_thread=True))
gl.register_variant("h2", NAME, factory(nvfp4_h2_cm_kernel, NAME))


def chunk_major(t: torch.Tensor, K: int) -> torch.Tensor:
    """Bytes [N, B * K/128] (B per 128-weight chunk: 64 of codes, 8 of scales) -> [K/128, N, B], flat."""
    N = t.shape[0]
    return t.reshape(N, K // 128, -1).transpose(0, 1).contiguous().reshape(-1)


def candidates(N: int, K: int, T: int) -> list:
    """The shipped prepared-input config for this shape and T and its neighbours (bench/xpre.py), and at T <= 2
    the default MMA tile's family too (h2 and MMA both serve T = 1, 2)."""
    from ninfer_kernels.gemv_launch import GemvConfig
    if SMOKE:
        return [GemvConfig(32, 16, 2, 1, split=1, h2=True)] * (T <= 2) + [GemvConfig(32, 8, 2, 1, split=1, mma=True)]
    mma = GemvConfig(128, 8, 4, 2, split=gl.auto_split(-(-N // 128), K // 128, 132), mma=True)
    cfg = xpre.shipped_config(N, K, T, "nvfp4+xpre") or mma
    out = xpre.neighbours(cfg) + (xpre.neighbours(mma) if T <= 2 and not cfg.mma else [])
    return list(dict.fromkeys(c for c in out if c.mma or T <= 8))


def measure(name: str, N: int, K: int, ts, copy: float, gpu: str) -> list[dict]:
    from ninfer_kernels import randweights
    from ninfer_kernels.gemv_nvfp4 import nvfp4_gemv_kernel
    from ninfer_kernels.x16 import launch_prepared, x16_prep
    nbytes = N * K // 2 + N * K // 16
    n_copies = 1 if SMOKE else int(min(16, max(2, math.ceil(xpre.ROTATE_BYTES / nbytes))))
    ws = [randweights.make("nvfp4", N, K, device=DEV, seed=i) for i in range(n_copies)]
    cms = [(chunk_major(w["codes"], K).view(torch.int64), chunk_major(w["scales"], K)) for w in ws]
    recs = []
    for T in ts:
        dt = torch.float32 if SMOKE else torch.bfloat16
        xp = x16_prep(torch.randn(T, K, device=DEV).to(dt))
        out_r, out_c = (torch.empty(T, N, device=DEV, dtype=dt) for _ in range(2))
        for cfg in candidates(N, K, T):
            def row(w=ws[0], c=cfg):
                return launch_prepared(nvfp4_gemv_kernel, (w["codes"].view(torch.int64), w["scales"]), xp, N, K, 16,
                                       w["gscale"], out_r, None, c, "row-major")

            def chunk(w=ws[0], cm=cms[0], c=cfg):
                return launch_prepared(_BASE, cm, xp, N, K, 16, w["gscale"], out_c, None, c, "chunk-major")
            try:
                diff = float((row() - chunk()).abs().max())
                us_r = xpre.graph_us([lambda w=w: row(w) for w in ws])
                us_c = xpre.graph_us([lambda w=w, cm=cm: chunk(w, cm) for w, cm in zip(ws, cms)])
            except Exception as e:        # noqa: BLE001 - a tile the device cannot hold is not a candidate
                xpre.log(f"{name} T={T} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                continue
            pct = [round(100 * nbytes / (u * 1e-6) / (copy * 1e12), 1) for u in (us_r, us_c)]
            recs.append({"name": name, "shape": [N, K], "T": T, "config": str(cfg), "us_row": round(us_r, 2),
                         "us_chunk": round(us_c, 2), "pct_copy_bw_row": pct[0], "pct_copy_bw_chunk": pct[1],
                         "max_abs_diff": diff, "copy_tbps": round(copy, 3), "gpu": gpu})
            xpre.log(f"{name} T={T} {cfg}: row {us_r:.2f} us, chunk-major {us_c:.2f} us (diff {diff:.3g})")
    return recs


def table(recs: list[dict]) -> str:
    lines = [f"{'shape':<14}{'T':>3}{'row us':>9}{'chunk us':>10}{'ratio':>7}{'%bw row':>9}{'%bw chunk':>10}  config"]
    for r in recs:
        lines.append(f"{r['name']:<14}{r['T']:>3}{r['us_row']:>9.2f}{r['us_chunk']:>10.2f}"
                     f"{r['us_chunk'] / r['us_row']:>7.3f}{r['pct_copy_bw_row']:>9.1f}{r['pct_copy_bw_chunk']:>10.1f}"
                     f"  {r['config']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=None, choices=sorted(xpre.SHAPES))
    ap.add_argument("--T", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if not SMOKE and not torch.cuda.is_available():
        print("error: bench/chunk_major.py needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    if any(not 1 <= t <= 16 for t in args.T):
        print(f"error: --T: values must be in 1..16, got {args.T}", file=sys.stderr)
        return 2
    shapes = args.shapes or (["tiny"] if SMOKE else ["attn_qkv", "mlp_gate_up", "mlp_down", "attn_o"])
    copy, gpu = xpre.copy_tbps(), "cpu (interpreter)" if SMOKE else torch.cuda.get_device_name()
    recs = []
    for s in shapes:
        _, N, K = xpre.SHAPES[s]
        recs += measure(s, N, K, args.T, copy, gpu)
        if args.out:                      # after every shape: a timeout keeps what was measured
            write_json_atomic(args.out, recs)
    print(f"copy {copy:.2f} TB/s, {gpu}")
    print(table(recs))
    return 0 if recs and all(r["max_abs_diff"] == 0.0 for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
