"""One TP rank of bench/decode.py for one recipe: measure the ceilings, load the rank file, build the model and
the graph runner, run the enabled parts, and stream the records back (rank 0; followers run the same calls).

Runs in a spawned child per recipe (`child_main`), so the orchestrator never touches CUDA (its artifact
builder forks freely) and each recipe starts with an empty GPU.
"""
from __future__ import annotations

import math
import os
import signal
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, fields, replace

import bench_device as D
import decode_measure as M
import decode_profile
import decode_tp as T
import torch

from ninfer_formats.errors import NinferError

ACCEPTANCE = (0.6, 0.75, 0.9)
HEADLINE_ACCEPTANCE = 0.75          # the verify record's tok_s (the others go to tok_s_by_acceptance)
PAGE = 16


@dataclass(frozen=True)
class BenchOptions:
    parts: tuple[str, ...] = ("decode", "profile", "verify", "prefill")
    contexts: tuple[int, ...] = (1024, 32768)
    verify_contexts: tuple[int, ...] = (1024,)
    max_draft: int = 5
    steps: int = 64
    warm: int = 8
    headroom: int = 1024               # KV positions past each context the loops may use
    prefill_tokens: int = 8192
    prefill_chunk: int = 8192
    prefill_runs: int = 2
    tp: int = 1
    device: str = "cuda"
    backend: str = "triton"
    dtype: str = "bfloat16"
    eager: bool = False
    precompile: bool = True            # compile the GEMV configs the tuner will try in parallel processes
    compare_allreduce: str = "auto"    # TP > 1: decode again with the process-group all-reduce (auto: when
                                       # the peer-memory path is in use; always; off)
    copy_mb: int = 4096
    matmul_n: int = 8192

    def __post_init__(self):
        if self.compare_allreduce not in ("auto", "always", "off"):
            raise NinferError(f"compare_allreduce: {self.compare_allreduce!r} is not auto, always or off")
        for f in fields(self):
            v, low = getattr(self, f.name), 0 if f.name in ("warm", "max_draft", "headroom") else 1
            if f.type in ("int", int) and v < low:
                raise NinferError(f"{f.name}: {v} is out of range (at least {low})")
        if not set(self.verify_contexts) <= set(self.contexts):
            raise NinferError(f"verify_contexts {list(self.verify_contexts)} are not all among the contexts "
                              f"{list(self.contexts)}: no verify step would run there")


def _gdn_tiles() -> dict:
    """The GDN recurrence tile each T bucket's first launch picked, with the times it measured."""
    try:
        from ninfer_kernels import gdn_recurrent
    except ImportError:
        return {}
    return gdn_recurrent.picks()


def _device(group, opts: BenchOptions) -> torch.device:
    dev = getattr(group, "device", None)
    if dev is not None:
        return torch.device(dev)
    return torch.device("cuda", torch.cuda.current_device()) if opts.device == "cuda" else torch.device("cpu")


def _warm_page_cache(path: str) -> None:
    buf = bytearray(64 << 20)
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.readv(fd, [buf]):
            pass
    finally:
        os.close(fd)


def _check_backend(opts: BenchOptions, device) -> str:
    if opts.backend != "triton":
        return opts.backend
    from ninfer_rt.backends import triton_ops
    if device.type == "cuda" and triton_ops.LINEAR_BACKEND != "ninfer_kernels.dispatch":
        raise NinferError("the fused GEMV dispatch (ninfer_kernels.dispatch) is not importable: linear would "
                          "dequantize every weight through numpy; refusing to benchmark that")
    return f"triton+{triton_ops.LINEAR_BACKEND}"


def _xpre_on(device) -> bool:
    from ninfer_kernels import x16
    return x16.xpre_on(x16.xpre_env(), device)


def _pdl_kw(device, preload: bool = False, state: bool = False) -> dict:
    from ninfer_kernels.pdl import pdl_kw
    return pdl_kw(device, preload=preload, state=state)


def _gates_join() -> str:
    from ninfer_rt.backends.side_stream import join_at
    return join_at()


def _gemv_evict() -> str:
    from ninfer_kernels.gemv_common import weight_evict_mode
    return weight_evict_mode()


def _pdl_mma() -> bool:
    from ninfer_kernels.pdl import mma_mode
    return mma_mode() == "1"


def _swiglu_on(device) -> bool:
    from ninfer_rt.backends.triton_ops import swiglu_epilogue_env, swiglu_epilogue_on
    return swiglu_epilogue_on(swiglu_epilogue_env(), device)


def _x16_align() -> int:
    from ninfer_kernels.x16_layout import ROW_ALIGN
    return ROW_ALIGN


def _split_unroll() -> int:
    from ninfer_kernels.gemv_split import SPLIT_UNROLL
    return SPLIT_UNROLL.value


def _split_arrive() -> str:
    from ninfer_kernels.gemv_split import split_arrive_sem
    return split_arrive_sem()


def _pdl_late() -> str:
    from ninfer_kernels.pdl import late_kernels
    return ",".join(sorted(late_kernels())) or "none"


def _runner(model, opts: BenchOptions):
    from ninfer_rt.graphs import GraphConfig, GraphRunner
    verify = "verify" in opts.parts
    buckets = tuple(sorted({c + opts.headroom for c in opts.contexts}))
    cfg = GraphConfig(batch_sizes=(1,), tokens=tuple(range(1, opts.max_draft + 2)) if verify else (1,),
                      mtp_tokens=(1,) if verify and model.mtp is not None else (), kv_buckets=buckets,
                      eager=opts.eager)
    return GraphRunner(model, cfg)


def _load(group, opts: BenchOptions, paths: list[str], device, info: dict):
    from ninfer_rt.backends import get_ops
    from ninfer_rt.loader import load
    from ninfer_rt.model import Model
    from ninfer_rt.state import CacheConfig
    path = paths[group.rank]
    if info.get("reused"):
        _warm_page_cache(path)
    dtype = getattr(torch, opts.dtype)
    t = time.perf_counter()
    loaded = load(path, rank=group.rank, tp_size=opts.tp, verify=True, device=device, dtype=dtype)
    D.sync(device)
    load_s = time.perf_counter() - t
    need = max(max(opts.contexts) + opts.headroom, opts.prefill_tokens) + 2 * PAGE
    # sequences: the measured one, the graph runner's scratch, a spare, three more for the batch-4 profile
    cache = CacheConfig(num_pages=math.ceil(need / PAGE) + 8, page_size=PAGE, max_seqs=6)
    t = time.perf_counter()
    model = Model(loaded.config, loaded.weights, get_ops(opts.backend), group, cache=cache, dtype=dtype,
                  consume_weights=True)
    D.sync(device)
    build_s = time.perf_counter() - t
    loaded.close()
    size = os.path.getsize(path)
    rec = {"kind": "load", "file_bytes": size, "load_s": load_s, "gbps": size / load_s / 1e9, "verify": True,
           "model_build_s": build_s, "artifact_build_s": info.get("build_s"), "reused": info.get("reused")}
    return model, rec


def _linear_shapes(model) -> set:
    """(format, N, K) of every fused linear the model calls."""
    parts = [model.blocks, model.lm_head, model.mtp, model.draft_head]
    return {(w.fmt, w.shape[0], w.shape[1]) for w in D.qweights(parts)}


def _precompile_proc(jobs, workers: int) -> None:
    import gemv_precompile
    gemv_precompile.precompile(jobs, workers=workers)


def _exit_on_sigterm(*_) -> None:
    sys.exit(128 + signal.SIGTERM)


def _limited_entry(target, args) -> None:
    # SIGTERM becomes SystemExit, so a `with Pool(...)` in target terminates its workers on the way out; a bare
    # SIGTERM would leave them orphaned (blocked on the task queue, or still compiling) while we measure
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    target(*args)


def run_limited(target, args: tuple, timeout_s: float) -> int | None:
    """target(*args) in a spawned process: its exit code, or None when cut off after `timeout_s` (SIGTERM,
    SIGKILL if it is still there 10 s later)."""
    import multiprocessing as mp
    p = mp.get_context("spawn").Process(target=_limited_entry, args=(target, args))
    p.start()
    p.join(timeout_s)
    if not p.is_alive():
        return p.exitcode
    p.terminate()
    p.join(10)
    if p.is_alive():
        p.kill()
        p.join(5)
    return None


def _precompile(model, opts: BenchOptions, device, timeout_s: float = 300.0) -> float | None:
    """Best effort: bench/gemv_precompile.py's parallel precompile of the GEMV configs the run launches, for the
    model's shapes at the T buckets the graphs and the prefill use. Runs in its own process with a time limit
    (the binaries land in Triton's cache); None when skipped, failed or cut off."""
    if device.type != "cuda" or not opts.precompile or os.environ.get("NINFER_GEMV_TUNE", "1") == "0":
        return None
    import multiprocessing as mp
    if mp.current_process().daemon:
        # TP followers run as daemonic processes, which may not start children (seen on 2xH200): rank 0's
        # precompile fills the shared Triton cache, the follower compiles what is left lazily
        return None

    from synth_artifact import usable_cpus
    ts = {1 << (k - 1).bit_length() for k in range(1, opts.max_draft + 2)}
    if "prefill" in opts.parts:
        ts.add(opts.prefill_chunk)
    jobs = [(f, n, k, t_) for f, n, k in sorted(_linear_shapes(model)) for t_ in sorted(ts)]
    t = time.perf_counter()
    code = run_limited(_precompile_proc, (jobs, usable_cpus(16)), timeout_s)
    if code is None:
        print(f"precompile cut off after {timeout_s:.0f} s", file=sys.stderr)
        return None
    if code != 0:
        print(f"precompile failed (exit code {code}); the tuner compiles lazily", file=sys.stderr)
        return None
    return time.perf_counter() - t


def _decode_record(runner, st, ctx, opts, ceil, base, wb) -> dict:
    """Greedy decode at context `ctx`: ms/step as the engine runs it (tok_s, ms_step: run ahead at TP1, where
    the engine does, ninfer_rt/engine_ahead.py), with the token read back before each next step (`_sync`: the
    engine at TP > 1 or with --no-async-scheduling, and the headline of every record before run s9), and
    GPU-pipelined (`_gpu`)."""
    ms = {m: M.decode_ms(runner, st, opts.steps, opts.warm, mode=m) for m in M.DECODE_MODES}
    head = ms["ahead"] if runner.model.tp.size == 1 else ms["sync"]
    nbytes = wb["target"] + M.state_bytes(runner.model, ctx)
    roof = nbytes / (ceil["copy_tbps"] * 1e12) * 1e3
    return {**base, "kind": "decode", "context": ctx, "draft_tokens": 0, "tok_s": 1e3 / head, "ms_step": head,
            "ms_step_ahead": ms["ahead"], "ms_step_sync": ms["sync"], "tok_s_sync": 1e3 / ms["sync"],
            "ms_step_gpu": ms["gpu"], "tok_s_gpu": 1e3 / ms["gpu"], "bytes_step": nbytes, "weight_bytes": wb["target"],
            "pct_roofline": 100 * roof / head, "pct_roofline_gpu": 100 * roof / ms["gpu"]}


def _with_allreduce(rec: dict, ar: dict | None, impl: str | None = None, forced: bool = False) -> dict:
    if ar is None:
        return rec
    rec = {**rec, **{k: v for k, v in ar.items() if k != "allreduce_messages"}, "allreduce_forced": forced}
    if impl is not None:
        rec["allreduce"] = impl
    return {**rec, **T.step_share(rec, ar)}


def _decode_parts(model, runner, opts, ceil, base, emit, gen, ar) -> None:
    wb, device = M.weight_bytes(model), model.device
    for ctx in opts.contexts:
        st = model.new_state()
        M.fill_context(model, st, ctx)
        if "decode" in opts.parts:
            emit(_with_allreduce(_decode_record(runner, st, ctx, opts, ceil, base, wb), ar))
        if "verify" in opts.parts and ctx in opts.verify_contexts:
            _verify(model, runner, st, ctx, opts, ceil, base, emit, gen, wb)
        # the profiler last: the verify steps timed after it ran 0.2-0.9 ms slower (bench/NOTES.md §11)
        if "profile" in opts.parts and ctx == opts.contexts[0] and device.type == "cuda":
            decode_profile.profile(model, runner, st, ctx, opts, base, emit)
        st.free()


def _forced_pg_decode(model, opts, ceil, base, emit, ar) -> None:
    """Decode again with the peer-memory path off (every all-reduce through the process group, as with
    NINFER_ALLREDUCE=nccl), in a decode-only graph runner captured for it. Every rank runs it."""
    group, wb = model.tp, M.weight_bytes(model)
    p2p, group.p2p = group.p2p, None
    runner = _runner(model, replace(opts, parts=("decode",)))
    try:
        runner.capture()
        for ctx in opts.contexts:
            st = model.new_state()
            M.fill_context(model, st, ctx)
            emit(_with_allreduce(_decode_record(runner, st, ctx, opts, ceil, base, wb), ar, T.pg_name(), True))
            st.free()
    finally:
        runner.close()
        group.p2p = p2p


def _verify(model, runner, st, ctx, opts, ceil, base, emit, gen, wb) -> None:
    """Verify steps K = 1..max_draft against K = 0, timed in interleaved rounds (`decode_measure.verify_rounds`):
    ms_step is a K's median round, verify_ratio the median of the per-round ratios to K = 0. The same again
    without the per-step read-back (`*_gpu`: the GPU's time, steps pipelined) and the host's ms per step in
    forward + commit (`host_ms`): how much of a verify step the GPU spends waiting for the host."""
    ks, host = range(opts.max_draft + 1), {}
    rounds = M.verify_rounds(runner, st, ks, opts.steps, opts.warm, gen, host=host)
    gpu = M.verify_rounds(runner, st, ks, opts.steps, opts.warm, gen, sync=False)
    times = {k: statistics.median(v) for k, v in rounds.items()}
    draft = M.draft_ms(runner, st, opts.steps, opts.warm) if model.mtp is not None else None
    chained = M.draft_ms(runner, st, opts.steps, opts.warm, chained=True) if model.mtp is not None else None
    for k in range(1, opts.max_draft + 1):
        nbytes = wb["target"] + M.state_bytes(model, ctx, k + 1, snapshot=True)
        ratios = [a / b for a, b in zip(rounds[k], rounds[0])]
        rec = {**base, "kind": "verify", "context": ctx, "draft_tokens": k, "ms_step": times[k],
               "ms_step_k0": times[0], "verify_ratio": statistics.median(ratios), "verify_ratio_rounds": ratios,
               "ms_step_rounds": rounds[k], "ms_step_k0_rounds": rounds[0], "draft_ms": draft,
               "ms_step_gpu": statistics.median(gpu[k]), "ms_step_k0_gpu": statistics.median(gpu[0]),
               "verify_ratio_gpu": statistics.median(a / b for a, b in zip(gpu[k], gpu[0])),
               "host_ms": statistics.median(host[k]), "host_ms_k0": statistics.median(host[0]),
               "bytes_step": nbytes, "tok_s": None,       # without an MTP module there is no draft to time
               "pct_roofline": 100 * nbytes / (ceil["copy_tbps"] * 1e12) * 1e3 / times[k]}
        if draft is not None:
            by = {str(a): M.spec_tok_s(times[k], draft, k, a) for a in ACCEPTANCE}
            rec.update(tok_s=by[str(HEADLINE_ACCEPTANCE)][1], tok_s_by_acceptance={a: v[1] for a, v in by.items()},
                       tokens_per_round_by_acceptance={a: v[0] for a, v in by.items()},
                       tok_s_k0=1e3 / times[0], draft_ms_chained=chained,
                       tok_s_chained=M.spec_tok_s(times[k], chained, k, HEADLINE_ACCEPTANCE)[1])
        emit(rec)


def _prefill(model, opts, ceil, base, emit, gen) -> None:
    M.prefill_s(model, opts.prefill_tokens, opts.prefill_chunk, gen)        # compile, tune, first-touch
    s = min(M.prefill_s(model, opts.prefill_tokens, opts.prefill_chunk, gen) for _ in range(opts.prefill_runs))
    params = M.layer_params(model)
    tflops = 2 * params * opts.prefill_tokens / s / 1e12
    emit({**base, "kind": "prefill", "tokens": opts.prefill_tokens, "chunk": opts.prefill_chunk,
          "tok_s": opts.prefill_tokens / s, "s": s, "params": params, "tflops": tflops,
          "pct_matmul_peak": 100 * tflops / ceil["matmul_tflops"],
          "gdn_prefill": getattr(model.ops, "gdn_prefill_impl", lambda: None)()})


def _capture(model, opts: BenchOptions, base: dict, out, rec: dict):
    """The graph runner, captured; on failure an eager one (recorded), with opts/base updated to say so."""
    runner = _runner(model, opts)
    try:
        rec["capture_s"] = runner.capture()
    except Exception as e:                      # noqa: BLE001 - measure without graphs rather than not at all
        traceback.print_exc(file=sys.stderr)
        out({**base, "kind": "error", "error": f"graph capture failed, measuring eagerly: {type(e).__name__}: {e}"})
        runner.close()
        D.sync(model.device)
        opts = replace(opts, eager=True)
        base["graphs"] = False
        runner = _runner(model, opts)
        rec["capture_s"] = None
    rec["graphs_captured"] = runner.stats.captured
    return runner, opts


def _allreduce_costs(model, opts: BenchOptions) -> dict:
    """decode_tp.allreduce_costs over one decode step at the first context, run by an eager graph runner (the
    captured step's own Python path and kernels, so nothing new compiles)."""
    from ninfer_rt.graphs import GraphConfig, GraphRunner
    from ninfer_rt.model import SeqInput
    ctx = opts.contexts[0]
    eager = GraphRunner(model, GraphConfig(batch_sizes=(1,), tokens=(1,), mtp_tokens=(),
                                           kv_buckets=(ctx + opts.headroom,), eager=True))
    st = model.new_state()
    try:
        M.fill_context(model, st, ctx)
        step = lambda: eager.forward([SeqInput(torch.tensor([1]), st)])
        return T.allreduce_costs(model.tp, step, graph=model.device.type == "cuda" and not opts.eager)
    finally:
        st.free()
        eager.close()


def _compare_allreduce(group, opts: BenchOptions) -> bool:
    if opts.tp < 2 or "decode" not in opts.parts or opts.compare_allreduce == "off":
        return False
    return opts.compare_allreduce == "always" or getattr(group, "p2p", None) is not None


def run_rank(group, opts: BenchOptions, recipe: str, paths: list[str], info: dict, emit) -> None:
    """All measurements of one recipe on this rank; emit(record) is called on rank 0 only. Every rank makes
    the same calls in the same order (TP collectives inside the model and the TP measurements)."""
    device = _device(group, opts)
    out = emit if group.rank == 0 else (lambda r: None)
    torch.manual_seed(1234 + group.rank)
    gen = torch.Generator().manual_seed(99)
    backend = _check_backend(opts, device)
    ceil = {"copy_tbps": D.copy_tbps(device, opts.copy_mb),
            "matmul_tflops": D.matmul_tflops(device, opts.matmul_n, getattr(torch, opts.dtype))}
    base = {"recipe": recipe, "tp": opts.tp, "gpu": D.device_name(device), "copy_tbps": ceil["copy_tbps"],
            "backend": backend, "graphs": not opts.eager, "dtype": opts.dtype,
            "gemv_tune": os.environ.get("NINFER_GEMV_TUNE", "1") != "0",
            "xpre": backend.startswith("triton") and _xpre_on(device),    # prepared activations (NINFER_XPRE)
            "pdl": backend.startswith("triton") and bool(_pdl_kw(device)),   # NINFER_PDL
            "branch": backend.startswith("triton") and os.environ.get("NINFER_BRANCH", "1") == "1",
            "gates_join": _gates_join(),                                      # NINFER_GATES_JOIN
            "gdn_fused": backend.startswith("triton") and os.environ.get("NINFER_GDN_FUSED", "0") == "1",
            "swiglu_epilogue": backend.startswith("triton") and _swiglu_on(device),    # NINFER_SWIGLU_EPILOGUE
            "pdl_preload": backend.startswith("triton") and _pdl_kw(device, preload=True).get("PRELOAD") == 1,
            "pdl_state": backend.startswith("triton") and _pdl_kw(device, state=True).get("PRELOAD") == 1,
            "gemv_evict": _gemv_evict(),                                      # NINFER_GEMV_EVICT
            "pdl_mma": backend.startswith("triton") and bool(_pdl_kw(device)) and _pdl_mma(),   # NINFER_PDL_MMA
            "x16_align": _x16_align(),                                        # NINFER_X16_ALIGN
            "split_unroll": _split_unroll(),                                  # NINFER_SPLIT_UNROLL
            "split_arrive": _split_arrive(),                                  # NINFER_SPLIT_ARRIVE
            "pdl_late": _pdl_late(),                                          # NINFER_PDL_LATE
            "draft_head": os.environ.get("NINFER_DRAFT_HEAD", "auto")}    # ninfer_rt.draft_head, resolved at load
    out({**base, "kind": "ceilings", **ceil})
    if device.type == "cuda":             # the ceilings' buffers must not count as the model's memory
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model, rec = _load(group, opts, paths, device, info)
    if hasattr(model, "draft_spec"):                  # what `auto` became (an ab_tree runtime may predate it)
        base["draft_head"] = str(model.draft_spec)
    rec["precompile_s"] = _precompile(model, opts, device)
    runner, opts = _capture(model, opts, base, out, rec)
    base.update(T.memory_gib(group, device))          # per rank, after load + capture
    out({**base, **rec})
    ar = None
    if opts.tp > 1 and {"decode", "verify", "profile"} & set(opts.parts):
        ar = _allreduce_costs(model, opts)
        out({**base, "kind": "allreduce", **ar})
    if {"decode", "verify", "profile"} & set(opts.parts):
        _decode_parts(model, runner, opts, ceil, base, out, gen, ar)
        out({**base, "kind": "graph_stats", "replays": runner.stats.replays, "eager_steps": runner.stats.eager_steps,
             "fallbacks": runner.stats.fallbacks, "fallback_reasons": runner.stats.reasons,
             "gdn_recurrent_tiles": _gdn_tiles()})
    runner.close()                        # its graphs and pool go before the forced pass captures its own
    if _compare_allreduce(group, opts):
        _forced_pg_decode(model, opts, ceil, base, out, ar)
    if "prefill" in opts.parts:
        _prefill(model, opts, ceil, base, out, gen)


def _follower(group, opts, recipe, paths, info):
    run_rank(group, opts, recipe, paths, info, lambda r: None)


def child_main(conn, opts: BenchOptions, recipe: str, paths: list[str], info: dict) -> None:
    """Entry of the spawned per-recipe process: records go to `conn` as they are made, then {"done": True}."""
    emit = lambda r: conn.send({"record": r})
    try:
        if opts.tp == 1:
            from ninfer_rt.tp_group import LocalGroup
            run_rank(LocalGroup(), opts, recipe, paths, info, emit)
        else:
            from ninfer_rt import tp
            with tp.launch(opts.tp, _follower, (opts, recipe, paths, info), device=opts.device) as launch:
                run_rank(launch.group, opts, recipe, paths, info, emit)
        conn.send({"done": True})
    except NinferError as e:                         # bad input (artifact, backend): its one line is the report
        conn.send({"error": str(e)})
    except BaseException as e:                       # noqa: BLE001 - reported to the orchestrator, then exit
        traceback.print_exc(file=sys.stderr)         # a crash: where it happened is worth the log lines
        conn.send({"error": f"{type(e).__name__}: {e}"})
    finally:
        conn.close()
