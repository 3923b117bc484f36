"""Where the GPU time of a long prefill goes: a 27B-width model with few layers, one prompt in one forward,
GPU time by kernel category, by ops method and by layer type, extrapolated to the full layer count.

    source bench/device_env.sh     # fla's chunked GDN on by default (NINFER_WITH_FLA=0 before sourcing: off)
    python3 bench/prefill_profile.py [--layers 8] [--tokens 8192] [--chunk 8192] [--out FILE]
    python3 bench/prefill_profile.py --device cpu --tiny --tokens 64        # CPU dry run (torch backend)

Steps: build (or reuse) a synthetic artifact with bench/synth_artifact.py (hidden 5120, intermediate 17408,
full vocab; --layers 8 with --full-every 4 = 6 Gated-DeltaNet + 2 full-attention layers, no MTP), load it
through ninfer_rt.loader on the device, measure the bf16 matmul ceiling, run one warm-up prefill (Triton
compiles, prefill-path timing), then
  timed     best of --runs prefills of --tokens random ids in chunks of --chunk (logits of the last row only)
  sections  one prefill with CUDA events at every layer boundary: wall time per layer type (no profiler)
  profile   one prefill under torch.profiler, each ops-backend call and each layer in a record_function range
            closed after a device sync, so every kernel is attributed to its layer and op
The 64-layer figures scale each layer type by (target count / measured count); embedding and head stay.
Results: a table on stdout, a JSON list of records (--out, default bench/results/prefill_profile.json).
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import bench_device as D
import prefill_breakdown as PB
import prefill_hooks as H
import prefill_report as R
import synth_artifact as synth
from bench_cli import ArgParser, pick_dir, positive_int
from ninfer_formats.atomic import write_json_atomic
from ninfer_formats.errors import NinferError

OUT = Path(__file__).resolve().parent / "results" / "prefill_profile.json"
GOAL_TOK_S = 8000.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv=None):
    ap = ArgParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="nvfp4", help="synthetic artifact recipe (nvfp4, q6_k, iq3_s, bf16)")
    ap.add_argument("--tokens", type=positive_int, default=None, help="prompt tokens (default 8192, --tiny 64)")
    ap.add_argument("--chunk", type=positive_int, default=None, help="tokens per forward (default: the whole prompt)")
    ap.add_argument("--runs", type=positive_int, default=3, help="timed prefills, best kept")
    ap.add_argument("--target-layers", type=positive_int, default=64, help="layer count to extrapolate to")
    ap.add_argument("--top", type=positive_int, default=25, help="kernels listed")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--backend", choices=("triton", "torch"), default=None, help="default triton on cuda, torch on cpu")
    ap.add_argument("--dir", default=None, help="artifact folder (default /dev/shm/ninfer-bench when it fits); "
                                                "an artifact of the same spec there is reused")
    ap.add_argument("--matmul-n", type=positive_int, default=None, help="matmul ceiling size (default 8192; cpu 256)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--json", action="store_true", help="print the records as JSON instead of the tables")
    synth.add_shape_args(ap)
    return ap.parse_args(argv)


def shape_from(args) -> synth.SynthShape:
    """synth_artifact's shape flags over a base of 8 layers without MTP (--tiny: the tiny model, no MTP)."""
    base = replace(synth.TINY if args.tiny else synth.SynthShape(layers=8), mtp=False)
    given = {f: getattr(args, f) for f in synth.SynthShape.__dataclass_fields__ if getattr(args, f) is not None}
    return replace(base, **given)


def type_counts(cfg) -> dict:
    full = sum(cfg.is_full(i) for i in range(cfg.num_hidden_layers))
    return {"gdn": cfg.num_hidden_layers - full, "attn": full}


def check_types(shape, target_layers: int) -> None:
    have, want = type_counts(shape.config()), type_counts(replace(shape, layers=target_layers).config())
    missing = [t for t in ("gdn", "attn") if want[t] and not have[t]]
    if missing:
        raise NinferError(f"--layers {shape.layers} with --full-every {shape.full_every} has no "
                          f"{' / '.join(missing)} layer to extrapolate {target_layers} layers from")


def check_device(device: str) -> None:
    # before the build: its forked writers never touch CUDA, so asking the driver for a count first is safe
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        raise NinferError("--device cuda: no CUDA device here (use --device cpu for a dry run)")


def build_artifact(args, shape) -> tuple[str, dict]:
    folder = pick_dir(args.dir, synth.planned_bytes(shape, args.recipe, 1))
    log(f"artifact: {shape.layers} layers, hidden {shape.hidden}, vocab {shape.vocab}, {args.recipe} in {folder}")
    paths, info = synth.build(folder, shape, args.recipe, 1, log=log)
    how = "reused" if info["reused"] else f"built in {info['build_s']:.1f} s"
    log(f"artifact: {info['bytes'] / 1e9:.2f} GB, {how}")
    return paths[0], info


def measure(args, shape, path: str) -> list[dict]:
    """Everything after the build (torch and CUDA are first touched here, after the forked writers)."""
    import torch
    tokens = args.tokens or (64 if args.tiny else 8192)
    chunk = min(args.chunk or tokens, tokens)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    backend = args.backend or ("triton" if args.device == "cuda" else "torch")
    run = H.PrefillRun(path, args.device, dtype, backend, tokens, chunk)
    counts, target = type_counts(run.model.cfg), type_counts(replace(shape, layers=args.target_layers).config())
    ceiling = D.matmul_tflops(run.device, args.matmul_n or (8192 if args.device == "cuda" else 256), dtype)
    log(f"loaded in {run.load_s:.1f} s; matmul ceiling {ceiling:.1f} TFLOP/s; warm-up prefill of {tokens} tokens")
    t = time.perf_counter()
    run.prefill()                              # compiles, prefill-path timing, fla autotune
    warm_s = time.perf_counter() - t
    log(f"warm-up prefill {warm_s:.1f} s; {args.runs} timed prefills")
    best = min(run.timed() for _ in range(args.runs))
    log(f"best {best * 1e3:.1f} ms = {tokens / best:.0f} tok/s; a prefill with layer marks, then one profiled")
    wall = PB.section_totals(run.sections())
    t = time.perf_counter()
    kernels, secs, ops = run.profile()
    log(f"profiled: {len(kernels)} kernels, {len(ops)} op ranges in {time.perf_counter() - t:.1f} s")
    rows = PB.attribute(kernels, secs, ops)
    summary = PB.summarize(rows, counts, target, top=args.top)
    params = H.linear_params(run.model)
    base = {"recipe": args.recipe, "device": D.device_name(run.device), "dtype": str(dtype).replace("torch.", ""),
            "backend": backend, "tokens": tokens, "chunk": chunk}
    return R.records(base, run, counts, target, ceiling, warm_s, best, wall, summary, params)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        shape = shape_from(args)
        check_device(args.device)
        check_types(shape, args.target_layers)
        path, info = build_artifact(args, shape)
        records = measure(args, shape, path)
        records[0]["artifact"] = {"bytes": info["bytes"], "build_s": info["build_s"], "reused": info["reused"]}
        write_json_atomic(args.out, records)
    except (NinferError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        import json
        print(json.dumps(records, indent=1))
    else:
        print(R.render(records, GOAL_TOK_S))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
