"""The TMA-fed NVFP4 GEMV (kernels/gemv_nvfp4_tma.py) against the production one, on the GPU (bench/NOTES.md §15).

The question before wiring it into the tuner: with each 128-weight chunk of BLOCK_N rows arriving by one bulk
tensor copy into shared memory, STAGES - 1 chunks in flight per CTA and no registers held for them, does the T = 1
decode GEMV get nearer the 73-84 % of copy bandwidth that its loads alone reached (§5)? Per shape and T, on
prepared activations (what the decode step runs on sm_90): the shipped tuned config (`us_prod`,
kernels/gemv_tuned.json) and every TMA tile of a small sweep (block_n, num_warps, stages, K splits), with the
fastest reported (`us`), and the output's relative L2 distance from the production output (`rel_l2`).
Timing as bench/xpre.py: calls over rotating weight copies (>= 240 MB) captured in one CUDA graph.

    python bench/gemv_tma.py [--shapes attn_qkv ...] [--T 1 4] [--out $OUT/gemv_tma.json]
    python bench/gemv_tma.py --smoke      # CPU + Triton interpreter, one tiny shape: exercises this script only

Records: {"format", "name", "shape", "T", "config", "us", "pct_copy_bw", "config_prod", "us_prod",
"pct_copy_bw_prod", "rel_l2", "copy_tbps", "gpu", "tried": [[config, us], ...]}.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE:  # must precede the first ninfer_kernels import
    os.environ["TRITON_INTERPRET"] = "1"

import xpre  # noqa: E402  (bench/xpre.py: timing, copy bandwidth, shipped configs)
from ninfer_formats.atomic import write_json_atomic  # noqa: E402

DEV = xpre.DEV
SHAPES = {"attn_qkv": (14336, 5120), "gdn_qkvz": (16384, 5120), "mlp_gate_up": (34816, 5120),
          "mlp_down": (5120, 17408), "attn_o": (5120, 6144), "lm_head": (248320, 5120), "tiny": (96, 256)}
# (block_n, num_warps, stages): one row per thread at 64 / 128 / 256 rows, two at (256, 4)
TILES = ((64, 2, 3), (128, 4, 2), (128, 4, 3), (128, 4, 4), (256, 8, 3), (256, 4, 3), (256, 8, 4))
WAVES = (2, 4, 8)


def tma_configs(N: int, K: int, sms: int) -> list[tuple]:
    """(block_n, num_warps, stages, split) of the sweep; splits from `auto_split` at 2 / 4 / 8 CTAs per SM."""
    from ninfer_kernels.gemv_launch import auto_split
    if SMOKE:
        return [(64, 2, 2, 1), (64, 2, 3, 2)]
    out = []
    for bn, nw, st in TILES:
        n = -(-N // bn)
        out += [(bn, nw, st, s) for s in sorted({auto_split(n, K // 128, sms, w) for w in WAVES})]
    return out


def launch_tma(xp, planes, gscale, out, bn, nw, st, split, kern):
    """One launch of the TMA kernel on prepared activations (the launcher's grid and workspace rules)."""
    import triton
    from ninfer_kernels.gemv_launch import workspace
    T, N, G = xp.shape[0], out.shape[1], planes["codes"].shape[0] * 8
    C = G // 8
    split = -(-C // -(-C // max(1, min(split, C))))     # no empty split
    grid = (triton.cdiv(N, bn), split, 1)
    ws, cnt = workspace(xp.device, split * T * N, grid[0]) if split > 1 else (out, out)
    kern[grid](xp, planes["codes"], planes["scales"], out, out, ws, cnt, gscale, T, N, G, split, xp.stride(0),
               out.stride(0), out.stride(0), T_TILE=triton.next_power_of_2(T), BLOCK_N=bn, USE_SPLIT=split > 1,
               HAS_RES=False, STAGES=st, XPRE=True, num_warps=nw, num_stages=st)
    return out


def measure(name: str, N: int, K: int, ts, copy: float, gpu: str) -> list[dict]:
    from ninfer_kernels import randweights
    from ninfer_kernels.gemv_launch import sm_count
    from ninfer_kernels.gemv_nvfp4 import gemv_nvfp4_prepared, repack_nvfp4
    from ninfer_kernels.gemv_nvfp4_tma import tma_kernel
    from ninfer_kernels.x16 import x16_prep
    nbytes = N * K // 2 + N * K // 16
    ws = []
    for i in range(1 if SMOKE else int(min(16, max(2, math.ceil(xpre.ROTATE_BYTES / nbytes))))):
        w = randweights.make("nvfp4", N, K, device=DEV, seed=i)
        ws.append({"planes": repack_nvfp4(w["codes"], w["scales"]), "gscale": w["gscale"]})
    kern = tma_kernel(torch.device(DEV))
    recs = []
    for T in ts:
        cfg = xpre.shipped_config(N, K, T, "nvfp4" if SMOKE else "nvfp4+xpre")
        dt = torch.float32 if SMOKE else torch.bfloat16
        x = torch.randn(T, K, device=DEV).to(dt)
        xp = x16_prep(x)
        ref = torch.empty(T, N, device=DEV, dtype=dt)
        out = torch.empty(T, N, device=DEV, dtype=dt)
        us_prod = None
        if cfg is not None and (cfg.h2 or cfg.mma):
            us_prod = xpre.graph_us([lambda w=w: gemv_nvfp4_prepared(xp, w["planes"], w["gscale"], ref, config=cfg)
                                     for w in ws])
            gemv_nvfp4_prepared(xp, ws[0]["planes"], ws[0]["gscale"], ref, config=cfg)   # after: timing rotates w
        tried = []
        for c in tma_configs(N, K, sm_count(torch.device(DEV))):
            try:
                us = xpre.graph_us([lambda w=w, c=c: launch_tma(xp, w["planes"], w["gscale"], out, *c, kern)
                                    for w in ws])
            except Exception as e:        # noqa: BLE001 - a tile the device cannot hold is not a candidate
                xpre.log(f"{name} T={T} {c}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
                continue
            tried.append((us, c))
        if not tried:
            continue
        best = min(tried)
        launch_tma(xp, ws[0]["planes"], ws[0]["gscale"], out, *best[1], kern)
        if us_prod is None:                # no shipped config here (smoke): the reference is the codec's
            from ninfer_kernels import reference
            from ninfer_kernels.gemv_nvfp4 import unpack_nvfp4
            u = unpack_nvfp4(ws[0]["planes"], K)
            ref = reference.ref_nvfp4(x.float(), u["codes"], u["scales"], ws[0]["gscale"])
        err = float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
        pct = (lambda us: round(100 * nbytes / (us * 1e-6) / (copy * 1e12), 1))
        rec = {"format": "nvfp4+xpre", "name": name, "shape": [N, K], "T": T, "config": list(best[1]),
               "us": round(best[0], 2), "pct_copy_bw": pct(best[0]), "config_prod": str(cfg),
               "us_prod": None if us_prod is None else round(us_prod, 2),
               "pct_copy_bw_prod": None if us_prod is None else pct(us_prod), "rel_l2": err,
               "copy_tbps": round(copy, 3), "gpu": gpu, "tried": [[list(c), round(u, 2)] for u, c in tried]}
        xpre.log(f"{name} T={T}: prod {us_prod} us, tma best {best[0]:.2f} us {best[1]}, rel_l2 {err:.2e}")
        recs.append(rec)
    return recs


def table(recs: list[dict]) -> str:
    lines = [f"{'shape':<14}{'T':>3}{'prod us':>9}{'%bw':>7}{'tma us':>9}{'%bw':>7}{'ratio':>7}  tma config (bn,w,st,split)"]
    for r in recs:
        p = r["us_prod"] or float("nan")
        lines.append(f"{r['name']:<14}{r['T']:>3}{p:>9.2f}{r['pct_copy_bw_prod'] or 0:>7.1f}{r['us']:>9.2f}"
                     f"{r['pct_copy_bw']:>7.1f}{r['us'] / p:>7.3f}  {tuple(r['config'])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=None, choices=sorted(SHAPES))
    ap.add_argument("--T", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if not SMOKE and not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)):
        print("error: bench/gemv_tma.py needs a CUDA device of compute capability 9.0+ (or --smoke)", file=sys.stderr)
        return 2
    if any(not 1 <= t <= 8 for t in args.T):
        print(f"error: --T: values must be in 1..8, got {args.T}", file=sys.stderr)
        return 2
    shapes = args.shapes or (["tiny"] if SMOKE else [s for s in SHAPES if s != "tiny"])
    copy = xpre.copy_tbps()
    gpu = "cpu (interpreter)" if SMOKE else torch.cuda.get_device_name()
    recs = []
    for s in shapes:
        recs += measure(s, *SHAPES[s], args.T, copy, gpu)
        if args.out:                      # after every shape: a timeout keeps what was measured
            write_json_atomic(args.out, recs)
    print(f"copy {copy:.2f} TB/s, {gpu}")
    print(table(recs))
    return 0 if recs else 1


if __name__ == "__main__":
    sys.exit(main())
