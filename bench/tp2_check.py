"""TP2 vs TP1 on the same weights: logits and greedy tokens over a teacher-forced decode, on 2 GPUs.

    python3 bench/tp2_check.py [--dir /tmp/ninfer-tp2check] [--recipe nvfp4] [--layers 4] [--vocab 32768]
                               [--steps 64] [--prompt-len 32] [--backend triton] [--tune] [--results DIR] [--json]
    python3 bench/tp2_check.py --device cpu --tiny --backend torch --steps 8     # CPU dry run (gloo, no GPU)

1. A random but valid model of the 27B's width (hidden 5120, its heads and FFN; --layers layers, three GDN to
   one full attention; --vocab) is written once as a TP1 artifact by bench/synth_artifact.py and cut into a TP2
   artifact with the packer's split table (ninfer_pack.tp_split.plan_split + codecs.slice_encoded): the very
   same weights, sharded.
2. TP1 on cuda:0: prefill a random prompt, then --steps greedy decode steps (one token each); logits kept.
3. TP2 on cuda:0 + cuda:1 (ninfer_rt.tp.launch): the same prompt teacher-forced with TP1's tokens, once with
   the peer-memory all-reduce for decode-sized messages (forced on for eager calls) and once with NCCL only;
   then TP2's own free-running greedy decode.
Reports per-step relative L2 of TP2's logits against TP1's and argmax agreement, how far TP2's own greedy
tokens follow TP1's, and whether the peer-memory and NCCL runs are bit-identical (they must be: both round
the sum of the two partials once). Writes <results>/tp2_check.json; exit status 1 if a check fails.
GEMV tuning is off (NINFER_GEMV_TUNE=0, default configs) unless --tune: numerics do not depend on it.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from ninfer_formats.atomic import write_json_atomic  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LOGITS_REL_TOL = 3e-2      # TP2 rounds two bf16 partials per projection where TP1 rounds one fp32 sum
ARGMAX_MIN = 0.9           # of teacher-forced steps whose argmax matches TP1's (random logits: close calls)
PAGE = 16


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the artifacts ----
def join_rows(fmt: str, pieces: list, shapes: list):
    """Concatenate encoded row ranges of one tensor (dim-0 cuts with several runs, e.g. in_proj_qkv's q|k|v)."""
    from ninfer_formats.codecs import fp8, nvfp4
    if fmt == "nvfp4":
        parts = [nvfp4.split(p, s) for p, s in zip(pieces, shapes)]
        return nvfp4.join(np.concatenate([c for c, _, _ in parts]), np.concatenate([s for _, s, _ in parts]),
                          parts[0][2])
    if fmt == "f8_e4m3_row":
        parts = [fp8.split(p, s) for p, s in zip(pieces, shapes)]
        return fp8.join(np.concatenate([s for s, _ in parts]), np.concatenate([c for _, c in parts]))
    return np.concatenate(pieces)        # plain and GGML formats: rows are whole runs of bytes


def cut(name: str, fmt: str, data, shape: tuple, split, rank: int):
    """Rank `rank`'s encoded bytes of a tensor under `split` (ninfer_pack.tp_split.Split)."""
    from ninfer_formats.codecs import slice_encoded
    if split.replicated:
        return np.array(data, copy=True)
    pieces, shapes = [], []
    for a, b in split.ranges[rank]:
        data_r, shape_r = slice_encoded(fmt, data, shape, split.dim, a, b, name=name)
        pieces.append(data_r)
        shapes.append(shape_r)
    return pieces[0] if len(pieces) == 1 else join_rows(fmt, pieces, shapes)


def reshard(src: str, out_dir: str, tp: int) -> list[str]:
    """Cut a TP1 rank file into a TP `tp` set in `out_dir` (reused when it already holds this cut)."""
    from ninfer_formats.container import (
        ArtifactPlan,
        RankWriter,
        TensorSpec,
        finalize_set,
        open_artifact,
    )

    from ninfer_pack.tp_split import plan_split
    with open_artifact(src) as a:
        source = f"tp{tp} cut of {a.artifact_id}"
        found = _existing(out_dir, tp, source)
        if found:
            return found
        splits = {n: plan_split(n, e.shape, a.config, tp, e.fmt) for n, e in a.tensors.items()}
        resources = {n: a.resource(n) for n in a.resources}
        meta = {"source": source, "recipe": a.identity.get("recipe", {}), "producer": "bench/tp2_check.py"}
        stem = os.path.basename(src).split(".tp1-rank0")[0]
        os.makedirs(out_dir, exist_ok=True)
        from ninfer_formats.container import rank_file_name
        writers = [RankWriter(os.path.join(out_dir, rank_file_name(stem, tp, r)), ArtifactPlan(
            a.config, tp, r, [TensorSpec(n, splits[n].rank_shape, e.fmt) for n, e in a.tensors.items()],
            resources, meta)) for r in range(tp)]
        try:
            for n, e in a.tensors.items():
                raw = a.raw(n)
                for r, w in enumerate(writers):
                    w.write(n, cut(n, e.fmt, raw, tuple(e.shape), splits[n], r))
            return finalize_set(writers)
        finally:
            for w in writers:
                w.close()


def _existing(folder: str, tp: int, source: str) -> list[str] | None:
    from ninfer_formats.container import open_artifact
    from ninfer_formats.errors import NinferError
    if not os.path.isdir(folder):
        return None
    paths = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".ninfer") and f".tp{tp}-" in f)
    try:
        for p in paths:
            with open_artifact(p) as a:
                if a.identity.get("source") != source:
                    return None
    except (NinferError, OSError):
        return None
    return paths if len(paths) == tp else None


def build_artifacts(opts: dict) -> tuple[str, str, dict]:
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.append(here)
    import synth_artifact as synth
    base = synth.TINY if opts["tiny"] else synth.SynthShape()
    shape = dataclasses.replace(base, layers=opts["layers"], vocab=opts["vocab"], mtp=False)
    t0 = time.perf_counter()
    paths, info = synth.build(os.path.join(opts["dir"], "tp1"), shape, opts["recipe"], 1, seed=opts["seed"],
                              log=log)
    t1 = time.perf_counter()
    reshard(paths[0], os.path.join(opts["dir"], "tp2"), 2)
    return os.path.join(opts["dir"], "tp1"), os.path.join(opts["dir"], "tp2"), {
        "synth_s": round(t1 - t0, 2), "reshard_s": round(time.perf_counter() - t1, 2), "reused": info["reused"],
        "shape": {"layers": shape.layers, "hidden": shape.hidden, "intermediate": shape.intermediate,
                  "vocab": shape.vocab}}


# ---- the runs ----
def make_model(path: str, rank: int, tp_size: int, group, opts: dict):
    from ninfer_rt.backends import get_ops
    from ninfer_rt.loader import load
    from ninfer_rt.model import Model
    from ninfer_rt.state import CacheConfig
    device = group.device if group is not None else torch.device(opts["device"], 0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    loaded = load(path, rank=rank, tp_size=tp_size, device=device, dtype=dtype)
    pages = -(-(opts["prompt_len"] + opts["steps"] + 1) // PAGE) + 2
    model = Model(loaded.config, loaded.weights, get_ops(opts["backend"]), group,
                  cache=CacheConfig(num_pages=pages, page_size=PAGE, max_seqs=2), consume_weights=True)
    loaded.close()
    return model


def decode(model, prompt: torch.Tensor, steps: int, forced=None) -> tuple[torch.Tensor, list[int]]:
    """Prefill `prompt`, then `steps` one-token steps fed `forced` tokens (or the greedy choice):
    -> (logits [steps + 1, V] fp32 on CPU, the tokens fed)."""
    from ninfer_rt.model import SeqInput
    st = model.new_state()
    rows = [model.forward([SeqInput(prompt, st, logits="last")]).logits[-1].float()]
    toks = []
    for i in range(steps):
        tok = int(forced[i]) if forced is not None else int(rows[-1].argmax())
        toks.append(tok)
        rows.append(model.forward([SeqInput(torch.tensor([tok]), st)]).logits[-1].float())
    st.free()
    return torch.stack(rows).cpu(), toks


class PathCounter:
    """Counts which implementation each of the group's all-reduces takes (wraps group.all_reduce)."""

    def __init__(self, group):
        self.group, self.inner, self.counts = group, group.all_reduce, {}
        group.all_reduce = self

    def __call__(self, x):
        impl = self.group.p2p.pick(x) if self.group.p2p is not None else "nccl"
        key = f"{impl} {x.numel() * x.element_size()} B"
        self.counts[key] = self.counts.get(key, 0) + 1
        return self.inner(x)


def tp2_rank(group, opts: dict, prompt: torch.Tensor, forced: list[int]):
    """Every rank: teacher-forced with peer memory, teacher-forced with NCCL, free-running greedy."""
    torch.set_grad_enabled(False)
    model = make_model(opts["tp2"], group.rank, 2, group, opts)
    p2p = group.p2p
    info = {"p2p": p2p is not None, "p2p_eager_by_calibration": None if p2p is None else p2p.eager}
    decode(model, prompt, min(2, opts["steps"]), forced)   # compile the kernels outside the compared runs
    if p2p is not None:
        p2p.eager = True                                 # eager calls too: this run must use the path
    counter = PathCounter(group)
    with_p2p, _ = decode(model, prompt, opts["steps"], forced)
    info["calls_per_run"] = dict(counter.counts)
    group.p2p = None
    with_nccl, _ = decode(model, prompt, opts["steps"], forced)
    group.p2p = p2p
    _, free_toks = decode(model, prompt, opts["steps"])
    return (info, with_p2p, with_nccl, free_toks) if group.rank == 0 else None


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    rel = (got.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)
    agree = (got.argmax(-1) == ref.argmax(-1)).double().mean()
    return {"rel_l2_max": float(rel.max()), "rel_l2_mean": float(rel.mean()), "argmax_agree": float(agree),
            "finite": bool(torch.isfinite(got).all())}


def within(c: dict) -> bool:
    return c["finite"] and c["rel_l2_max"] <= LOGITS_REL_TOL and c["argmax_agree"] >= ARGMAX_MIN


def report(opts, build, tp1_logits, tp1_toks, out, times) -> dict:
    info, with_p2p, with_nccl, free_toks = out
    a, b = compare(tp1_logits, with_p2p), compare(tp1_logits, with_nccl)
    diff = float((with_p2p - with_nccl).abs().max())
    first = next((i for i, (x, y) in enumerate(zip(tp1_toks, free_toks)) if x != y), None)
    gpu = torch.cuda.get_device_name(0) if opts["device"] == "cuda" else "cpu"
    res = {"bench": "tp2_check", "gpu": gpu, "torch": torch.__version__,
           "recipe": opts["recipe"], "backend": opts["backend"], "steps": opts["steps"],
           "prompt_len": opts["prompt_len"], **build, "allreduce": info, "tp2_p2p_vs_tp1": a,
           "tp2_nccl_vs_tp1": b, "p2p_vs_nccl_max_abs": diff, "p2p_vs_nccl_identical": diff == 0.0,
           "p2p_used": any(not k.startswith("nccl") for k in info["calls_per_run"]),
           "greedy": {"tp1": tp1_toks, "tp2": free_toks, "first_divergence": first,
                      "agree": sum(x == y for x, y in zip(tp1_toks, free_toks)) / max(1, len(tp1_toks))},
           "tolerances": {"logits_rel_l2": LOGITS_REL_TOL, "argmax_min": ARGMAX_MIN}, "seconds": times}
    res["ok"] = within(a) and within(b) and res["p2p_vs_nccl_identical"]
    return res


def run(opts: dict) -> dict:
    from ninfer_rt import tp
    t0 = time.perf_counter()
    tp1_dir, tp2_dir, build = build_artifacts(opts)
    opts = {**opts, "tp2": tp2_dir}
    g = torch.Generator().manual_seed(opts["seed"] + 1)
    prompt = torch.randint(0, opts["vocab"], (opts["prompt_len"],), generator=g)
    t1 = time.perf_counter()
    torch.set_grad_enabled(False)
    if opts["device"] == "cuda":
        torch.cuda.set_device(0)
    model = make_model(tp1_dir, 0, 1, None, opts)
    decode(model, prompt, 2)
    tp1_logits, tp1_toks = decode(model, prompt, opts["steps"])
    del model
    gc.collect()
    if opts["device"] == "cuda":
        torch.cuda.empty_cache()
    t2 = time.perf_counter()
    log(f"tp2_check: TP1 done ({t2 - t1:.1f} s); launching TP2")
    with tp.launch(2, tp2_rank, (opts, prompt, tp1_toks), device=opts["device"]) as lch:
        out = tp2_rank(lch.group, opts, prompt, tp1_toks)
    times = {"build": round(t1 - t0, 2), "tp1": round(t2 - t1, 2), "tp2": round(time.perf_counter() - t2, 2)}
    return report(opts, build, tp1_logits, tp1_toks, out, times)


write_json = write_json_atomic


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "ninfer-tp2check"))
    ap.add_argument("--recipe", default="nvfp4", help="packer recipe of the synthetic model (nvfp4, bf16, ...)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=None, help="default 32768 (--tiny: the tiny shape's)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="triton", choices=["triton", "torch"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run over gloo")
    ap.add_argument("--tiny", action="store_true", help="bench/synth_artifact.py's tiny shape (dry runs)")
    ap.add_argument("--tune", action="store_true", help="let the GEMV tuner time configs (slower start)")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.vocab is None:
        args.vocab = 1024 if args.tiny else 32768
    if min(args.layers, args.vocab, args.steps, args.prompt_len) <= 0 or args.vocab % 2:
        print("error: --layers, --vocab, --steps, --prompt-len must be positive (--vocab even)", file=sys.stderr)
        return 2
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print(f"error: needs 2 GPUs, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    if not args.tune:
        os.environ["NINFER_GEMV_TUNE"] = "0"
    opts = {k: getattr(args, k) for k in ("dir", "recipe", "layers", "vocab", "steps", "prompt_len", "seed",
                                           "backend", "device", "tiny")}
    from ninfer_formats.errors import NinferError
    try:
        res = run(opts)
    except (NinferError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_json(args.results / "tp2_check.json", res)
    if args.json:
        print(json.dumps({k: v for k, v in res.items() if k != "greedy"}, indent=1))
    else:
        for key in ("tp2_p2p_vs_tp1", "tp2_nccl_vs_tp1"):
            c = res[key]
            print(f"{key}: logits rel L2 max {c['rel_l2_max']:.2e} mean {c['rel_l2_mean']:.2e}, argmax agree "
                  f"{c['argmax_agree']:.3f}")
        used = "" if res["p2p_used"] else " -- peer memory NOT used (see the launch's all-reduce line)"
        print(f"peer memory vs NCCL: max |diff| {res['p2p_vs_nccl_max_abs']:.3g} "
              f"({'identical' if res['p2p_vs_nccl_identical'] else 'DIFFERENT'}); all-reduce {res['allreduce']}{used}")
        g = res["greedy"]
        print(f"greedy TP2 vs TP1: {g['agree']:.3f} of {len(g['tp1'])} tokens agree, first divergence "
              f"{g['first_divergence']}; {'OK' if res['ok'] else 'FAILED'}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
