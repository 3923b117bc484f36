"""Decode / MTP verify / prefill / load speed, TP1 and tensor-parallel, on a 27B-shaped synthetic artifact.

    python bench/decode.py [--quick] [--recipes nvfp4,q6_k,iq3_s] [--parts decode,verify,prefill] [--tp 1,2]
                           [--compare-allreduce auto|always|off] [--out bench/results/decode.json] [--dir DIR]
                           [--keep] [--eager] [--gemv-tune on|off] [--budget-s 510] [--json]
    python bench/decode.py --device cpu --tiny --tp 1,2 --contexts 64 --prefill-tokens 128     # CPU dry run (gloo)

--tp lists the TP sizes to measure, in that order, for every recipe in the same run (default 1; `--tp 1,2` is
TP1 vs TP2, `--tp 2` TP2 alone). Each size gets its own artifact (built or reused in DIR/<recipe>-tp<N>, one TP
set per folder so `ninfer-rt serve` can take it; deleted after its measurement unless --keep) and its own
spawned process (fresh GPU memory; TP > 1 spawns the other ranks through ninfer_rt.tp.launch, one GPU each).
Per (recipe, TP size), measured in this order:
  ceilings  device copy bandwidth (one large device copy, bytes read + written) and bf16 torch.matmul n^3
  load      ninfer_rt.loader.load(rank file, cuda, bf16, checksums verified) from the page cache; Model build;
            bench/gemv_precompile.py's parallel precompile of the GEMV configs the run launches (rank 0 only: the
            other ranks are daemonic processes and start no children; the Triton cache is shared); CUDA-graph
            warm-up (tuning) + capture (ninfer_rt.graphs); then every rank's memory in GiB, lists in rank order:
            max_allocated_gib / allocated_gib / reserved_gib (torch) and device_used_gib (mem_get_info),
            peak_rss_gib on CPU -- carried by every later record
  allreduce (TP > 1) the decode step's collectives (counted over one decode step at the first context, run by
            an eager graph runner: the captured step's Python path) and each
            all-reduce implementation's cost at those message sizes: the runtime's choice in a CUDA graph (the
            peer-memory one_shot for the 27B's 10 KiB row on 2 GPUs) and the process group's (nccl; gloo on
            CPU), timed in a captured chain of calls as bench/allreduce.py does (host-timed on CPU / --eager):
            allreduce_calls_per_step, allreduce_us_per_call {impl: us}, allreduce_us_per_step {impl: us}
  decode    per context, greedy decode with CUDA graphs, MTP off. The context is made by writing random KV and
            GDN state (no 32K prefill). ms/step with the token read back every step (engine-like) and with the
            device argmax fed straight back (GPU-pipelined); bytes/step = packed weights + KV read + GDN state
            read and written, per GPU (rank 0's shard); % of roofline = (bytes/step / copy bandwidth) / step time.
            TP > 1 records add allreduce (the implementation the step ran with), allreduce_forced,
            allreduce_pct_step and the allreduce fields above; once the other runs are in, tok_s_tp1 and
            speedup_vs_tp1 (same recipe and context) and ms_step_by_allreduce / tok_s_by_allreduce
  profile   the decode step's kernels under the torch profiler: count and us per step by name and group
  verify    MTP verify steps K = 1..max (GDN snapshots, commit) vs K = 0, one MTP draft step, and tok/s at a
            per-position acceptance a: tokens/round = sum_{i=0..K} a^i, tok/s = that / (verify_K + K * draft);
            the record's tok_s is a = 0.75's (null without an MTP module: no draft step to time); the same
            steps without the per-step read-back (ms_step_gpu, ms_step_k0_gpu, verify_ratio_gpu: the GPU's time)
            and the host's ms per step in forward + commit (host_ms, host_ms_k0); TP > 1 records add
            verify_ratio_tp1
  decode    (TP > 1, --compare-allreduce: auto = when the peer-memory path is in use, always, off) the decode
            part again with the peer-memory path switched off on every rank, i.e. every all-reduce through the
            process group as with NINFER_ALLREDUCE=nccl, in a decode-only graph runner captured for it:
            decode records with allreduce "nccl" and allreduce_forced true
  prefill   eager prefill of N random tokens (chunks of --prefill-chunk), tok/s, and TFLOP/s as % of the
            matmul ceiling with FLOPs = 2 * (decoder-layer linear params) * tokens
Results: a JSON list of records, rewritten after every (recipe, TP size) (--out; left as it was when no record
is a measurement, i.e. every run was skipped or failed), and a table on stdout ("tp:" lines compare TP sizes
and all-reduce implementations; --json: the records instead). Exit status 0, 1 when a run failed or nothing
was measured, 2 on bad arguments. --budget-s skips a run when less than its estimated build time + 90 s is
left and stops one that overruns; records stream out of the measuring process as they are made, so a stopped
run keeps what it had measured. The measuring process leads its own process group (its TP
ranks and precompile workers are in it), so a stop or a crash ends every rank, not only rank 0.
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

import decode_report as report
import synth_artifact as synth
from bench_cli import ArgParser, int_list, name_list, nonneg_int, pick_dir, positive_int
from ninfer_formats.atomic import write_json_atomic
from ninfer_formats.errors import NinferError

OUT = Path(__file__).resolve().parent / "results" / "decode.json"
PARTS = ("decode", "profile", "verify", "prefill")
MIN_MEASURE_S = 90.0       # a recipe is started only with this much budget left after its build


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv=None):
    ap = ArgParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="nvfp4 only (unless --recipes), fewer steps, one prefill run")
    ap.add_argument("--recipes", type=name_list(("nvfp4", "q6_k", "iq3_s", "bf16")), default=None,
                    help="default nvfp4,q6_k,iq3_s (--quick: nvfp4)")
    ap.add_argument("--parts", type=name_list(PARTS), default=PARTS,
                    help="decode,profile,verify,prefill (load always runs)")
    ap.add_argument("--contexts", type=int_list, default=(1024, 32768))
    ap.add_argument("--verify-contexts", type=int_list, default=None,
                    help="a subset of --contexts (default: the first context)")
    ap.add_argument("--max-draft", type=nonneg_int, default=5)
    ap.add_argument("--steps", type=positive_int, default=None,
                    help="timed steps per measurement (default 128, --quick 48)")
    ap.add_argument("--warm", type=nonneg_int, default=None, help="untimed steps first (default 16, --quick 8)")
    ap.add_argument("--prefill-tokens", type=positive_int, default=8192)
    ap.add_argument("--prefill-chunk", type=positive_int, default=None, help="default: the whole prompt in one forward")
    ap.add_argument("--prefill-runs", type=positive_int, default=None,
                    help="timed runs, best kept (default 2, --quick 1)")
    ap.add_argument("--tp", type=int_list, default=(1,),
                    help="TP sizes to measure, in this order, each with its own artifact (e.g. 1,2: TP1 vs TP2)")
    ap.add_argument("--compare-allreduce", choices=("auto", "always", "off"), default="auto",
                    help="TP > 1: decode again with the process-group all-reduce (auto: when peer memory is in use)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default cuda when available")
    ap.add_argument("--backend", choices=("triton", "torch"), default=None,
                    help="ops backend (default triton on cuda, torch on cpu unless TRITON_INTERPRET=1)")
    ap.add_argument("--eager", action="store_true", help="run the graph runner's bodies without CUDA graphs")
    ap.add_argument("--no-precompile", action="store_true",
                    help="skip bench/gemv_precompile.py's parallel precompile of the GEMV configs (the run compiles lazily)")
    ap.add_argument("--gemv-tune", choices=("on", "off"), default="on",
                    help="off: NINFER_GEMV_TUNE=0, the kernels' default configs (far fewer Triton compiles)")
    ap.add_argument("--dir", default=None, help="artifact folder (default /dev/shm when it fits, else the temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the artifacts (default: delete after each recipe)")
    ap.add_argument("--workers", type=positive_int, default=None,
                    help="artifact writer processes (default: usable cores, at most 32)")
    ap.add_argument("--copy-mb", type=positive_int, default=None, help="copy-bandwidth buffer (default 4096; cpu 256)")
    ap.add_argument("--matmul-n", type=positive_int, default=None, help="matmul ceiling size (default 8192; cpu 512)")
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


def _given(v, default):
    return default if v is None else v          # not `or`: --warm 0 means no warm-up steps


def options(args) -> dict:
    """The per-rank options (decode_rank.BenchOptions fields) from the command line."""
    if len(set(args.tp)) != len(args.tp):
        raise NinferError(f"--tp: {','.join(map(str, args.tp))} lists a size twice")
    if not args.budget_s > 0:
        raise NinferError(f"--budget-s {args.budget_s}: expected a positive number of seconds")
    if args.verify_contexts and not set(args.verify_contexts) <= set(args.contexts):
        listed = ",".join(map(str, args.contexts))
        raise NinferError(f"--verify-contexts {','.join(map(str, args.verify_contexts))}: verify runs at a context "
                          f"the decode part filled, so each must be one of --contexts {listed}")
    device = args.device or ("cuda" if _cuda_available() else "cpu")
    cpu = device == "cpu"
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return {"parts": tuple(args.parts), "contexts": tuple(args.contexts),
            "verify_contexts": tuple(args.verify_contexts or args.contexts[:1]), "max_draft": args.max_draft,
            "steps": _given(args.steps, 48 if args.quick else 128), "warm": _given(args.warm, 8 if args.quick else 16),
            "prefill_tokens": args.prefill_tokens, "prefill_chunk": _given(args.prefill_chunk, args.prefill_tokens),
            "prefill_runs": _given(args.prefill_runs, 1 if args.quick else 2), "tp": args.tp[0], "device": device,
            "backend": args.backend or ("torch" if cpu and not interp else "triton"),
            "dtype": "float32" if cpu else "bfloat16", "eager": args.eager or cpu, "precompile": not args.no_precompile,
            "copy_mb": _given(args.copy_mb, 256 if cpu else 4096),
            "matmul_n": _given(args.matmul_n, 512 if cpu else 8192),
            "compare_allreduce": args.compare_allreduce}


# ---- one recipe in a spawned child ----
def _child(conn, opts: dict, recipe: str, paths: list, info: dict) -> None:
    os.setpgrp()        # its TP ranks and precompile workers join this group: one signal reaches them all
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
        # done: it exits by itself; an error message: it is on its way out; a budget stop: it is still
        # measuring, so waiting would only spend more of the budget
        p.join(30 if error is None else 0 if error.startswith("stopped") else 5)
        _end_group(p)
    return records, error


def _end_group(p) -> None:
    """Stop the measuring process if it still runs, and whatever it left in its process group (TP ranks a
    stopped or crashed rank 0 left blocked in a collective, holding a GPU)."""
    if p.is_alive():
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:       # not yet its own group leader
            p.terminate()
        p.join(10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)
    p.join(5)


def _brief(r: dict) -> str:
    keys = ("kind", "context", "draft_tokens", "allreduce", "allreduce_calls_per_step", "tok_s", "ms_step",
            "pct_roofline", "verify_ratio", "load_s", "capture_s", "copy_tbps", "matmul_tflops")
    return " ".join(f"{k}={r[k]:.4g}" if isinstance(r[k], float) else f"{k}={r[k]}" for k in keys if k in r)


def write(records: list, out: str) -> bool:
    """Rewrite `out` with the records, unless none of them is a measurement (every run skipped or failed
    before its first record): that file would only replace earlier results with nothing."""
    if not any(r["kind"] not in ("skipped", "error") for r in records):
        return False
    write_json_atomic(out, records)
    return True


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


def run(args) -> tuple[list[dict], bool]:
    """-> (records, whether --out was written)."""
    opts = options(args)
    if args.gemv_tune == "off":
        os.environ["NINFER_GEMV_TUNE"] = "0"         # inherited by the measurement processes
    shape = synth.shape_from_args(args)
    recipes = args.recipes or (("nvfp4",) if args.quick else ("nvfp4", "q6_k", "iq3_s"))
    deadline, records, rate = time.monotonic() + args.budget_s, [], None   # rate: build seconds per planned byte
    wrote = False
    for recipe in recipes:
        for tp in args.tp:
            recs, r = measure_one(args, {**opts, "tp": tp}, shape, recipe, deadline, rate)
            rate = r or rate
            records += recs
            report.compare_tp(records)
            wrote = write(records, args.out) or wrote
    return records, wrote


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        records, wrote = run(args)
    except (NinferError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log(f"wrote {args.out}" if wrote else f"nothing was measured: {args.out} left as it was")
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        for r in records:
            line = report.row(r)
            if line:
                print(line)
        for line in report.tp_summary(records):
            print("tp: " + line)
        for g in report.goals(records):
            print("goal: " + g)
    return 1 if not wrote or any(r["kind"] == "error" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
