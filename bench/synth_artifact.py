"""A 27B-shaped `.ninfer` artifact of random but valid weights, written straight through the container writer.

    python bench/synth_artifact.py --recipe nvfp4 --dir /tmp/synth [--tp 2] [--tiny | --layers 4 --hidden 256 ...]

Every tensor of the real inventory (64 layers = 48 GDN + 16 full attention, vocab 248320, the MTP layer) at
its per-rank shape (the packer's TP split table), in the format the packer's recipe gives it. Contents:
- nvfp4: random codes; E4M3 block scales drawn from 0x28..0x37 (0.25..0.94: finite, positive); one global
  scale per K, so fusion groups share it, sized for a weight RMS of 0.5 / sqrt(K);
- q6_k / iq3_s: random block bytes with the fp16 super-block scale d set to a small finite value (same RMS);
- bf16 matrices: random signs and mantissas, exponents in a two-value band; 1-D gains, A_log, dt_bias and
  conv taps from small normals (A_log stays f32 as in the checkpoints).
With --tp N each rank's tensors are generated at the rank shape (not cut from one full matrix: the values are
random anyway). Random bytes come from numpy's SFC64 `random_raw`; tensors are spread over forked worker
processes that pwrite into the shared `.partial` files (RankWriter is process-safe), then `finalize_set`.
An existing artifact whose identity.source equals this build's spec string is reused as is.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing as mp
import os
import sys
import time
import zlib
from dataclasses import asdict, dataclass, fields, replace

import numpy as np
from ninfer_formats.codecs import bf16_bits
from ninfer_formats.constants import (
    FORMATS,
    IQ3_S_BLOCK_BYTES,
    NVFP4_HEADER,
    Q6_K_BLOCK_BYTES,
)
from ninfer_formats.container import (
    ArtifactPlan,
    RankWriter,
    TensorSpec,
    finalize_set,
    open_artifact,
    rank_file_name,
)
from ninfer_formats.errors import NinferError
from ninfer_formats.model_config import FULL, LINEAR, ModelConfig

from ninfer_pack.recipes import load_recipe
from ninfer_pack.tp_split import plan_split
from ninfer_rt.inventory import expected

# RMS of the random parts (derived from the code distributions; tests check the decoded RMS)
_E2M1_RMS = 2.93          # uniform random nibbles: sqrt(mean(e2m1^2)) over the 16 codes
_E4M3_RMS = 0.59          # codes 0x28..0x37
_Q6K_RMS = 18.5 * 73.9    # (L - 32) for random 6-bit L, times random int8 sub-block scales
_IQ3S_RMS = 18.5 * 7.5    # (1 + 2 s4) for random 4-bit s4, times the grid values
_WORKERS = None           # (writers) inherited by forked workers


@dataclass(frozen=True)
class SynthShape:
    """Model dimensions; the defaults are Qwen3.8-27B's (qwen38-architecture.md §2)."""

    layers: int = 64
    hidden: int = 5120
    intermediate: int = 17408
    vocab: int = 248320
    heads: int = 24
    kv_heads: int = 4
    head_dim: int = 256
    gdn_k_heads: int = 16
    gdn_v_heads: int = 48
    gdn_head_dim: int = 128
    full_every: int = 4
    mtp: bool = True

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", int) and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise NinferError(f"synth: --{f.name.replace('_', '-')} must be a positive integer, got {v!r}")

    def config(self) -> ModelConfig:
        types = [FULL if (i + 1) % self.full_every == 0 else LINEAR for i in range(self.layers)]
        return ModelConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                           linear_num_key_heads=self.gdn_k_heads, linear_num_value_heads=self.gdn_v_heads,
                           linear_key_head_dim=self.gdn_head_dim, linear_value_head_dim=self.gdn_head_dim,
                           linear_conv_kernel_dim=4, layer_types=types, eos_token_ids=(self.vocab - 1,),
                           mtp_num_hidden_layers=int(self.mtp), extra={"synthetic": True})


TINY = SynthShape(layers=4, hidden=256, intermediate=512, vocab=1024, heads=8, kv_heads=2, head_dim=64,
                  gdn_k_heads=2, gdn_v_heads=8, gdn_head_dim=64)


def spec_string(shape: SynthShape, recipe: str, tp: int, seed: int) -> str:
    return "synthetic " + json.dumps({"shape": asdict(shape), "recipe": recipe, "tp": tp, "seed": seed, "v": 1},
                                     sort_keys=True)


def stem_for(spec: str, recipe: str) -> str:
    return f"synth-{recipe}-{hashlib.sha256(spec.encode()).hexdigest()[:10]}"


def rank_tensors(cfg: ModelConfig, recipe: str, tp: int) -> list[list[tuple[str, str, tuple]]]:
    """[rank] -> [(name, fmt, per-rank shape)] in inventory order."""
    rec = load_recipe(recipe)
    full = expected(cfg, 1)
    out = [[] for _ in range(tp)]
    for name, shape in full.items():
        fmt = rec.format_for(name, "f32" if name.endswith("A_log") else "bf16")
        rank_shape = plan_split(name, shape, cfg, tp, fmt).rank_shape
        for r in range(tp):
            out[r].append((name, fmt, tuple(rank_shape)))
    return out


# ---- tensor contents ----
def _raw(nbytes: int, seed: int) -> np.ndarray:
    words = np.random.SFC64(seed).random_raw(-(-nbytes // 8))
    return words.view(np.uint8)[:nbytes]


def _bf16_random(n: int, rms: float, seed: int) -> np.ndarray:
    """Random bf16 bit patterns: sign, mantissa and the exponent's low bit random (two in-place passes)."""
    v = _raw(2 * n, seed).view(np.uint16)
    e = 127 + round(math.log2(rms / 2.415))   # value = 2^(e-127+b) * m, b in {0, 1}, m in [1, 2)
    if not 1 <= e <= 253:
        raise NinferError(f"synth: weight RMS {rms} is out of the bf16 range")
    np.bitwise_and(v, np.uint16(0x80FF), out=v)     # keep sign, exponent bit 0, mantissa
    np.add(v, np.uint16(e << 7), out=v)             # exponent field 0|1 -> e|e+1 (no carry into the sign)
    return v


def _d16(x: float) -> np.uint16:
    return np.array([x], dtype=np.float16).view(np.uint16)[0]


def _small(name: str, shape: tuple, fmt: str, seed: int) -> np.ndarray:
    """1-D gains, A_log, dt_bias, conv taps: small normals in the plain format."""
    rng = np.random.default_rng(seed)
    if name.endswith("A_log"):
        x = np.log(rng.uniform(1.0, 16.0, shape))
    elif name.endswith("linear_attn.norm.weight"):           # plain w gain
        x = rng.normal(1.0, 0.05, shape)
    elif name.endswith("conv1d.weight"):
        x = rng.normal(0.0, 0.3, shape)
    elif name.endswith("dt_bias"):
        x = rng.normal(0.0, 0.5, shape)
    else:                                                    # (1 + w) gains
        x = rng.normal(0.0, 0.05, shape)
    x = x.astype(np.float32)
    return x.view(np.uint8).reshape(-1) if fmt == "f32" else bf16_bits(x).view(np.uint8).reshape(-1)


def make_tensor(name: str, fmt: str, shape: tuple, seed: int) -> np.ndarray:
    """The container bytes (u8 1-D) of one random but valid tensor."""
    if len(shape) == 1 or name.endswith("conv1d.weight"):
        return _small(name, shape, fmt, seed)
    n, k = shape
    rms = 0.02 if name == "embed_tokens.weight" else 0.5 / math.sqrt(k)
    if fmt in ("f16", "f32"):
        x = (np.random.default_rng(seed).standard_normal(shape) * rms).astype(np.float32)
        return x.astype(np.float16 if fmt == "f16" else np.float32).view(np.uint8).reshape(-1)
    if fmt == "bf16":
        return _bf16_random(n * k, rms, seed).view(np.uint8)
    data = _raw(FORMATS[fmt].encoded_size(shape), seed)
    if fmt == "nvfp4":
        data[:NVFP4_HEADER] = 0
        data[:4] = np.array([rms / (_E2M1_RMS * _E4M3_RMS)], dtype="<f4").view(np.uint8)
        scales = data[NVFP4_HEADER + n * k // 2:]
        np.bitwise_and(scales, 0x0F, out=scales)
        np.add(scales, 0x28, out=scales)
    elif fmt == "q6_k":
        data.view(np.uint16).reshape(-1, Q6_K_BLOCK_BYTES // 2)[:, 104] = _d16(rms / _Q6K_RMS)   # d at byte 208
    elif fmt == "iq3_s":
        data.view(np.uint16).reshape(-1, IQ3_S_BLOCK_BYTES // 2)[:, 0] = _d16(rms / _IQ3S_RMS)    # d at byte 0
    else:
        raise NinferError(f"synth: tensor {name}: format {fmt} is not generated by this tool")
    return data


def _seed(base: int, rank: int, name: str) -> int:
    return (base << 40) ^ (rank << 32) ^ zlib.crc32(name.encode())


def usable_cpus(cap: int = 32) -> int:
    """CPUs this process may run on (a container's cpuset, not the host's count), at most `cap`."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(cap, n))


def _job(task) -> int:
    rank, name, fmt, shape, seed = task
    data = make_tensor(name, fmt, shape, seed)
    _WORKERS[rank].write(name, data)
    return data.nbytes


# ---- building ----
def existing(folder: str, stem: str, tp: int, spec: str) -> list[str] | None:
    paths = [os.path.join(folder, rank_file_name(stem, tp, r)) for r in range(tp)]
    try:
        for p in paths:
            with open_artifact(p) as a:
                if a.identity.get("source") != spec:
                    return None
    except (NinferError, OSError):
        return None
    return paths


def tokenizer_resources() -> dict[str, bytes]:
    """The shipped tiny model's tokenizer and template, so `generate`/`serve` can run on the synthetic
    artifact (its ids cover the first 4096 of the vocab; sampled ids beyond decode to nothing)."""
    tiny = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ninfer_pack", "tiny")
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
    return {n: open(os.path.join(tiny, n), "rb").read() for n in names if os.path.exists(os.path.join(tiny, n))}


def build(folder: str, shape: SynthShape = SynthShape(), recipe: str = "nvfp4", tp: int = 1, *, seed: int = 0,
          workers: int | None = None, log=None) -> tuple[list[str], dict]:
    """Write (or reuse) the artifact; -> (rank file paths, {"bytes", "build_s", "reused", "tensors"})."""
    global _WORKERS
    cfg = shape.config()
    spec = spec_string(shape, recipe, tp, seed)
    stem = stem_for(spec, recipe)
    os.makedirs(folder, exist_ok=True)
    t0 = time.perf_counter()
    found = existing(folder, stem, tp, spec)
    if found:
        return found, {"bytes": sum(os.path.getsize(p) for p in found), "build_s": 0.0, "reused": True}
    per_rank = rank_tensors(cfg, recipe, tp)
    meta = {"source": spec, "recipe": load_recipe(recipe).describe(), "producer": "bench/synth_artifact.py"}
    res = tokenizer_resources()
    writers = [RankWriter(os.path.join(folder, rank_file_name(stem, tp, r)),
                          ArtifactPlan(cfg, tp, r, [TensorSpec(n, s, f) for n, f, s in per_rank[r]], res, meta))
               for r in range(tp)]
    try:
        done = [w.done() for w in writers]           # resume a build cut short (same spec -> same plan)
        tasks = [(r, n, f, s, _seed(seed, r, n)) for r in range(tp) for n, f, s in per_rank[r] if n not in done[r]]
        tasks.sort(key=lambda t: -FORMATS[t[2]].encoded_size(t[3]))     # biggest first: better balance
        _WORKERS = writers
        n_workers = max(1, min(workers or usable_cpus(), len(tasks) or 1))
        if n_workers == 1 or len(tasks) < 2:
            written = sum(_job(t) for t in tasks)
        else:
            with mp.get_context("fork").Pool(n_workers) as pool:
                written = sum(pool.imap_unordered(_job, tasks, chunksize=1))
        if log:
            log(f"synth: wrote {written / 1e9:.2f} GB in {len(tasks)} tensors, finalizing")
        paths = finalize_set(writers)
    finally:
        _WORKERS = None
        for w in writers:
            w.close()
    return paths, {"bytes": sum(os.path.getsize(p) for p in paths), "build_s": time.perf_counter() - t0,
                   "reused": False}


def planned_bytes(shape: SynthShape, recipe: str, tp: int) -> int:
    """Tensor payload bytes of the whole TP set (a lower bound on the disk space needed)."""
    return sum(FORMATS[f].encoded_size(s) for rank in rank_tensors(shape.config(), recipe, tp) for _, f, s in rank)


# ---- CLI ----
def add_shape_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tiny", action="store_true", help="a tiny model (4 layers, hidden 256) for CPU dry runs")
    for f in fields(SynthShape):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            ap.add_argument("--no-" + f.name, dest=f.name, action="store_false", default=None,
                            help="leave out the MTP layer")
        else:
            ap.add_argument(flag, type=int, default=None, help=f"(default {f.default}, --tiny {getattr(TINY, f.name)})")


def shape_from_args(args) -> SynthShape:
    base = TINY if args.tiny else SynthShape()
    given = {f.name: getattr(args, f.name) for f in fields(SynthShape) if getattr(args, f.name) is not None}
    return replace(base, **given)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="nvfp4", help="built-in packer recipe (nvfp4, q6_k, iq3_s, bf16)")
    ap.add_argument("--dir", required=True, help="output folder")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=None, help="writer processes (default: usable cores, at most 32)")
    ap.add_argument("--json", action="store_true")
    add_shape_args(ap)
    args = ap.parse_args(argv)
    try:
        paths, info = build(args.dir, shape_from_args(args), args.recipe, args.tp, seed=args.seed,
                            workers=args.workers, log=lambda m: print(m, file=sys.stderr))
    except (NinferError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    info["paths"] = paths
    print(json.dumps(info, indent=1) if args.json else "\n".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())


def add_engine_args(ap: argparse.ArgumentParser, out) -> None:
    """The flags of a benchmark that runs the real Engine on a synthetic artifact (`engine_artifact`)."""
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--backend", choices=("triton", "torch"), default=None, help="default triton on cuda, torch on cpu")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--dir", default=None, help="artifact folder (default /dev/shm/ninfer-bench when it fits)")
    ap.add_argument("--out", default=str(out))
    add_shape_args(ap)


def engine_artifact(args, log) -> str:
    """The rank-0 file of the TP1 --recipe artifact of the shape flags (built in --dir unless it is there), for a
    benchmark that runs the real Engine on --device; a missing CUDA device is a NinferError first."""
    from bench_cli import pick_dir
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise NinferError("--device cuda: no CUDA device here (use --device cpu for a dry run)")
    shape = shape_from_args(args)
    folder = os.path.join(pick_dir(args.dir, planned_bytes(shape, args.recipe, 1)), f"{args.recipe}-tp1")
    paths, info = build(folder, shape, args.recipe, 1, log=log)
    log(f"artifact {'reused' if info['reused'] else 'built'}: {info['bytes'] / 1e9:.2f} GB in {folder}")
    return paths[0]
