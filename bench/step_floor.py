"""The floor of a kernel-per-op decode step: the 27B step's weight reads as pure streaming-read kernels (no decode,
no arithmetic), one launch per GEMV of the step, in the step's order, captured in one CUDA graph.

It answers how fast the decode step's GEMVs could be if each were a perfect streaming read (bench/NOTES.md §32):
the step's GEMV time can be no lower than `chained` below without loading weights across kernel boundaries.

  one       one launch reading all the step's weight bytes: the read stream's own ceiling
  plain     one launch per GEMV, launched plainly (each starts after the one in front completes)
  chained   the same with PDL as the GEMVs use it: every CTA waits at its start and triggers after its loop
  preload   `chained`, but each CTA issues its first tiles' loads before the wait (weights need nothing in front)
  early     PDL, every CTA triggers at its start and then waits (the short kernels' protocol)
  free      PDL, trigger at the start and no wait: the launches overlap freely (not a legal GEMV chain)

Then each GEMV shape alone (`chained`, 40 launches over rotating slices of the weight buffer), whose per-launch
time against its bytes gives the fixed cost per launch. Ceilings in the same run: the device copy bandwidth.
Table on stdout; records to --out: {"kind": "step_floor", "mode", "launches", "bytes", "us", "pct_copy_bw",
"copy_tbps", "gpu"} and {"kind": "read_shape", "name", "launches", "bytes", "us", "pct_copy_bw", "copy_tbps", "gpu"}.

    python bench/step_floor.py [--recipe nvfp4] [--out $OUT/step_floor.json]
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import bench_device as D  # noqa: E402  (bench/: the script's folder, or a test's path)
from ninfer_formats.atomic import write_json_atomic  # noqa: E402
from ninfer_formats.constants import FORMATS  # noqa: E402
from ninfer_kernels.pdl import pdl_trigger, pdl_wait  # noqa: E402

# tensor name suffix -> the runtime launch that reads it (the runtime fuses q/k/v, qkv/z and gate/up)
LAUNCH_OF = (("linear_attn.in_proj_qkv", "gdn_qkvz"), ("linear_attn.in_proj_z", "gdn_qkvz"),
             ("self_attn.q_proj", "attn_qkv"), ("self_attn.k_proj", "attn_qkv"), ("self_attn.v_proj", "attn_qkv"),
             ("linear_attn.out_proj", "gdn_out"), ("self_attn.o_proj", "attn_o"),
             ("mlp.gate_proj", "mlp_gate_up"), ("mlp.up_proj", "mlp_gate_up"), ("mlp.down_proj", "mlp_down"))
ORDER = ("gdn_qkvz", "attn_qkv", "gdn_out", "attn_o", "mlp_gate_up", "mlp_down")   # within a layer
MODES = {"plain": (0, 0, 0), "chained": (1, 1, 1), "preload": (1, 1, 2), "early": (1, 0, 1),
         "free": (1, 0, 0)}   # PDL, LATE, WAIT
BLOCK, UNROLL, VEC_BYTES = 256, 4, 16
CTAS_PER_SM = 8
SHAPE_LAUNCHES = 40
COPY_MB = 4096            # as bench/decode.py's ceiling


@triton.jit
def read_kernel(src, out_ptr, n_vec, per_cta, BLOCK: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr,
                LATE: tl.constexpr, WAIT: tl.constexpr):
    # 16-byte loads (int64 pairs), UNROLL BLOCK-wide tiles in flight per iteration; XOR keeps them live
    # WAIT: 0 none, 1 at the start, 2 after the first iteration's loads were issued (they need nothing in front)
    if not LATE:
        pdl_trigger(PDL)
    if WAIT == 1:
        pdl_wait(PDL)
    base = tl.program_id(0).to(tl.int64) * per_cta
    acc = tl.zeros([BLOCK, 2], tl.int64)
    for i in range(0, per_cta, UNROLL * BLOCK):
        for u in tl.static_range(UNROLL):
            o = base + i + u * BLOCK + tl.arange(0, BLOCK)
            m = (o < n_vec) & (o < base + per_cta)
            acc ^= tl.load(src + o[:, None] * 2 + tl.arange(0, 2)[None, :], mask=m[:, None], other=0)
        if WAIT == 2 and i == 0:
            pdl_wait(PDL)
    if LATE:
        pdl_trigger(PDL)
    tl.atomic_add(out_ptr + tl.program_id(0), tl.sum(tl.sum(acc, axis=1), axis=0).to(tl.float32))


def step_launches(recipe: str) -> list[tuple[str, int]]:
    """[(launch name, weight bytes)] of one 27B decode step in launch order (MTP excluded), lm_head last."""
    from synth_artifact import SynthShape, rank_tensors
    groups: dict = {}
    head = 0
    for name, fmt, shape in rank_tensors(SynthShape().config(), recipe, 1)[0]:
        nbytes = FORMATS[fmt].encoded_size(shape)
        if name == "lm_head.weight":
            head = nbytes
            continue
        m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", name)
        role = next((r for suffix, r in LAUNCH_OF if m and m.group(2) == suffix), None)
        if role is not None:
            key = (int(m.group(1)), ORDER.index(role), role)
            groups[key] = groups.get(key, 0) + nbytes
    return [(k[2], v) for k, v in sorted(groups.items())] + [("lm_head", head)]


def read_plan(n_vec: int, sms: int) -> tuple[int, tuple]:
    """(16-byte vectors per CTA, grid) of a read of `n_vec` vectors: ~CTAS_PER_SM CTAs per SM, whole iterations."""
    per = triton.cdiv(triton.cdiv(n_vec, sms * CTAS_PER_SM), UNROLL * BLOCK) * UNROLL * BLOCK
    return per, (triton.cdiv(n_vec, per),)


def read_launcher(buf: torch.Tensor, out: torch.Tensor, off: int, nbytes: int, mode: str, sms: int):
    """A no-argument call that reads bytes [off, off + nbytes) of `buf` (16-byte aligned) under `mode`."""
    pdl, late, wait = MODES.get(mode, (0, 0, 0))
    n_vec = nbytes // VEC_BYTES
    per, grid = read_plan(n_vec, sms)
    src = buf[off // 8: off // 8 + 2 * n_vec]
    if grid[0] > out.numel():
        raise ValueError(f"step_floor: {grid[0]} CTAs for a {out.numel()}-slot output")
    kw = {"launch_pdl": True} if pdl else {}
    return lambda: read_kernel[grid](src, out, n_vec, per, BLOCK=BLOCK, UNROLL=UNROLL, PDL=pdl, LATE=late,
                                     WAIT=wait, num_warps=8, **kw)


def graph_us(fns) -> float:
    """us of `fns` run once in order: `bench_device.graph_us` captures max(20, len) calls of them in turn in one CUDA
    graph and gives the median replay's us per call."""
    return D.graph_us(fns, lambda fn: triton.testing.do_bench(fn, warmup=3, rep=60, return_mode="median")) * len(fns)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 256) * 256


def measure(launches, copy: float, gpu: str) -> list[dict]:
    total = sum(_aligned(b) for _, b in launches)
    buf = torch.empty(total // 8, dtype=torch.int64, device="cuda")
    out = torch.zeros(1 << 16, dtype=torch.float32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    offs = [0]
    for _, b in launches:
        offs.append(offs[-1] + _aligned(b))
    nbytes = sum(b for _, b in launches)
    recs = []

    def rec(kind, name, n, byts, us):
        r = {"kind": kind, "name": name, **({"mode": name} if kind == "step_floor" else {}), "launches": n,
             "bytes": byts, "us": round(us, 2), "pct_copy_bw": round(100 * byts / (us * 1e-6) / (copy * 1e12), 1),
             "copy_tbps": round(copy, 3), "gpu": gpu}
        print(f"{kind:10} {name:12} {n:4d} launches {byts / 1e6:9.1f} MB {us:9.1f} us {r['pct_copy_bw']:5.1f} %",
              flush=True)
        recs.append(r)
    rec("step_floor", "one", 1, total, graph_us([read_launcher(buf, out, 0, total, "plain", sms)]))
    for mode in MODES:
        fns = [read_launcher(buf, out, o, b, mode, sms) for o, (_, b) in zip(offs, launches)]
        rec("step_floor", mode, len(fns), nbytes, graph_us(fns))
    for name in dict.fromkeys(n for n, _ in launches):
        b = next(b for n, b in launches if n == name)
        span = max(1, min(SHAPE_LAUNCHES, total // _aligned(b)))    # rotating slices, >> L2 in all
        fns = [read_launcher(buf, out, (i % span) * _aligned(b), b, "chained", sms) for i in range(SHAPE_LAUNCHES)]
        rec("read_shape", name, SHAPE_LAUNCHES, b * SHAPE_LAUNCHES, graph_us(fns))
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="nvfp4")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "step_floor.json"))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("error: bench/step_floor.py needs a CUDA GPU of capability 9.0+ (PDL)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    copy, gpu = D.copy_tbps(dev, COPY_MB), D.device_name(dev)
    print(f"{gpu}: copy {copy:.2f} TB/s (read + write)")
    write_json_atomic(a.out, [dict(r, recipe=a.recipe) for r in measure(step_launches(a.recipe), copy, gpu)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
