"""Prepared activations (kernels/x16.py) against the production NVFP4 f16 GEMVs, on the GPU (bench/NOTES.md §10).

The question before wiring them into the model: does reading ready f16 pairs (and a back factor per 128
activations) instead of converting bf16 activations in every CTA make the packed-half2 T=1 loop and the
warp-MMA T=2..8 loop faster? (sm_90 SASS per loop iteration: MMA 523 -> 377 instructions and 96 -> 72
registers; h2 T=1 805 -> 699.) Per shape and T: the shipped tuned config (kernels/gemv_tuned.json, this GPU)
with plain activations (`us`) and with prepared ones (`us_xpre`), the best of a few neighbouring tiles with
prepared ones (`us_xpre_best`: fewer registers may favour another split or row count), and the prep kernel
itself on [T, K] (`us_prep`: what a separate launch would add; fused into the producing kernel it is ~0).
Timing as bench/kernels.py: calls over rotating weight copies (>= 240 MB) captured in one CUDA graph.

    python bench/xpre.py [--shapes attn_qkv mlp_gate_up ...] [--T 1 2 4 8] [--out $OUT/xpre.json]
    python bench/xpre.py --smoke      # CPU + Triton interpreter, one tiny shape: exercises this script only

Records: {"format", "name", "tp", "shape", "T", "config", "us", "us_xpre", "us_xpre_best", "config_xpre_best",
"us_prep", "tried" ([config, us] of every prepared tile timed), "pct_copy_bw", "pct_copy_bw_xpre", "copy_tbps", "gpu"}.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from ninfer_formats.atomic import write_json_atomic

SMOKE = "--smoke" in sys.argv
if SMOKE:  # must precede the first ninfer_kernels import
    os.environ["TRITON_INTERPRET"] = "1"
DEV = "cpu" if SMOKE else "cuda"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"attn_qkv": (1, 14336, 5120), "gdn_qkvz": (1, 16384, 5120), "mlp_gate_up": (1, 34816, 5120),
          "mlp_down": (1, 5120, 17408), "attn_o": (1, 5120, 6144), "attn_qkv_tp2": (2, 7168, 5120),
          "mlp_gate_up_tp2": (2, 17408, 5120), "tiny": (1, 96, 256)}
ROTATE_BYTES = 240e6


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ms_of(fn) -> float:
    if SMOKE:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def graph_us(fns) -> float:
    """us per call of `fns` (called in turn, max(20, len) calls) captured in one CUDA graph (eager in smoke)."""
    if SMOKE:
        return ms_of(fns[0]) * 1e3
    import bench_device as D
    return D.graph_us(fns, ms_of)


def copy_tbps() -> float:
    n = 1 << (16 if SMOKE else 30)
    src = torch.empty(n, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return 2 * n / (ms_of(lambda: dst.copy_(src)) * 1e-3) / 1e12


def shipped_config(N: int, K: int, T: int, fmt: str = "nvfp4"):
    """The shipped tuned config of `fmt` (a tune-cache format, e.g. "nvfp4+xpre") for this GPU
    (kernels/gemv_tuned.json), or None."""
    from ninfer_kernels.gemv_launch import GemvConfig, next_pow2
    if SMOKE:
        return GemvConfig(32, 16, 2, 1, split=1, h2=True) if T == 1 else GemvConfig(32, 8, 2, 1, split=1, mma=True)
    with open(os.path.join(ROOT, "kernels", "gemv_tuned.json")) as f:
        ship = json.load(f)
    for e in ship["gpus"].get(torch.cuda.get_device_name(), ()):
        if (e["fmt"], e["N"], e["K"], e["t_bucket"]) == (fmt, N, K, next_pow2(T)):
            return GemvConfig(**e["config"])
    return None


def neighbours(cfg) -> list:
    """A few tiles near `cfg` for the prepared variant: split -1/+1, the other row count; for the MMA loop also
    the other load depth (not block_g 16: 40-65 s of ptxas per variant, gemv_tiles._DECODE_MMA_TILES)."""
    from dataclasses import replace
    out = [cfg]
    for s in (cfg.split - 1, cfg.split + 1):
        if s >= 1:
            out.append(replace(cfg, split=s))
    bn = {64: 128, 128: 256 if cfg.mma else 64, 256: 128}.get(cfg.block_n)
    if bn:
        out.append(replace(cfg, block_n=bn))
    if cfg.mma:
        out.append(replace(cfg, num_stages=3 - cfg.num_stages))
    return out


def parse_extra(text: str) -> tuple:
    """argparse type of --extra "bn:bg:warps:split,...": ((bn, bg, warps, split), ...) of positive integers ("" is
    none; argparse passes the default through here too)."""
    try:
        tiles = tuple(tuple(int(v) for v in item.split(":")) for item in text.split(",")) if text else ()
        ok = all(len(t) == 4 and min(t) > 0 for t in tiles)
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r}: expected bn:bg:warps:split[,...], e.g. 32:16:4:1")
    return tiles


def measure(name: str, tp: int, N: int, K: int, ts, copy: float, gpu: str, extra: tuple = ()) -> list[dict]:
    from ninfer_kernels import randweights
    from ninfer_kernels.gemv_launch import GemvConfig
    from ninfer_kernels.gemv_nvfp4 import gemv_nvfp4, gemv_nvfp4_prepared, repack_nvfp4
    from ninfer_kernels.x16 import x16_prep
    nbytes = N * K // 2 + N * K // 16
    ws = []
    for i in range(1 if SMOKE else int(min(16, max(2, math.ceil(ROTATE_BYTES / nbytes))))):
        w = randweights.make("nvfp4", N, K, device=DEV, seed=i)
        ws.append({"planes": repack_nvfp4(w["codes"], w["scales"]), "gscale": w["gscale"]})   # the kernels' layout
    recs = []
    for T in ts:
        cfg = shipped_config(N, K, T)
        if cfg is None or not (cfg.h2 or cfg.mma):
            log(f"{name} T={T}: shipped config {cfg} is not an h2/mma one; skipped")
            continue
        dt = torch.float32 if SMOKE else torch.bfloat16
        x = torch.randn(T, K, device=DEV).to(dt)
        out = torch.empty(T, N, device=DEV, dtype=dt)
        xp = x16_prep(x)
        us = graph_us([lambda w=w: gemv_nvfp4(x, w["planes"], w["gscale"], out, config=cfg) for w in ws])
        tried = []
        near = neighbours(cfg)
        # --extra: packed-half2 tiles, timed at T <= 2 where the h2 loop runs
        more = [GemvConfig(bn, bg, w, 1, sp, h2=True) for bn, bg, w, sp in extra] if T <= 2 else []
        for c in near + [c for c in more if c not in near]:
            try:
                tried.append((graph_us([lambda w=w, c=c: gemv_nvfp4_prepared(xp, w["planes"], w["gscale"], out,
                                                                             config=c) for w in ws]), c))
            except Exception as e:        # noqa: BLE001 - a tile the device cannot hold is not a candidate
                log(f"{name} T={T} {c}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        if not tried or tried[0][1] != cfg:
            continue
        best = min(tried, key=lambda t: t[0])
        for t, c in tried:
            log(f"{name} T={T} prepared {t:8.2f} us  {c}")
        us_prep = graph_us([lambda: x16_prep(x, xp)])
        rec = {"format": "nvfp4", "name": name, "tp": tp, "shape": [N, K], "T": T, "config": str(cfg),
               "us": round(us, 2), "us_xpre": round(tried[0][0], 2), "us_xpre_best": round(best[0], 2),
               "config_xpre_best": str(best[1]), "us_prep": round(us_prep, 2),
               "tried": [[str(c), round(t, 2)] for t, c in tried],
               "pct_copy_bw": round(100 * nbytes / (us * 1e-6) / (copy * 1e12), 1),
               "pct_copy_bw_xpre": round(100 * nbytes / (best[0] * 1e-6) / (copy * 1e12), 1),
               "copy_tbps": round(copy, 3), "gpu": gpu}
        log(f"{name} T={T}: {us:.2f} -> {tried[0][0]:.2f} us (best {best[0]:.2f}, {best[1]}); prep {us_prep:.2f} us")
        recs.append(rec)
    return recs


def table(recs: list[dict]) -> str:
    lines = [f"{'shape':<16}{'T':>3}{'us':>9}{'xpre':>9}{'best':>9}{'ratio':>7}{'prep':>7}{'%bw':>7}{'%bw x':>7}"]
    for r in recs:
        lines.append(f"{r['name']:<16}{r['T']:>3}{r['us']:>9.2f}{r['us_xpre']:>9.2f}{r['us_xpre_best']:>9.2f}"
                     f"{r['us_xpre_best'] / r['us']:>7.3f}{r['us_prep']:>7.2f}{r['pct_copy_bw']:>7.1f}"
                     f"{r['pct_copy_bw_xpre']:>7.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=None, choices=sorted(SHAPES))
    ap.add_argument("--T", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--extra", type=parse_extra, default=(),
                    help="more packed-half2 tiles to time at T <= 2, bn:bg:warps:split[,...]")
    args = ap.parse_args(argv)
    if not SMOKE and not torch.cuda.is_available():
        print("error: bench/xpre.py needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    if any(not 1 <= t <= 8 for t in args.T):
        print(f"error: --T: values must be in 1..8, got {args.T}", file=sys.stderr)
        return 2
    shapes = args.shapes or (["tiny"] if SMOKE else [s for s, (tp, _, _) in SHAPES.items() if tp == 1 and s != "tiny"])
    copy = copy_tbps()
    gpu = "cpu (interpreter)" if SMOKE else torch.cuda.get_device_name()
    recs = []
    for s in shapes:
        tp, N, K = SHAPES[s]
        recs += measure(s, tp, N, K, args.T, copy, gpu, args.extra)
        if args.out:                      # after every shape: a timeout keeps what was measured
            write_json_atomic(args.out, recs)
    print(f"copy {copy:.2f} TB/s, {gpu}")
    print(table(recs))
    return 0 if recs else 1


if __name__ == "__main__":
    sys.exit(main())
