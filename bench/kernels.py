"""GPU benchmark of the fused dequant-GEMV kernels at the Qwen3.8-27B linear shapes (TP1 and one TP2 rank).

For every format and shape, T = 1, 2, 4, 8, 16 activation rows (bf16): time per call the way the decode step
runs them -- max(20, copies) back-to-back calls over rotating weight copies (240 MB or 16 copies, >= 2x the
L2) captured in one CUDA graph, replayed, divided (`us`; `us_eager` is the same call launched from Python,
triton do_bench) -- GB/s of packed weight bytes, % of the device-to-device copy bandwidth measured in the same
run (read + write), torch's bf16 matmul on the same shape timed the same way, and the config the tuner chose.
`--check` first compares every kernel with the codec reference at the real shape (sampled output rows) so one
device run both validates and times. Prefill (T > 16): fused tl.dot GEMM vs dequantize + cuBLAS vs torch bf16.

    python bench/kernels.py [--quick] [--check] [--xpre] [--out bench/results/kernels.json] [--json]
    python bench/kernels.py --smoke     # CPU + Triton interpreter, tiny shapes: exercises this script only

--xpre also times NVFP4 / Q6_K / IQ3_S on prepared activations (`ninfer_kernels.x16`, what the norms and gates hand the
decode step's linear layers), as formats "<fmt>+xpre"; their winners ship like the others.
IQ3_S weights are read in the runtime's layout (NINFER_IQ3S_LAYOUT): the 4-bit code planes by default
(`ninfer_kernels.gemv_iq3_s4`), records "iq3_s4", whose gbps / pct_copy_bw count the IQ3_S blocks' bytes (so they
compare with "iq3_s" by time) and pct_copy_bw_read the 22 % more bytes the kernel reads; NINFER_IQ3S_LAYOUT=grid
gives records "iq3_s" (the grid planes).

Table on stdout, progress on stderr, records to --out: a list of {"format", "name", "tp", "shape": [N, K],
"T", "us", "us_eager", "gbps", "pct_copy_bw", "torch_bf16_us", "gpu", ...}.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = "--smoke" in sys.argv
if SMOKE:  # must precede the first ninfer_kernels import
    os.environ["TRITON_INTERPRET"] = "1"
DEV = "cpu" if SMOKE else "cuda"
# the benchmark measures the candidates itself: bypass the shipped defaults and the user's tuner cache
os.environ.setdefault("NINFER_GEMV_TUNE", "force")
from gemv_precompile import kernel_spec, log, precompile  # noqa: E402  (after the environment above)
# (name, tp, N, K): per-rank shapes, quant-formats.md / qwen38-architecture.md §13
SHAPES = [("attn_qkv", 1, 14336, 5120), ("attn_o", 1, 5120, 6144), ("gdn_qkvz", 1, 16384, 5120),
          ("gdn_ab", 1, 96, 5120), ("gdn_out", 1, 5120, 6144), ("mlp_gate_up", 1, 34816, 5120),
          ("mlp_down", 1, 5120, 17408), ("lm_head", 1, 248320, 5120),
          ("attn_qkv", 2, 7168, 5120), ("attn_o", 2, 5120, 3072), ("gdn_qkvz", 2, 8192, 5120),
          ("gdn_ab", 2, 48, 5120), ("gdn_out", 2, 5120, 3072), ("mlp_gate_up", 2, 17408, 5120),
          ("mlp_down", 2, 5120, 8704), ("lm_head", 2, 124160, 5120)]
FORMATS = ("nvfp4", "q6_k", "iq3_s", "f8_e4m3_row", "bf16")
XPRE_FORMATS = ("nvfp4", "q6_k", "iq3_s")     # with GEMV variants that read prepared activations (--xpre)
BF16_ONLY = {"gdn_ab"}
TS = (1, 2, 4, 8, 16)
L2_ROTATE_BYTES = 240e6   # weight copies per shape: at least 4x the 60 MB L2
# the tuner's finishers within this of its pick are timed again the way the decode step runs them (rotating copies
# in one graph): its flush-timed picks ran 10-19 % slower than a neighbouring split there (bench/NOTES.md §12)
GRAPH_RUNOFF_MARGIN = 0.25
GRAPH_RUNOFF_MAX = 3        # default of --runoff


def bench_ms(fn, quick: bool) -> float:
    import triton
    if SMOKE:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100, return_mode="median")


def copy_bandwidth(quick: bool) -> float:
    """Device-to-device copy GB/s counting read + write, 1 GiB buffers."""
    n = 1 << (20 if SMOKE else 30)
    src = torch.empty(n, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), quick)
    del src, dst
    return 2 * n / (ms * 1e-3) / 1e9




# ---- one format at one shape -----------------------------------------------------------------------------
def make_copies(fmt: str, N: int, K: int):
    from ninfer_kernels import dispatch, randweights
    from ninfer_rt.weights import QWeight
    nbytes = randweights.packed_bytes(fmt, N, K)
    n = int(min(16, max(2, math.ceil(L2_ROTATE_BYTES / nbytes))))
    qws = []
    for i in range(n):
        qw = QWeight(fmt, (N, K), randweights.make(fmt, N, K, device=DEV, seed=i), name=f"bench.{fmt}")
        dispatch.prepare(qw)
        if SMOKE and fmt in dispatch.REPACKED and not qw.released:
            dispatch.release(qw, dispatch._packed(qw))    # as on CUDA: the smoke runs the paths the device runs
        qws.append(qw)
    return qws, nbytes


def _probe(fmt: str, qw, N: int, K: int, T: int, path: str, rows, idx, run) -> dict:
    """One check record: run(x, res) [T, N] vs the codec reference on the sampled rows."""
    from ninfer_kernels import reference
    x = torch.randn(T, K, device=DEV).to(torch.bfloat16)
    res = torch.randn(T, N, device=DEV).to(torch.bfloat16)
    try:
        y = run(x, res)[:, idx]
        ref = reference.ref_linear(x, fmt, qw, residual=res, rows=rows)
        err = float((y.double() - ref.double()).norm() / ref.double().norm())
        return {"T": T, "path": path, "rel_l2": err, "ok": err < 1e-2}
    except Exception as e:
        return {"T": T, "path": path, "ok": False, "error": f"{type(e).__name__}: {e}"[:300]}


def check(fmt: str, qw, N: int, K: int) -> list[dict]:
    """Kernel (decode, both prefill paths, and the packed-half2 variant where the format has one) vs the
    codec reference on 256 sampled rows."""
    from ninfer_kernels import dispatch
    rows = np.unique(np.concatenate([np.arange(4), np.arange(N - 4, N),
                                     np.random.default_rng(N).integers(0, N, 248)]))
    idx = torch.as_tensor(rows, device=DEV)
    probes = ((1, None), (3, None), (20, "fused"), (20, "dequant")) if SMOKE else \
        ((1, None), (8, None), (16, None), (64, "fused"), (64, "dequant"))

    def linear(path):
        def run(x, res):
            dispatch.linear(x, qw, residual=res, prefill_path=path)          # first call: tuner + checked path
            return dispatch.linear(x, qw, residual=res, prefill_path=path)   # decode: the cached plan
        return run
    out = [_probe(fmt, qw, N, K, T, path or "decode", rows, idx, linear(path)) for T, path in probes]
    if fmt in ("nvfp4", "q6_k"):   # explicitly, whatever the tuner picked
        run = _h2_runner(fmt, qw, K)
        out += [_probe(fmt, qw, N, K, T, "decode-h2", rows, idx, run) for T in ((1, 3) if SMOKE else (1, 3, 8))]
    return out


def _h2_runner(fmt: str, qw, K: int):
    from ninfer_kernels import dispatch
    from ninfer_kernels.gemv_launch import GemvConfig
    from ninfer_kernels.gemv_nvfp4 import gemv_nvfp4
    from ninfer_kernels.gemv_q6_k import gemv_q6_k
    cfg = GemvConfig(16 if SMOKE else 128, 4 if SMOKE else 16, 4, 1, 3, h2=True)
    planes = dispatch._packed(qw)       # the kernels' form (the stored tensors are released on CUDA)
    if fmt == "q6_k":
        return lambda x, res: gemv_q6_k(x, planes, residual=res, config=cfg)
    return lambda x, res: gemv_nvfp4(x, planes, qw.data["gscale"], residual=res, config=cfg)


# bytes an IQ3_S GEMV reads per byte of blocks with NINFER_IQ3S_LAYOUT=codes4 (ninfer_kernels.gemv_iq3_s4)
CODES4_READ = 134 / 110


def record_format(fmt: str) -> str:
    """The records' format: IQ3_S weights in the 4-bit code planes are "iq3_s4" (the tuner's name for them too)."""
    return "iq3_s4" if kernel_spec(fmt)[0].__name__ == "iq3_s4_gemv_kernel" else fmt


def graph_us(fns, quick: bool) -> float | None:
    """us per call of `fns` (called in turn, max(20, len(fns)) calls) captured in one CUDA graph and replayed:
    what a decode step sees (no host launch cost between kernels). None without CUDA graphs (smoke)."""
    if SMOKE:
        return None
    import bench_device as D
    return D.graph_us(fns, lambda f: bench_ms(f, quick))


def time_format(fmt, qws, nbytes, N, K, ts, quick, copy_bw, torch_us, xpre: bool = False,
                runoff: int = GRAPH_RUNOFF_MAX) -> list[dict]:
    """Records per T; xpre: the same weights read through prepared activations (`ninfer_kernels.x16`, prepared
    once outside the timing, as the producing kernels hand them over), format "<fmt>+xpre", at the T it serves."""
    from ninfer_kernels import dispatch, gemv_launch as gl, x16
    recs, t1 = [], None
    for T in ts:
        if xpre and not x16.prepared_ok(qws[0], T, torch.device(DEV)):
            continue
        x = torch.randn(T, K, device=DEV).to(torch.bfloat16)
        out = torch.empty(T, N, device=DEV, dtype=torch.bfloat16)
        if xpre:   # the prepared launch itself (dispatch.linear may prefer the plain one: remembered faster)
            xp = x16.x16_prep(x)

            def call(q):
                return x16.prepared_linear(xp, q, out, None, x.dtype)
        else:
            def call(q):
                return dispatch.linear(x, q, out=out)
        call(qws[0])                                       # the first call tunes; not timed
        kname = kernel_spec(fmt)[0].__name__ + (x16.XPRE_SUFFIX if xpre else "")
        key = gl.tune_key(kname, N, K // kernel_spec(fmt)[2], T, x.dtype, False, x.device)
        finals = graph_runoff(key, qws, call, quick, runoff)
        it = iter(range(1 << 62))
        us_eager = bench_ms(lambda: call(qws[next(it) % len(qws)]), True) * 1e3
        us_g = graph_us([lambda q=q: call(q) for q in qws], quick)
        us = us_g if us_g is not None else us_eager
        t1 = us if T == 1 else t1
        cfg = gl.tuned_configs().get(key)
        cands = [[str(c), None if t is None else round(t * 1e3, 2)] for c, t in gl.tuning_log().get(key, [])]
        gbps = nbytes / (us * 1e-6) / 1e9
        rfmt = record_format(fmt)
        recs.append({"format": rfmt + (x16.XPRE_SUFFIX if xpre else ""), "T": T, "us": round(us, 2),
                     "us_eager": round(us_eager, 2), "gbps": round(gbps, 1),
                     "pct_copy_bw": round(100 * gbps / copy_bw, 1),
                     **({"pct_copy_bw_read": round(100 * gbps * CODES4_READ / copy_bw, 1)}
                        if rfmt == "iq3_s4" else {}),
                     "torch_bf16_us": torch_us.get(T), "t_over_t1": round(us / t1, 3) if t1 else None,
                     "config": str(cfg) if cfg else "default", "candidates_us": cands,
                     "runoff_us": [[str(c), round(u, 2)] for c, u in finals]})
    return recs


def graph_runoff(key, qws, call, quick: bool, limit: int = GRAPH_RUNOFF_MAX) -> list:
    """[(config, us)]: the tuner's finishers for `key` (within GRAPH_RUNOFF_MARGIN of its pick, at most
    `limit`) each timed like the records -- call(q) over the rotating copies `qws` in one graph -- and the
    fastest made the key's config ([] when the tuner timed fewer than two)."""
    from ninfer_kernels import gemv_launch as gl
    timed = sorted(((t, c) for c, t in gl.tuning_log().get(key, []) if t is not None), key=lambda e: e[0])
    finalists = [c for t, c in timed if t <= timed[0][0] * (1 + GRAPH_RUNOFF_MARGIN)][:limit] \
        if timed else []
    if len(finalists) < 2:
        return []
    out = []
    for c in finalists:
        _use_config(key, c, qws)
        us = graph_us([lambda q=q: call(q) for q in qws], quick)
        out.append((c, us if us is not None else bench_ms(lambda: call(qws[0]), True) * 1e3))
    _use_config(key, min(out, key=lambda e: e[1])[0], qws)
    return out


def _use_config(key, cfg, qws) -> None:
    from ninfer_kernels import gemv_launch as gl
    gl.override_config(key, cfg)
    for q in qws:                      # their plans hold the config they were made with
        q.cache.pop("triton.plans", None)


def torch_times(N: int, K: int, ts, quick) -> dict:
    """torch bf16 matmul us per call, timed like the kernels (CUDA graph of rotating weight copies)."""
    n = int(min(4, max(2, math.ceil(L2_ROTATE_BYTES / (2 * N * K)))))
    ws = [torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(n)]
    res = {}
    for T in ts:
        x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
        o = torch.empty(T, N, device=DEV, dtype=torch.bfloat16)
        us = graph_us([lambda w=w: torch.matmul(x, w.T, out=o) for w in ws], quick)
        if us is None:
            it = iter(range(1 << 62))
            us = bench_ms(lambda: torch.matmul(x, ws[next(it) % n].T), quick) * 1e3
        res[T] = round(us, 2)
    del ws
    return res


def prefill(fmt, qws, N, K, T, quick) -> dict:
    from ninfer_kernels import dispatch
    x = torch.randn(T, K, device=DEV).to(torch.bfloat16)
    r = {}
    for path in ("fused", "dequant"):
        try:
            dispatch.linear(x, qws[0], prefill_path=path)
            r[path] = round(bench_ms(lambda: dispatch.linear(x, qws[0], prefill_path=path), quick) * 1e3, 1)
        except Exception as e:
            r[path] = f"{type(e).__name__}: {str(e)[:100]}"
    return r


# ---- driver ----------------------------------------------------------------------------------------------
def table(records: list[dict]) -> str:
    head = (f"{'shape':<13}{'tp':>3}{'N x K':>15} {'format':<12}{'T':>3}{'us':>9}{'eager':>8}{'GB/s':>8}{'%copy':>7}"
            f"{'bf16 us':>9}{'x bf16':>7}{'T/T1':>6}  config")
    lines = [head, "-" * len(head)]
    for r in records:
        if "us" not in r:
            lines.append(f"{r.get('name', '?'):<13}{r.get('tp', ''):>3} {r.get('format', '')}: {r.get('error', r)}")
            continue
        sp = f"{r['torch_bf16_us'] / r['us']:.2f}" if r.get("torch_bf16_us") else "-"
        n, k = r["shape"]
        lines.append(f"{r['name']:<13}{r['tp']:>3}{f'{n} x {k}':>15} {r['format']:<12}{r['T']:>3}{r['us']:>9.1f}"
                     f"{r['us_eager']:>8.1f}{r['gbps']:>8.0f}{r['pct_copy_bw']:>7.1f}"
                     f"{r.get('torch_bf16_us') or 0:>9.1f}{sp:>7}{r.get('t_over_t1') or 0:>6.2f}  {r['config']}")
    return "\n".join(lines)


def _one(fmt, name, tp, N, K, ts, args, copy_bw, torch_us, checks) -> list[dict]:
    qws, nbytes = make_copies(fmt, N, K)
    if args.check:
        for c in check(fmt, qws[0], N, K):
            checks.append({"name": name, "tp": tp, "shape": [N, K], "format": fmt, **c})
            if not c["ok"]:
                log(f"CHECK FAILED {name} tp{tp} {fmt}: {c}")
    recs = []
    for xpre in (False, True) if args.xpre and fmt in XPRE_FORMATS else (False,):
        recs += time_format(fmt, qws, nbytes, N, K, ts, args.quick, copy_bw, torch_us, xpre=xpre, runoff=args.runoff)
    if args.prefill_T and fmt != "bf16" and name in ("attn_qkv", "mlp_down"):
        T = args.prefill_T
        recs.append({"format": fmt, "T": T, "prefill_us": prefill(fmt, qws, N, K, T, args.quick),
                     "torch_bf16_us": torch_times(N, K, (T,), args.quick)[T]})
    return recs


def run(args, flush=lambda records, checks: None) -> tuple[list[dict], list[dict]]:
    """Every shape's records are handed to `flush` as soon as they exist, so a call that runs out of time
    keeps what it measured."""
    gpu = "cpu (smoke: Triton interpreter)" if SMOKE else torch.cuda.get_device_name()
    copy_bw = copy_bandwidth(args.quick)
    log(f"{gpu}: device copy bandwidth {copy_bw:.0f} GB/s (read + write)")
    quick_names = ("attn_qkv", "attn_o", "mlp_down", "lm_head")
    shapes = [s for s in SHAPES if s[1] in args.tp and (not args.quick or s[0] in quick_names)]
    if SMOKE:
        shapes = [("attn_qkv", 1, 64, 512), ("attn_o", 1, 32, 768), ("gdn_out", 1, 32, 768), ("gdn_ab", 2, 48, 512)]
    shapes = [s for s in shapes if not args.shapes or s[0] in args.shapes]
    ts = tuple(args.T) if args.T else ((1, 8) if args.quick else TS)
    fmts = [f for f in FORMATS if f in args.formats]
    if not (args.no_precompile or SMOKE):
        jobs = [(f, N, K, T) for name, tp, N, K in shapes for f in fmts if f == "bf16" or name not in BF16_ONLY
                for T in ts]
        # the prefill tiles (--check's fused probe at T = 64, --prefill-T) compile alike for every shape and any
        # T that is a multiple of 16: one job per format
        pre_t = 64 if args.check else (args.prefill_T or 0)
        jobs += [(f, shapes[0][2], shapes[0][3], pre_t) for f in fmts if f != "bf16" and pre_t > 16]
        precompile(jobs, args.workers)
    records, checks, done, torch_done = [], [], {}, {}
    for name, tp, N, K in shapes:
        if (N, K) not in torch_done:
            torch_done[(N, K)] = torch_times(N, K, ts, args.quick)
        for fmt in fmts:
            if name in BF16_ONLY and fmt != "bf16":
                continue
            if (N, K, fmt) not in done:   # attn_o and gdn_out share a shape: measured once
                t0 = time.time()
                try:
                    done[(N, K, fmt)] = _one(fmt, name, tp, N, K, ts, args, copy_bw, torch_done[(N, K)], checks)
                except Exception as e:  # keep going: one failing format must not lose the others' numbers
                    done[(N, K, fmt)] = [{"format": fmt, "error": f"{type(e).__name__}: {str(e)[:300]}"}]
                if not SMOKE:
                    torch.cuda.empty_cache()
                log(f"{name} tp{tp} {N}x{K} {fmt}: {time.time() - t0:.1f} s")
            records += [{**r, "name": name, "tp": tp, "shape": [N, K], "gpu": gpu} for r in done[(N, K, fmt)]]
            flush(records, checks)
    return records, checks


def _rec_key(r: dict) -> tuple:
    """What a new record replaces on --merge: the same measurement on the same GPU model (a run on another
    GPU adds its records beside the shipped ones)."""
    return (r.get("gpu"), r.get("format"), r.get("name"), r.get("tp"), tuple(r.get("shape") or ()), r.get("T"),
            "prefill_us" in r)


def read_base(path: str) -> list:
    """The records already in `path` (--merge keeps those this run does not measure)."""
    try:
        with open(path) as f:
            old = json.load(f)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {path}: cannot merge into it: {e}")
    return [r for r in old if isinstance(r, dict)]


def _write_json(path: str, obj) -> None:
    with open(path + ".partial", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".partial", path)


def save(out: str, base: list, records: list, checks: list) -> None:
    """`out` = the records measured so far plus `base`'s records they do not replace (--merge)."""
    new = {_rec_key(r) for r in records}
    _write_json(out, [r for r in base if _rec_key(r) not in new] + records)
    if checks:
        _write_json(os.path.splitext(out)[0] + "_check.json", checks)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 shapes, T in (1, 8), short timing")
    ap.add_argument("--check", action="store_true", help="validate against the codec reference first")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "kernels.json"))
    ap.add_argument("--json", action="store_true", help="print the records as JSON instead of the table")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--tp", nargs="+", type=int, default=[1, 2], choices=[1, 2])
    ap.add_argument("--shapes", nargs="+", default=None, choices=sorted({s[0] for s in SHAPES}),
                    help="only these shapes (default: all)")
    ap.add_argument("--T", nargs="+", type=int, help=f"activation rows (default {TS})")
    ap.add_argument("--prefill-T", type=int, default=None, help="also time the prefill paths at this T")
    ap.add_argument("--xpre", action="store_true", help="also time nvfp4 / q6_k / iq3_s on prepared activations "
                    "(records with format '<fmt>+xpre'; their winners ship like the others)")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="precompile processes")
    ap.add_argument("--no-precompile", action="store_true")
    ap.add_argument("--runoff", type=int, default=GRAPH_RUNOFF_MAX,
                    help="tuner finishers re-timed over rotating copies in one graph before one ships (0: none)")
    ap.add_argument("--smoke", action="store_true", help="CPU + interpreter dry run of this script")
    ap.add_argument("--merge", action="store_true",
                    help="keep --out's records for the (format, shape, tp, T) this run did not measure")
    args = ap.parse_args(argv)
    if args.runoff < 0:
        print(f"error: --runoff {args.runoff}: expected 0 or more finalists", file=sys.stderr)
        return 2
    if args.smoke:
        args.T, args.quick = args.T or [1, 3], True
    elif not torch.cuda.is_available():
        print("error: bench/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    elif os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("error: unset TRITON_INTERPRET for the benchmark", file=sys.stderr)
        return 2
    t0 = time.time()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    base = read_base(args.out) if args.merge else []
    records, checks = run(args, lambda recs, chks: save(args.out, base, recs, chks))
    print(json.dumps(records) if args.json else table([r for r in records if "prefill_us" not in r]))
    for r in records:
        if "prefill_us" in r:
            print(f"prefill {r['name']} tp{r['tp']} {r['format']} T={r['T']}: {r['prefill_us']} us, "
                  f"torch bf16 {r['torch_bf16_us']} us")
    bad = [c for c in checks if not c["ok"]]
    log(f"{len(records)} records -> {args.out}; checks {len(checks) - len(bad)}/{len(checks)} ok; "
        f"{time.time() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
