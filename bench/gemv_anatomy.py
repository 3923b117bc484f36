"""Where the time of a T=1 packed-half2 NVFP4 GEMV goes, on the GPU (bench/NOTES.md §5).

The H200 runs the production kernel (`gemv_nvfp4_h2`) at 38-56 % of copy bandwidth on the 10-100 MB shapes
and 79 % on lm_head. This script times, on the same shape, grid and tile, variants that each leave one stage
out, and takes differences (no hardware counters on these machines):

  full          the production kernel through `gemv_nvfp4` with an explicit config
  loop          the production T=1 loop rebuilt here (amax pass, decode, HFMA2; atomic epilogue)
  loop_pin      loop with a barrier after each tile's loads: ptxas cannot sink them toward their uses
  loop_pin_pf   loop_pin with the next tile's loads issued before the current tile is decoded
  stream(...)   the same loads (and pin / prefetch), no decode: XOR of the words (the grid's memory side)
  read          a plain 1-D streaming read of the same bytes (16-byte loads, 4 tiles in flight per thread)

The weights are the kernels' chunk-major planes (`gemv_nvfp4.repack_nvfp4`; §5-§12 measured row-major ones).
Each is captured ~40 times over rotating weight copies (>= 4x the L2) in one CUDA graph and replayed.
Table on stdout; records to --out: {"shape", "variant", "block_n", "block_g", "split", "us", "pct_copy_bw",
"gpu"}.

    python bench/gemv_anatomy.py [--shapes attn_qkv mlp_gate_up ...] [--out $OUT/anatomy.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"attn_qkv": (14336, 5120), "attn_o": (5120, 6144), "mlp_gate_up": (34816, 5120),
          "mlp_down": (5120, 17408), "lm_head": (248320, 5120), "attn_qkv_tp2": (7168, 5120)}
ROTATE_BYTES = 240e6
VARIANTS = ("full", "loop", "loop_pin", "loop_pin_pf", "stream", "stream_pin", "stream_pin_pf", "read")
_MODE = {"loop": (0, 0, 0), "loop_pin": (0, 1, 0), "loop_pin_pf": (0, 1, 1), "stream": (3, 0, 0),
         "stream_pin": (3, 1, 0), "stream_pin_pf": (3, 1, 1)}   # (MODE, PIN, PF)


# the diagnostic kernel is built from the production pieces
from ninfer_kernels.gemv_common import _tile_g, e4m3_magnitude  # noqa: E402
from ninfer_kernels.gemv_h2_common import hfma2, lanes_f32, row_scale, x_pairs  # noqa: E402
from ninfer_kernels.gemv_nvfp4 import _load  # noqa: E402
from ninfer_kernels.gemv_nvfp4_h2 import _split_signs, _wpair  # noqa: E402
from ninfer_kernels.gemv_timing import replay_ms  # noqa: E402


@triton.jit
def _tile_load(codes, scales, N, rows, g0, BLOCK_G: tl.constexpr, G):
    return _load(codes, scales, N, None, None, None, rows, _tile_g(g0, BLOCK_G, 2), None, G)


@triton.jit
def _use(acc, bits, x_ptr, st, g0, up, MODE: tl.constexpr, BLOCK_G: tl.constexpr, H2_MODE: tl.constexpr):
    lo, hi, sb = st
    if MODE == 3:
        bits = bits ^ lo ^ hi ^ sb
    else:
        p = x_pairs(x_ptr, 0, _tile_g(g0, BLOCK_G, 2), None, up, H2_MODE)
        sc = e4m3_magnitude(sb)
        le, lo_odd = _split_signs(lo, H2_MODE)
        he, hi_odd = _split_signs(hi, H2_MODE)
        a = hfma2(_wpair(le, lo_odd, 0), p[0][None, :], tl.zeros_like(lo), H2_MODE)
        for j in tl.static_range(1, 4):
            a = hfma2(_wpair(le, lo_odd, j), p[j][None, :], a, H2_MODE)
        for j in tl.static_range(4):
            a = hfma2(_wpair(he, hi_odd, j), p[4 + j][None, :], a, H2_MODE)
        acc += lanes_f32(a, H2_MODE) * sc
    return acc, bits


@triton.jit
def anatomy_kernel(x_ptr, codes, scales, out_ptr, N, G, split, MODE: tl.constexpr, PIN: tl.constexpr,
                   PF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, H2_MODE: tl.constexpr):
    """MODE 0: the production h2 T=1 loop (amax pass, decode, HFMA2); 3: the same loads, XOR only. PIN: a
    barrier after each tile's loads (ptxas may not sink them below it); PF: the next tile's loads issued
    before the current tile is used (with PIN, both tiles in flight)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)
    g_per = tl.cdiv(tl.cdiv(G, split), BLOCK_G) * BLOCK_G
    g_lo = tl.program_id(1) * g_per
    g_hi = tl.minimum(G, g_lo + g_per)
    up, back = row_scale(x_ptr, 0, g_lo * 16, g_hi * 16, 512, 267, 1)
    acc = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    bits = tl.zeros([BLOCK_N, BLOCK_G], tl.int32)
    if PF:
        last = g_lo + ((g_hi - g_lo - 1) // BLOCK_G) * BLOCK_G
        st = _tile_load(codes, scales, N, rows, g_lo, BLOCK_G, G)
        for g0 in range(g_lo, g_hi, BLOCK_G):
            nxt = _tile_load(codes, scales, N, rows, tl.minimum(g0 + BLOCK_G, last), BLOCK_G, G)
            if PIN:
                tl.debug_barrier()
            acc, bits = _use(acc, bits, x_ptr, st, g0, up, MODE, BLOCK_G, H2_MODE)
            st = nxt
    else:
        for g0 in range(g_lo, g_hi, BLOCK_G):
            st = _tile_load(codes, scales, N, rows, g0, BLOCK_G, G)
            if PIN:
                tl.debug_barrier()
            acc, bits = _use(acc, bits, x_ptr, st, g0, up, MODE, BLOCK_G, H2_MODE)
    v = tl.sum(acc, axis=1) * back + tl.sum(bits, axis=1).to(tl.float32)
    tl.atomic_add(out_ptr + offs_n, v, mask=offs_n < N, sem="relaxed")


@triton.jit
def read_kernel(src, out_ptr, n_vec, per_cta, BLOCK: tl.constexpr):
    # 16-byte loads (int64 pairs), four BLOCK-wide tiles in flight per iteration
    base = tl.program_id(0) * per_cta
    acc = tl.zeros([BLOCK, 2], tl.int64)
    for i in range(0, per_cta, 4 * BLOCK):
        for u in tl.static_range(4):
            o = base + i + u * BLOCK + tl.arange(0, BLOCK)
            o2 = o[:, None] * 2 + tl.arange(0, 2)[None, :]
            acc ^= tl.load(src + o2, mask=(o < n_vec)[:, None] & (o < base + per_cta)[:, None], other=0)
    tl.atomic_add(out_ptr + tl.program_id(0), tl.sum(tl.sum(acc, axis=1), axis=0).to(tl.float32))


def graph_us(fns, reps: int = 20) -> float:
    """us per call of `fns` (in turn, >= 40 calls) captured in one CUDA graph, median of `reps` replays."""
    n = max(40, len(fns))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for i in range(n):
            fns[i % len(fns)]()
    return replay_ms(g, reps) * 1e3 / n


def copy_tbps() -> float:
    n = 1 << 30
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * n / (ms * 1e-3) / 1e12   # as bench/kernels.py (a graph of 1 GiB memcpy nodes read 35 % lower)


def measure(name: str, N: int, K: int, configs, copy: float, gpu: str) -> list[dict]:
    from ninfer_kernels import randweights
    from ninfer_kernels.gemv_h2_common import h2_mode
    from ninfer_kernels.gemv_launch import GemvConfig, effective_split
    from ninfer_kernels.gemv_nvfp4 import gemv_nvfp4, repack_nvfp4
    anatomy, read = anatomy_kernel, read_kernel
    G = K // 16
    nbytes = N * K // 2 + N * G
    n_copies = int(min(16, max(2, math.ceil(ROTATE_BYTES / nbytes))))
    ws = []
    for i in range(n_copies):            # the kernels' chunk-major planes
        w = randweights.make("nvfp4", N, K, device="cuda", seed=i)
        p = repack_nvfp4(w["codes"], w["scales"])
        ws.append({"codes": p["codes"], "scales": p["scales"], "planes": p, "gscale": w["gscale"]})
    flat = [torch.cat([w["codes"].view(torch.uint8).reshape(-1), w["scales"].reshape(-1)]).view(torch.int64)
            for w in ws]
    x = (torch.randn(1, K, device="cuda") * 3).to(torch.bfloat16)
    out = torch.zeros(1, N, dtype=torch.float32, device="cuda")
    mode = h2_mode(x.device)
    recs = []
    for bn, split, bg in configs:
        cfg = GemvConfig(bn, bg, 4, 1, split, h2=True)
        sp = effective_split(cfg, G)
        for v in VARIANTS:
            if v == "full":
                fns = [lambda w=w: gemv_nvfp4(x, w["planes"], w["gscale"], config=cfg) for w in ws]
            elif v == "read":
                n_vec = flat[0].numel() // 2
                ctas = 132 * 8
                per = triton.cdiv(triton.cdiv(n_vec, ctas), 4 * 256) * 4 * 256
                fns = [lambda f=f: read[(triton.cdiv(n_vec, per),)](f, out, n_vec, per, BLOCK=256, num_warps=8)
                       for f in flat]
            else:
                grid = (triton.cdiv(N, bn), sp)
                m, pin, pf = _MODE[v]
                fns = [lambda w=w: anatomy[grid](x, w["codes"].view(torch.int64), w["scales"], out, N, G, sp,
                                                 MODE=m, PIN=pin, PF=pf, BLOCK_N=bn, BLOCK_G=bg, H2_MODE=mode,
                                                 num_warps=4)
                       for w in ws]
            try:
                us = graph_us(fns)
            except Exception as e:   # one failing variant must not lose the others
                print(f"{name} {v} n{bn} g{bg} split{sp}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                continue
            pct = 100 * nbytes / (us * 1e-6) / (copy * 1e12)
            recs.append({"shape": [N, K], "name": name, "variant": v, "block_n": bn, "block_g": bg, "split": sp,
                         "us": round(us, 2), "pct_copy_bw": round(pct, 1), "gpu": gpu})
            print(f"{name:12} n{bn:<4} g{bg:<3} split{sp:<3} {v:13} {us:8.2f} us {pct:5.1f} %", flush=True)
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["attn_qkv", "mlp_gate_up", "lm_head"], choices=list(SHAPES))
    ap.add_argument("--configs", default="128:3,128:1,64:3,256:2",
                    help="block_n:split[:block_g] (block_g default 16; split is clamped like the tuner's)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "gemv_anatomy.json"))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench/gemv_anatomy.py needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        configs = [tuple(int(v) for v in (c + ":16").split(":")[:3]) if c.count(":") == 1
                   else tuple(int(v) for v in c.split(":")) for c in a.configs.split(",")]
        assert configs and all(len(c) == 3 and min(c) > 0 for c in configs)
    except (ValueError, AssertionError):
        print(f"error: --configs {a.configs!r}: expected block_n:split[:block_g], e.g. 128:3,64:1:8", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    copy = copy_tbps()
    print(f"{gpu}: copy {copy:.2f} TB/s (read + write)")
    recs = []
    for s in a.shapes:
        recs += measure(s, *SHAPES[s], configs, copy, gpu)
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".partial", "w") as f:
        json.dump(recs, f, indent=1)
    os.replace(a.out + ".partial", a.out)
    return 0 if recs else 1


if __name__ == "__main__":
    sys.exit(main())
