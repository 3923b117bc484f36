"""Does the NVFP4 planes' layout cost DRAM bandwidth? The T = 1 GEMV's weight walk without the decode, in two layouts.

A T = 1 GEMV CTA owns BN rows and a run of 128-weight chunks; per chunk it reads each row's 64 code bytes and
8 scale bytes. In the runtime's chunk-major planes (`gemv_nvfp4.repack_nvfp4`: [C, N, 8] words) one chunk of
BN rows is one contiguous run and the CTA's next chunk lies N x 64 bytes further on, so the ~500 CTAs of a
launch each hop across the whole weight. In a row-blocked layout ([N / RB, C, RB, 8]) a CTA of BN <= RB rows
walks one contiguous region, as a plain streaming read does. This times the walk alone (XOR of the words, no
decode, UNROLL chunks' loads in flight per thread) on both layouts at the shipped grids, and a plain streaming
read of the same bytes (bench/step_floor.py's kernel), each as 40 launches over rotating copies in one graph
(bench/NOTES.md §32).

Records to --out: {"name", "shape", "layout", "block_n", "split", "unroll", "us", "pct_copy_bw", "copy_tbps",
"gpu"}.

    python bench/read_pattern.py [--out $OUT/read_pattern.json]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import bench_device as D  # noqa: E402  (bench/: the script's folder, or a test's path)
from ninfer_formats.atomic import write_json_atomic  # noqa: E402
from step_floor import COPY_MB, graph_us, read_launcher  # noqa: E402

RB = 128                     # the row block of the blocked layout
# name: (N, K, [(block_n, split)]) -- the T = 1 grids the shipped table uses and their neighbours
SHAPES = {"mlp_gate_up": (34816, 5120, [(128, 1), (64, 1), (128, 3)]),
          "mlp_down": (5120, 17408, [(128, 4), (64, 2)]),
          "attn_o": (5120, 6144, [(128, 6), (64, 3)]),
          "attn_qkv": (14336, 5120, [(128, 3), (64, 1)])}
ROTATE_BYTES = 400e6
LAUNCHES = 40


@triton.jit
def walk_kernel(codes, scales, out_ptr, C, c_per, RBLK, BN: tl.constexpr, UNROLL: tl.constexpr):
    # row r's chunk c at word ((r // RBLK) * C + c) * RBLK * 8 + (r % RBLK) * 8: RBLK = N is chunk-major
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    cstride = tl.cast(RBLK, tl.int64) * 8
    base = (rows // RBLK).to(tl.int64) * C * cstride + (rows % RBLK) * 8
    c_lo = tl.program_id(1) * c_per
    c_hi = tl.minimum(C, c_lo + c_per)
    acc = tl.zeros([BN, 8], tl.int64)
    for c in range(c_lo, c_hi, UNROLL):
        for u in tl.static_range(UNROLL):
            off = base[:, None] + (c + u) * cstride + tl.arange(0, 8)[None, :]
            m = (tl.zeros([BN, 8], tl.int32) + (c + u)) < c_hi
            acc ^= tl.load(codes + off, mask=m, other=0)
            acc ^= tl.load(scales + off, mask=m, other=0).to(tl.int64)
    tl.atomic_add(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
                  tl.sum(tl.sum(acc, axis=1), axis=0).to(tl.float32))


def walk_launcher(codes, scales, out, N: int, K: int, layout: str, bn: int, split: int, unroll: int):
    C = K // 128
    c_per = triton.cdiv(C, split)
    grid = (triton.cdiv(N, bn), triton.cdiv(C, c_per))
    rblk = N if layout == "chunk" else RB
    return lambda: walk_kernel[grid](codes, scales, out, C, c_per, rblk, BN=bn, UNROLL=unroll, num_warps=4)


def measure(name: str, N: int, K: int, grids, copy: float, gpu: str) -> list[dict]:
    C = K // 128
    nbytes = N * C * 72
    copies = max(2, min(16, int(ROTATE_BYTES // nbytes) + 1))
    planes = [(torch.empty(C * N * 8, dtype=torch.int64, device="cuda"),
               torch.empty(C * N * 8, dtype=torch.uint8, device="cuda")) for _ in range(copies)]
    out = torch.zeros(1 << 16, dtype=torch.float32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    recs = []

    def rec(layout, bn, split, unroll, fns, byts=nbytes):
        us = graph_us(fns) / len(fns)
        pct = 100 * byts / (us * 1e-6) / (copy * 1e12)
        recs.append({"name": name, "shape": [N, K], "layout": layout, "block_n": bn, "split": split,
                     "unroll": unroll, "us": round(us, 2), "pct_copy_bw": round(pct, 1), "copy_tbps": round(copy, 3),
                     "gpu": gpu, **({} if byts == nbytes else {"bytes_read": byts})})
        print(f"{name:12} {layout:8} n{bn:<4} split{split:<3} unroll{unroll} {us:8.2f} us {pct:5.1f} %", flush=True)
    for bn, split in grids:
        for unroll in (1, 2):
            for layout in ("chunk", "blocked"):
                rec(layout, bn, split, unroll, [walk_launcher(*planes[i % copies], out, N, K, layout, bn, split,
                                                              unroll) for i in range(LAUNCHES)])
    # the code plane alone, read as a plain stream (step_floor's kernel): its pct is of those bytes
    rec("read", 0, 0, 0, [read_launcher(planes[i % copies][0], out, 0, C * N * 64, "plain", sms)
                          for i in range(LAUNCHES)], byts=C * N * 64)
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "read_pattern.json"))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench/read_pattern.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    copy, gpu = D.copy_tbps(dev, COPY_MB), D.device_name(dev)
    print(f"{gpu}: copy {copy:.2f} TB/s (read + write)")
    recs = []
    for s in a.shapes:
        recs += measure(s, *SHAPES[s], copy, gpu)
        torch.cuda.empty_cache()
    write_json_atomic(a.out, recs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
