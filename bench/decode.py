"""End-to-end decode / MTP verify / prefill / load speed on one GPU, with a 27B-shaped synthetic artifact.

    python bench/decode.py [--quick] [--recipes nvfp4,q6_k,iq3_s] [--parts decode,verify,prefill] [--tp 1]
                           [--out bench/results/decode.json] [--dir DIR] [--keep] [--eager]
    python bench/decode.py --device cpu --tiny --contexts 64,256 --prefill-tokens 128     # CPU dry run

Per recipe: build (or reuse) the artifact with bench/synth_artifact.py, then in a spawned process (fresh GPU
memory) measure, in this order:
  ceilings  device copy bandwidth (one large device copy, bytes read + written) and bf16 torch.matmul n^3
  load      ninfer_rt.loader.load(rank file, cuda, bf16, checksums verified) from the page cache; Model build;
            bench/kernels.py's parallel precompile of the GEMV configs the tuner will time; CUDA-graph warm-up
            (tuning) + capture (ninfer_rt.graphs)
  decode    per context, greedy decode with CUDA graphs, MTP off. The context is made by writing random KV and
            GDN state (no 32K prefill). ms/step with the token read back every step (engine-like) and with the
            device argmax fed straight back (GPU-pipelined); bytes/step = packed weights + KV read + GDN state
            read and written; % of roofline = (bytes/step / copy bandwidth) / step time
  profile   the decode step's kernels under the torch profiler: count and us per step by name and group
  verify    MTP verify steps K = 1..max (GDN snapshots, commit) vs K = 0, one MTP draft step, and tok/s at a
            per-position acceptance a: tokens/round = sum_{i=0..K} a^i, tok/s = that / (verify_K + K * draft)
  prefill   eager prefill of N random tokens (chunks of --prefill-chunk), tok/s, and TFLOP/s as % of the
            matmul ceiling with FLOPs = 2 * (decoder-layer linear params) * tokens
Results: a JSON list of records, rewritten after every recipe (--out), and a table on stdout. --budget-s skips
a recipe when less than its estimated build time + 90 s is left and stops one that overruns; records stream
out of the measuring process as they are made, so a stopped recipe keeps what it had measured.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import synth_artifact as synth
from ninfer_formats.atomic import write_json_atomic
from ninfer_formats.errors import NinferError

OUT = Path(__file__).resolve().parent / "results" / "decode.json"
PARTS = ("decode", "profile", "verify", "prefill")
MIN_MEASURE_S = 90.0       # a recipe is started only with this much budget left after its build
GOALS = {"decode_pct_roofline_1k": 80.0, "verify_ratio_k3": 1.25, "prefill_tok_s": 8000.0, "load_s": 10.0}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _ints(text: str) -> tuple[int, ...]:
    try:
        v = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not v or min(v) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return v


def _names(allowed):
    def parse(text: str) -> tuple[str, ...]:
        v = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in v if allowed and x not in allowed]
        if not v or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {', '.join(allowed)}, got {text!r}")
        return v
    return parse


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="nvfp4 only (unless --recipes), fewer steps, one prefill run")
    ap.add_argument("--recipes", type=_names(("nvfp4", "q6_k", "iq3_s", "bf16")), default=None,
                    help="default nvfp4,q6_k,iq3_s (--quick: nvfp4)")
    ap.add_argument("--parts", type=_names(PARTS), default=PARTS, help="decode,profile,verify,prefill (load always runs)")
    ap.add_argument("--contexts", type=_ints, default=(1024, 32768))
    ap.add_argument("--verify-contexts", type=_ints, default=None, help="default: the first context")
    ap.add_argument("--max-draft", type=int, default=5)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per measurement (default 128, --quick 48)")
    ap.add_argument("--warm", type=int, default=None, help="untimed steps first (default 16, --quick 8)")
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="default: the whole prompt in one forward")
    ap.add_argument("--prefill-runs", type=int, default=None, help="timed runs, best kept (default 2, --quick 1)")
    ap.add_argument("--tp", type=_ints, default=(1,),
                    help="TP sizes to measure, in this order, each with its own artifact (e.g. 1,2: TP1 vs TP2)")
    ap.add_argument("--compare-allreduce", choices=("auto", "always", "off"), default="auto",
                    help="TP > 1: decode again with the process-group all-reduce (auto: when peer memory is in use)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default cuda when available")
    ap.add_argument("--backend", choices=("triton", "torch"), default=None,
                    help="ops backend (default triton on cuda, torch on cpu unless TRITON_INTERPRET=1)")
    ap.add_argument("--eager", action="store_true", help="run the graph runner's bodies without CUDA graphs")
    ap.add_argument("--no-precompile", action="store_true",
                    help="skip bench/kernels.py's parallel precompile of the GEMV configs (the tuner compiles lazily)")
    ap.add_argument("--gemv-tune", choices=("on", "off"), default="on",
                    help="off: NINFER_GEMV_TUNE=0, the kernels' default configs (far fewer Triton compiles)")
    ap.add_argument("--dir", default=None, help="artifact folder (default /dev/shm when it fits, else the temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the artifacts (default: delete after each recipe)")
    ap.add_argument("--workers", type=int, default=None, help="artifact writer processes (default: usable cores, at most 32)")
    ap.add_argument("--copy-mb", type=int, default=None, help="copy-bandwidth buffer (default 4096; cpu 256)")
    ap.add_argument("--matmul-n", type=int, default=None, help="matmul ceiling size (default 8192; cpu 512)")
    ap.add_argument("--budget-s", type=float, default=510.0, help="wall-clock budget for the whole run")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--json", action="store_true", help="print the records as JSON instead of the table")
    synth.add_shape_args(ap)
    return ap.parse_args(argv)


def _cuda_available() -> bool:
    # without importing torch here: the orchestrator forks artifact writers and must stay CUDA-free
    import subprocess
    code = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, check=False).returncode == 0


def options(args) -> dict:
    """The per-rank options (decode_rank.BenchOptions fields) from the command line."""
    device = args.device or ("cuda" if _cuda_available() else "cpu")
    cpu = device == "cpu"
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    for name in ("max_draft", "prefill_tokens"):
        if getattr(args, name) < (0 if name == "max_draft" else 1):
            raise NinferError(f"--{name.replace('_', '-')}: {getattr(args, name)} is out of range")
    if len(set(args.tp)) != len(args.tp):
        raise NinferError(f"--tp: {','.join(map(str, args.tp))} lists a size twice")
    return {"parts": tuple(args.parts), "contexts": tuple(args.contexts),
            "verify_contexts": tuple(args.verify_contexts or args.contexts[:1]), "max_draft": args.max_draft,
            "steps": args.steps or (48 if args.quick else 128), "warm": args.warm or (8 if args.quick else 16),
            "prefill_tokens": args.prefill_tokens, "prefill_chunk": args.prefill_chunk or args.prefill_tokens,
            "prefill_runs": args.prefill_runs or (1 if args.quick else 2), "tp": args.tp[0], "device": device,
            "backend": args.backend or ("torch" if cpu and not interp else "triton"),
            "dtype": "float32" if cpu else "bfloat16", "eager": args.eager or cpu, "precompile": not args.no_precompile,
            "copy_mb": args.copy_mb or (256 if cpu else 4096), "matmul_n": args.matmul_n or (512 if cpu else 8192),
            "compare_allreduce": args.compare_allreduce}


def pick_dir(given: str | None, need: int) -> str:
    if given:
        return given
    for base in ("/dev/shm", tempfile.gettempdir()):
        try:
            free = shutil.disk_usage(base).free
        except OSError:
            continue
        if free > need * 1.05 + (1 << 30):
            return os.path.join(base, "ninfer-bench")
    raise NinferError(f"no folder with {need / 1e9:.1f} GB free (tried /dev/shm and {tempfile.gettempdir()}); "
                      f"pass --dir")


# ---- one recipe in a spawned child ----
def _child(conn, opts: dict, recipe: str, paths: list, info: dict) -> None:
    import decode_rank
    decode_rank.child_main(conn, decode_rank.BenchOptions(**opts), recipe, paths, info)


def run_child(opts: dict, recipe: str, paths: list, info: dict, deadline: float) -> tuple[list, str | None]:
    ctx = mp.get_context("spawn")
    rd, wr = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(wr, opts, recipe, paths, info))
    p.start()
    wr.close()
    records, error = [], None
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                error = "stopped: time budget exhausted"
                break
            if not rd.poll(min(left, 1.0)):
                if not p.is_alive() and not rd.poll():
                    error = f"measurement process exited (code {p.exitcode})"
                    break
                continue
            try:
                msg = rd.recv()
            except EOFError:
                error = f"measurement process exited (code {p.exitcode})"
                break
            if "record" in msg:
                records.append(msg["record"])
                log(f"  {_brief(msg['record'])}")
            else:
                error = msg.get("error")
                break
    finally:
        p.join(30 if error is None else 5)
        if p.is_alive():
            p.terminate()
            p.join(10)
    return records, error


def _brief(r: dict) -> str:
    keys = ("kind", "context", "draft_tokens", "allreduce", "allreduce_calls_per_step", "tok_s", "ms_step",
            "pct_roofline", "verify_ratio", "load_s", "capture_s", "copy_tbps", "matmul_tflops")
    return " ".join(f"{k}={r[k]:.4g}" if isinstance(r[k], float) else f"{k}={r[k]}" for k in keys if k in r)


def write(records: list, out: str) -> None:
    write_json_atomic(out, records)


def measure_one(args, opts: dict, shape, recipe: str, deadline: float, rate: float | None):
    """Build (or reuse) one recipe's artifact at opts["tp"] and measure it: -> (records, build seconds per
    byte or None when reused)."""
    tp = opts["tp"]
    need = synth.planned_bytes(shape, recipe, tp)
    left = deadline - time.monotonic()
    if left < (rate or 0) * need + MIN_MEASURE_S:
        log(f"{recipe} tp{tp}: skipped, {left:.0f} s of the {args.budget_s:.0f} s budget left")
        return [{"kind": "skipped", "recipe": recipe, "tp": tp, "reason": "time budget"}], None
    folder = os.path.join(pick_dir(args.dir, need), f"{recipe}-tp{tp}")     # one artifact per folder: servable
    log(f"{recipe} tp{tp}: building {need / 1e9:.1f} GB in {folder}")
    paths, info = synth.build(folder, shape, recipe, tp, workers=args.workers, log=log)
    info["dir"] = folder
    log(f"{recipe} tp{tp}: artifact {'reused' if info['reused'] else 'built'} in {info['build_s']:.1f} s; measuring")
    try:
        recs, error = run_child(opts, recipe, paths, info, deadline)
    finally:
        if not args.keep and not info["reused"]:
            for p in paths:
                os.unlink(p)
            with contextlib.suppress(OSError):
                os.rmdir(folder)
    if error:
        log(f"{recipe} tp{tp}: error: {error}")
        recs.append({"kind": "error", "recipe": recipe, "tp": tp, "error": error})
    return recs, (None if info["reused"] else info["build_s"] / need)


def run(args) -> list[dict]:
    opts = options(args)
    if args.gemv_tune == "off":
        os.environ["NINFER_GEMV_TUNE"] = "0"         # inherited by the measurement processes
    shape = synth.shape_from_args(args)
    recipes = args.recipes or (("nvfp4",) if args.quick else ("nvfp4", "q6_k", "iq3_s"))
    deadline, records, rate = time.monotonic() + args.budget_s, [], None   # rate: build seconds per planned byte
    for recipe in recipes:
        for tp in args.tp:
            recs, r = measure_one(args, {**opts, "tp": tp}, shape, recipe, deadline, rate)
            rate = r or rate
            records += recs
            compare_tp(records)
            write(records, args.out)
    write(records, args.out)
    return records


def _match(records: list, r: dict, **want):
    keys = ("recipe", "kind", "context", "draft_tokens")
    for o in records:
        if all(o.get(k) == r.get(k) for k in keys) and all(o.get(k) == v for k, v in want.items()):
            return o
    return None


def compare_tp(records: list) -> None:
    """Cross-run fields, in place: TP > 1 decode / verify records get TP1's numbers at the same recipe and
    context and the speedup; decode records get every all-reduce implementation's step time at their TP."""
    for r in records:
        if r["kind"] not in ("decode", "verify") or r.get("tp", 1) < 2:
            continue
        tp1 = _match(records, r, tp=1)
        if r["kind"] == "decode":
            same = [o for o in records if o["kind"] == "decode" and o["tp"] == r["tp"]
                    and o["recipe"] == r["recipe"] and o["context"] == r["context"] and "allreduce" in o]
            names = [o["allreduce"] for o in same]          # "always" without peer memory: one path twice
            keys = [n + " forced" if o.get("allreduce_forced") and names.count(n) > 1 else n
                    for n, o in zip(names, same)]
            r["ms_step_by_allreduce"] = {k: o["ms_step"] for k, o in zip(keys, same)}
            r["tok_s_by_allreduce"] = {k: o["tok_s"] for k, o in zip(keys, same)}
        if tp1 is not None:
            key = "tok_s" if r["kind"] == "decode" else "verify_ratio"
            r[f"{key}_tp1"] = tp1[key]
            if r["kind"] == "decode":
                r["speedup_vs_tp1"] = r["tok_s"] / tp1["tok_s"]
                r["speedup_vs_tp1_gpu"] = r["tok_s_gpu"] / tp1["tok_s_gpu"]


# ---- table ----
def _row(r: dict) -> str | None:
    k = r["kind"]
    head = f"{r.get('recipe', ''):<7}{r.get('tp', ''):>3}  {k:<8}"
    if k == "decode":
        return (f"{head}{r['context']:>7}  K=0 {r['tok_s']:9.1f} tok/s {r['ms_step']:8.3f} ms "
                f"(gpu {r['ms_step_gpu']:.3f}) {r['bytes_step'] / 1e9:7.2f} GB/step {r['pct_roofline']:6.1f}% roofline "
                f"(gpu {r['pct_roofline_gpu']:.1f}%)" + _tp_note(r))
    if k == "allreduce":
        msgs = ", ".join(f"{m['count']} x {m['bytes']} B" for m in r["allreduce_messages"])
        per = ", ".join(f"{i} {r['allreduce_us_per_call'][i]:.1f} us/call = {us / 1e3:.3f} ms/step"
                        for i, us in r["allreduce_us_per_step"].items())
        return f"{head}{'':>7}      {msgs} per decode step: {per} ({r['allreduce_timing']})"
    if k == "verify":
        extra = ""
        if r.get("tok_s_by_acceptance"):
            extra = " tok/s@a=" + "/".join(f"{v:.0f}" for v in r["tok_s_by_acceptance"].values()) + \
                    f" (a={'/'.join(r['tok_s_by_acceptance'])}; draft {r['draft_ms']:.3f} ms)"
        return (f"{head}{r['context']:>7}  K={r['draft_tokens']} {r['ms_step']:8.3f} ms = "
                f"{r['verify_ratio']:.3f} x K=0{extra}")
    if k == "profile":
        if "us_by_group" not in r:
            return f"{head}{r['context']:>7}      {r.get('note', 'no kernels traced')}"
        groups = ", ".join(f"{g} {us:.0f}" for g, us in sorted(r["us_by_group"].items(), key=lambda kv: -kv[1]))
        return (f"{head}{r['context']:>7}      {r['kernels_per_step']:.0f} kernels, {r['kernel_us_per_step']:.0f} us "
                f"of kernels per step ({r['source']}): {groups}")
    if k == "prefill":
        return (f"{head}{r['tokens']:>7}      {r['tok_s']:9.1f} tok/s {r['s']:8.3f} s  {r['tflops']:.1f} TFLOP/s "
                f"= {r['pct_matmul_peak']:.1f}% of matmul peak")
    if k == "load":
        return (f"{head}{'':>7}      load {r['load_s']:.2f} s ({r['file_bytes'] / 1e9:.2f} GB, {r['gbps']:.2f} GB/s, "
                f"checksums) build {r['model_build_s']:.2f} s "
                + (f"precompile {r['precompile_s']:.0f} s " if r.get("precompile_s") is not None else "")
                + (f"capture {r['capture_s']:.1f} s ({r['graphs_captured']} graphs)" if r["capture_s"] is not None
                   else "graph capture FAILED (eager)") + _mem_note(r))
    if k == "ceilings":
        return f"{head}{'':>7}      copy {r['copy_tbps']:.3f} TB/s  matmul {r['matmul_tflops']:.1f} TFLOP/s  ({r['gpu']})"
    if k in ("error", "skipped"):
        return f"{head}{r.get('error') or r.get('reason')}"
    return None


def _tp_note(r: dict) -> str:
    if "allreduce" not in r:
        return ""
    share = r.get("allreduce_pct_step")
    note = (f"  [{r['allreduce']}{' forced' if r.get('allreduce_forced') else ''}: {r['allreduce_calls_per_step']} "
            f"all-reduces/step" + (f" = {share:.1f}% of the step" if share is not None else "") + "]")
    return note + (f" {r['speedup_vs_tp1']:.2f}x TP1" if "speedup_vs_tp1" in r else "")


def _mem_note(r: dict) -> str:
    fmt = lambda v: "/".join(f"{x:.2f}" for x in v)
    if "max_allocated_gib" in r:
        return (f"; GiB per rank: max allocated {fmt(r['max_allocated_gib'])}, reserved {fmt(r['reserved_gib'])}, "
                f"device used {fmt(r['device_used_gib'])}")
    return f"; peak RSS GiB per rank {fmt(r['peak_rss_gib'])}" if "peak_rss_gib" in r else ""


def tp_summary(records: list) -> list[str]:
    """One line per TP > 1 decode measurement with the peer-memory path (or the only one): tok/s against TP1
    and against the process-group all-reduce."""
    out = []
    for r in records:
        if r["kind"] != "decode" or r.get("tp", 1) < 2 or r.get("allreduce_forced"):
            continue
        line = f"{r['recipe']} TP{r['tp']} @{r['context']}: {r['tok_s']:.1f} tok/s ({r['allreduce']})"
        if "tok_s_tp1" in r:
            line += f" vs TP1 {r['tok_s_tp1']:.1f} tok/s = {r['speedup_vs_tp1']:.2f}x"
        others = {i: t for i, t in r.get("tok_s_by_allreduce", {}).items() if i != r["allreduce"]}
        line += "".join(f"; with {i}: {t:.1f} tok/s" for i, t in others.items())
        per = r.get("allreduce_us_per_step", {})
        line += "; all-reduce ms/step " + ", ".join(f"{i} {us / 1e3:.3f}" for i, us in per.items())
        out.append(line)
    return out


def goals(records: list) -> list[str]:
    out = []
    for r in records:
        if r.get("recipe") != "nvfp4" or r.get("allreduce_forced"):
            continue
        if r["kind"] == "decode" and r["context"] <= 1024:
            out.append(f"nvfp4 TP{r['tp']} decode @{r['context']}: {r['pct_roofline']:.1f}% of roofline "
                       f"(goal >= {GOALS['decode_pct_roofline_1k']:.0f}%)")
        elif r["kind"] == "verify" and r["draft_tokens"] == 3:
            out.append(f"nvfp4 TP{r['tp']} verify K=3: {r['verify_ratio']:.3f} x K=0 (goal <= {GOALS['verify_ratio_k3']})")
        elif r["kind"] == "prefill":
            out.append(f"nvfp4 TP{r['tp']} prefill {r['tokens']}: {r['tok_s']:.0f} tok/s (goal >= {GOALS['prefill_tok_s']:.0f})")
        elif r["kind"] == "load":
            out.append(f"nvfp4 TP{r['tp']} load: {r['load_s']:.2f} s (goal <= {GOALS['load_s']:.0f} s)")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        records = run(args)
    except (NinferError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        for r in records:
            line = _row(r)
            if line:
                print(line)
        for line in tp_summary(records):
            print("tp: " + line)
        for g in goals(records):
            print("goal: " + g)
        print(f"wrote {args.out}", file=sys.stderr)
    return 1 if any(r["kind"] == "error" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
