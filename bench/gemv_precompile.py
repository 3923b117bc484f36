"""The GEMV benchmarks' parallel precompile: compile, in worker processes, what a run will launch, so the run
itself finds every binary in Triton's cache (bench/kernels.py before it tunes, bench/decode_rank.py before it
loads a model).

What a run launches per tuner key (`_to_compile`, `_launched`): the remembered config (user cache or shipped table)
on the path the runtime takes (bf16 or prepared activations), with and without a residual; every candidate on both
paths where nothing is remembered, or when tuning is forced (NINFER_GEMV_TUNE=force: bench/kernels.py's default,
which this module does not set -- importing bench/kernels.py made the decode bench's precompile compile every
candidate, bench/NOTES.md §23). Jobs are merged when they would compile the same binaries.
"""
from __future__ import annotations

import sys
import time

import torch

DEV = "cuda"
_SIG_DTYPES = {"*i64": torch.int64, "*i32": torch.int32, "*i16": torch.int16, "*i8": torch.int8,
               "*u8": torch.uint8, "*fp16": torch.float16, "*fp32": torch.float32}
_KMOD = {"nvfp4": "nvfp4", "q6_k": "q6_k", "iq3_s": "iq3_s", "f8_e4m3_row": "f8", "bf16": "plain"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _spec(v: int) -> str:
    return "1" if v == 1 else ("D" if v % 16 == 0 else "")


def kernel_spec(fmt: str):
    import importlib
    from ninfer_kernels.gemv_iq3_s4 import layout
    kmod = "iq3_s4" if fmt == "iq3_s" and layout() == "codes4" else _KMOD[fmt]   # NINFER_IQ3S_LAYOUT's planes
    mod = importlib.import_module(f"ninfer_kernels.gemv_{kmod}")
    if fmt == "bf16":
        kern, wsig, _ = mod.kernel_for("plain:bf16")
        return mod._PlainKernel(0), wsig, 4
    kern, wsig, _ = mod.kernel_for(fmt)
    return kern, wsig, mod.GS


def _to_compile(name: str, cands: list, N: int, G: int, gs: int, T: int, res: bool, dev) -> list:
    """What a run launches for one tuner key: the remembered config (user cache or shipped table, found as
    `gemv_launch.choose_config` finds it) when there is one and tuning is not forced, else every candidate the
    tuner will time."""
    from ninfer_kernels import gemv_launch as gl
    from ninfer_kernels import gemv_tune_cache as tc
    if gl.tune_mode() != "force" and len(cands) > 1:
        hit = tc.lookup(tc.make_key(gl.tune_key(name, N, G, T, torch.bfloat16, res, dev), gs, dev), gs)
        if hit is not None:
            return [hit]
    return cands


def _precompile_inputs(kern, fmt: str, N: int, K: int, T: int, gs: int, dev, res: bool) -> list:
    """(activations, extra constexprs, tuner name, candidates) of each launch a run takes for this weight, T and
    residual (`_launched`): the bf16 one and / or the prepared-activation one (`ninfer_kernels.x16`, rows as the
    runtime allocates them)."""
    from ninfer_kernels import gemv_launch as gl
    from ninfer_kernels import x16
    plain, prepared = _launched(fmt, N, K, T, res, dev)
    out = []
    if plain:
        out.append((torch.zeros(T, K, dtype=torch.bfloat16, device=dev), None, kern.__name__,
                    gl.kernel_candidates(kern, T, N, K // gs, gs, torch.bfloat16, dev)))
    if prepared:
        out.append((x16.empty_prepared(T, K, dev), {"XPRE": True}, kern.__name__ + x16.XPRE_SUFFIX,
                    x16.prepared_candidates(kern, fmt, T, N, K, torch.bfloat16, dev)))
    return out


def _launched(fmt: str, N: int, K: int, T: int, res: bool, dev) -> tuple[bool, bool]:
    """(bf16 launch, prepared launch): which of the two a run takes for this weight, T and residual -- the
    runtime's choice (`x16.xpre_on`, `prepared_ok`, `prefer_prepared`) unless tuning is forced, when the tuner
    times both. Compiling the other one cost ~1 min of every fresh machine's precompile (bench/NOTES.md §23)."""
    from types import SimpleNamespace

    from ninfer_kernels import gemv_launch as gl
    from ninfer_kernels import x16
    qw = SimpleNamespace(fmt=fmt, shape=(N, K), cache={})
    if not x16.prepared_ok(qw, T, dev):          # no prepared form of this format / shape / T
        return True, False
    if gl.tune_mode() == "force":
        return True, True
    prep = x16.xpre_on(x16.xpre_env(), dev) and x16.prefer_prepared(qw, T, torch.bfloat16, res, dev)
    return not prep, prep


def _precompile_job(job) -> str:
    fmt, N, K, T = job
    from ninfer_kernels import gemv_launch as gl
    kern, wsig, gs = kernel_spec(fmt)
    dev = torch.device(DEV)
    weights = tuple(torch.empty(64, dtype=_SIG_DTYPES[s], device=dev) for s in wsig.values())
    out = torch.empty(T, N, dtype=torch.bfloat16, device=dev)
    done = 0
    for res in (None, out):   # the out-projections add the residual; --check runs with one too
        for x, extra, name, cands in _precompile_inputs(kern, fmt, N, K, T, gs, dev, res is not None):
            for c in _to_compile(name, cands, N, K // gs, gs, T, res is not None, dev):
                try:
                    gl._launch(kern, weights, x, N, K // gs, 1.0, out, res, c, warmup=True, extra=extra)
                    done += 1
                except Exception as e:  # the tuner skips configs that fail; so does the precompile
                    log(f"  precompile {fmt} {N}x{K} T={T} {name} {c}: {type(e).__name__}: "
                        f"{str(e).splitlines()[0][:120]}")
    return f"{fmt} {N}x{K} T={T}: {done}"


def precompile(jobs, workers: int) -> None:
    """Compile in `workers` processes what a run will launch: the remembered configs, or what the tuner will try
    where none is (`_to_compile`); the main process then loads the cached binaries. Jobs that differ only in
    values Triton does not specialize on are compiled once."""
    from ninfer_kernels import gemv_launch as gl
    dev = torch.device(DEV)
    uniq = {}
    for fmt, N, K, T in jobs:
        kern, _, gs = kernel_spec(fmt)
        G = K // gs
        sig = frozenset((name, res, (c.block_n, c.block_g, c.num_warps, c.num_stages, c.use_dot, c.t_tile, c.h2,
                                     c.mma), _spec(gl.effective_split(c, G)))
                        for res in (False, True)
                        for _, _, name, cands in _precompile_inputs(kern, fmt, N, K, T, gs, dev, res)
                        for c in _to_compile(name, cands, N, G, gs, T, res, dev))
        uniq.setdefault((fmt, T, _spec(N), _spec(G), _spec(K), sig), (fmt, N, K, T))
    t0 = time.time()
    import multiprocessing as mp
    with mp.get_context("spawn").Pool(workers) as pool:
        for msg in pool.imap_unordered(_precompile_job, list(uniq.values())):
            log(f"  compiled {msg}")
    log(f"precompiled {len(uniq)} kernel groups in {time.time() - t0:.0f} s with {workers} workers")
