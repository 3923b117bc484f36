"""Host side of the GEMV skeleton: argument checks, launch configs, the split-K workspace and a small tuner.

Configs: `GemvConfig` (gemv_config). `candidates()` (gemv_tiles) lists the configs worth trying for a shape; the
first is the default (used in the interpreter, without CUDA, while a CUDA graph is being captured, or with
NINFER_GEMV_TUNE=0 on a shape nothing is known about). On a GPU the first call for a (kernel, N, K, T bucket,
dtype, residual, device) key takes the choice remembered across processes (`gemv_tune_cache`: the user cache
file, then the shipped H200 winners); with NINFER_GEMV_TUNE=0 and no such choice, the tile that won most often
for the format and T bucket; otherwise it times every candidate inside a CUDA graph, as the decode step runs
it (`gemv_timing.time_ms`: median of 12 replays, L2 flushed by a read before each call), times those within
8 % of the fastest twice more (one median moves by ~5 % between runs), keeps the fastest (`tuned_configs()`,
`tuning_log()`) and records it in the cache file.
NINFER_GEMV_TUNE=force re-times and re-records even when a choice is remembered (benchmarks). Warm up before
capturing a CUDA graph.

Workspace: split-K partials go to one fp32 buffer per device and the arrival counters to one int32 buffer per
device (zeroed once; each launch leaves them at zero). Kernels on two streams of one device must therefore not
run split-K GEMVs concurrently.
"""
from __future__ import annotations

import os
from functools import partial

import torch
import triton

from ninfer_formats.errors import NinferError

from .gemv_config import GemvConfig, interpreting, next_pow2, sm_count  # noqa: F401  (callers import them here)
from .gemv_glu import EPI_RES, SwiGLUOut, check_glu, counters, epi_of, fits
from .gemv_h2_select import H2_STATE, checked_h2  # noqa: F401  (H2_STATE: callers reach it here)
from .gemv_tiles import FMA_DOT_K, auto_split, candidates, fill_splits  # noqa: F401  (likewise)
from .gemv_timing import time_ms   # module global: the tuner tests replace it here
from .pdl import mma_mode, pdl_kw

X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class KernelInputError(NinferError):
    """A kernel was called with tensors of the wrong shape, dtype or layout."""


_WS: dict = {}


def workspace(device: torch.device, n_ws: int, n_cnt: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device.type, device.index)
    ws, cnt = _WS.get(key, (None, None))
    if ws is None or ws.numel() < n_ws:
        ws = torch.empty(max(n_ws, 1 << 16), dtype=torch.float32, device=device)
    if cnt is None or cnt.numel() < n_cnt:
        cnt = torch.zeros(max(n_cnt, 1024), dtype=torch.int32, device=device)
    _WS[key] = (ws, cnt)
    return ws, cnt


def check_x(x: torch.Tensor, K: int | None, what: str) -> torch.Tensor:
    """x must be [T >= 1, K] (any K when K is None) fp16/bf16/fp32; returned with unit column stride."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != (K or x.shape[1]) or x.shape[0] < 1:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise KernelInputError(f"{what}: activations must be [T >= 1, K={K}], got {shape}")
    if x.dtype not in X_DTYPES:
        raise KernelInputError(f"{what}: activations must be fp16/bf16/fp32, got {x.dtype}")
    return x if x.stride(1) == 1 else x.contiguous()


def check_weight(t: torch.Tensor, name: str, shape: tuple, dtypes, what: str, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype not in dtypes:
        got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
        raise KernelInputError(f"{what}: {name} must be {tuple(shape)} {'/'.join(map(str, dtypes))}, got {got}")
    if t.device != device:
        raise KernelInputError(f"{what}: {name} is on {t.device}, activations on {device}")
    return t.contiguous()


def as_words(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a contiguous u8 [N, B] as [N, B / itemsize] `dtype` (copies if the start is misaligned)."""
    item = torch.empty((), dtype=dtype).element_size()
    if t.storage_offset() % item or t.data_ptr() % 16:
        t = t.clone()
    return t.view(dtype)


def _check_out(out, residual, T: int, N: int, x: torch.Tensor, what: str):
    """out (allocated when None) after checking it and the residual slot: a tensor to add or a SwiGLUOut."""
    if out is None:
        out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (T, N) or out.dtype != x.dtype or out.stride(1) != 1 or out.device != x.device:
        raise KernelInputError(f"{what}: out must be [{T}, {N}] {x.dtype} with unit column stride")
    if isinstance(residual, SwiGLUOut):
        bad = check_glu(residual, T, N, x.dtype, x.device)
        if bad:
            raise KernelInputError(f"{what}: SwiGLU epilogue: {bad}")
    elif residual is not None and (tuple(residual.shape) != (T, N) or residual.stride(1) != 1
                                   or residual.device != x.device):
        raise KernelInputError(f"{what}: residual must be [{T}, {N}] with unit column stride on {x.device}")
    return out


def res_slot(residual, out) -> torch.Tensor:
    """The tensor a launch passes as res_ptr: the residual, the SwiGLU output y, or out (unused)."""
    if residual is None:
        return out
    return residual.y if isinstance(residual, SwiGLUOut) else residual


def dot_kind(x_dtype) -> int:
    """0 fp16, 1 bf16, 2 fp32 (the interpreter computes bf16 dots wrongly, so it gets fp32)."""
    if x_dtype == torch.float16:
        return 0
    if x_dtype == torch.bfloat16 and not interpreting():
        return 1
    return 2


def effective_split(cfg: GemvConfig, G: int) -> int:
    """cfg.split clamped to the K tiles and trimmed so that no split is empty."""
    split = max(1, min(cfg.split, triton.cdiv(G, cfg.block_g)))
    return triton.cdiv(G, triton.cdiv(triton.cdiv(G, split), cfg.block_g) * cfg.block_g)


_VARIANTS: dict = {"h2": {}, "mma": {}}
_VARIANT_TILES: dict = {}


def register_variant(kind: str, kernel_name: str, factory, tiles: dict | None = None) -> None:
    """`factory(device)` returns the `kind` ("h2": packed-half2, "mma": warp-MMA) variant of the kernel named
    `kernel_name` (a launcher object like the kernel itself); configs with that flag set launch it. `tiles`:
    the variant's own decode tiles per T bucket (instead of `_DECODE_H2_TILES` / `_DECODE_MMA_TILES`)."""
    _VARIANTS[kind][kernel_name] = factory
    if tiles is not None:
        _VARIANT_TILES[(kind, kernel_name)] = tiles


def register_h2(kernel_name: str, factory, tiles: dict | None = None) -> None:
    register_variant("h2", kernel_name, factory, tiles)


def h2_tiles(kernel) -> dict | None:
    """The h2 variant's own tile table, if it registered one (None: the shared `_DECODE_H2_TILES`)."""
    return _VARIANT_TILES.get(("h2", kernel.__name__))


def mma_tiles(kernel) -> dict | None:
    """The mma variant's own tile table, if it registered one (None: the shared `_DECODE_MMA_TILES`)."""
    return _VARIANT_TILES.get(("mma", kernel.__name__))


def kernel_candidates(kernel, T: int, N: int, G: int, GS: int, x_dtype, device) -> list[GemvConfig]:
    """`candidates` with the variants `kernel` has and their own tile tables."""
    return candidates(T, N, G, GS, x_dtype, device, h2=has_h2(kernel), mma=has_variant(kernel, "mma"),
                      h2_tiles=h2_tiles(kernel), mma_tiles=mma_tiles(kernel))


def has_variant(kernel, kind: str) -> bool:
    return kernel.__name__ in _VARIANTS[kind]


def has_h2(kernel) -> bool:
    return has_variant(kernel, "h2")


def variant(kernel, kind: str, device):
    if not has_variant(kernel, kind):
        raise KernelInputError(f"{kernel.__name__} has no {kind} variant (GemvConfig.h2: NVFP4, Q6_K and IQ3_S; "
                               f"GemvConfig.mma: NVFP4, Q6_K and IQ3_S)")
    return _VARIANTS[kind][kernel.__name__](device)


def pdl_consts(cfg: GemvConfig, device) -> dict:
    """The PDL constexpr and launch option of a GEMV launch: `pdl_kw`'s, except for warp-MMA configs under
    NINFER_PDL_MMA=0: launched without the attribute, so they start once the kernel in front completed (their
    wait returns at once), but still compiled with the protocol, so their late trigger lets the next kernel in."""
    kw = {"PDL": 0, **pdl_kw(device)}
    if cfg.mma and mma_mode() == "0":
        kw.pop("launch_pdl", None)
    return kw


def _launch(kernel, weights: tuple, x, N: int, G: int, fscale: float, out, residual, cfg: GemvConfig,
            warmup: bool = False, fold: bool = True, extra: dict | None = None):
    """Launch one config (extra: more constexprs for the variant, e.g. XPRE); returns (compiled kernel or None,
    grid, ws or None, cnt or None, scalars, consts, the kernel launched: the format's own or its h2 / mma
    variant)."""
    T = x.shape[0]
    kind = "h2" if cfg.h2 else "mma" if cfg.mma else None
    kernel = variant(kernel, kind, x.device) if kind else kernel
    if getattr(kernel, "check", None) is not None:     # a variant's own tile rule (e.g. IQ3_S h2's rows per thread)
        kernel.check(cfg)
    if cfg.mma:
        tt = cfg.t_tile or (8 if T <= 8 else 16)
    else:
        tt = cfg.t_tile or (max(16, next_pow2(T)) if cfg.use_dot else next_pow2(T))
    grid_n, grid_t = triton.cdiv(N, cfg.block_n), triton.cdiv(T, tt)
    split = effective_split(cfg, G)
    epi = epi_of(residual)
    if epi > EPI_RES and not fits(cfg.block_n, N):
        raise KernelInputError(f"SwiGLU epilogue: block_n={cfg.block_n} does not serve N={N} (gemv_glu.fits)")
    if split > 1 or epi > EPI_RES:   # the SwiGLU chunk counters follow split-K's
        ws, cnt = workspace(x.device, split * T * N, counters(grid_n, grid_t, N))
    else:
        ws, cnt = None, None
    res = res_slot(residual, out)
    grid = (grid_n, split, grid_t)
    scalars = (float(fscale), T, N, G, split)
    consts = {"T_TILE": tt, "BLOCK_N": cfg.block_n, "BLOCK_G": cfg.block_g, "USE_SPLIT": split > 1,
              "USE_DOT": cfg.use_dot, "DOT_KIND": dot_kind(x.dtype), "EPI": epi,
              "EVEN_G": G % cfg.block_g == 0, "FOLD": bool(fold and cfg.use_dot),
              "STAGES": 1 if cfg.use_dot else cfg.num_stages, "num_warps": cfg.num_warps,
              "num_stages": cfg.num_stages}
    if getattr(kernel, "per_thread", False):
        consts["NW"] = cfg.num_warps   # per-thread variants (warp-MMA, IQ3_S h2): tensors are [32 * num_warps]
    names = getattr(getattr(kernel, "jit", kernel), "arg_names", ())
    if "XPRE" in names:
        consts["XPRE"] = False       # the f16 variants that can read prepared activations (ninfer_kernels.x16)
    if "PDL" in names:               # always given: a plan's direct launch passes every constexpr (gemv_plan)
        consts.update(pdl_consts(cfg, x.device))
    consts.update(extra or {})
    run = partial(kernel.warmup, grid=grid) if warmup else kernel[grid]
    compiled = run(x, *weights, out, res, out if ws is None else ws, out if cnt is None else cnt, *scalars,
                   x.stride(0), out.stride(0), res.stride(0), **consts)
    return compiled, grid, ws, cnt, scalars, consts, kernel


def launch(kernel, weights: tuple, x, N: int, G: int, fscale: float, out, residual, cfg: GemvConfig,
           warmup: bool = False, fold: bool = True):
    """Launch one config (warmup=True only compiles it, e.g. in a precompile worker). fold: the dot path may
    apply all scales in one multiply per weight (the caller checked that cannot overflow fp32)."""
    _launch(kernel, weights, x, N, G, fscale, out, residual, cfg, warmup, fold)
    return out


_TUNED: dict = {}
_TUNE_LOG: dict = {}


def tuned_configs() -> dict:
    """{key: GemvConfig} chosen so far (the benchmark reports them)."""
    return dict(_TUNED)


def override_config(key, cfg: GemvConfig) -> None:
    """Make `cfg` the config of tuner key `key` in this process (bench/kernels.py's graph runoff); weights' plans
    made with another config keep it until dropped."""
    _TUNED[key] = cfg


def tuning_log() -> dict:
    """{key: [(GemvConfig, median ms or None if it failed)]} for every tuned key."""
    return dict(_TUNE_LOG)


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def tune_mode() -> str:
    """NINFER_GEMV_TUNE: '0' (never time), 'force' (time even when a choice is remembered) or '1' (the
    default); anything else is a one-line error (a typo must not silently mean "tune")."""
    mode = os.environ.get("NINFER_GEMV_TUNE", "1")
    if mode not in ("0", "1", "force"):
        raise KernelInputError(f"NINFER_GEMV_TUNE={mode!r}: expected one of 0, 1, force")
    return mode


def _tuning_allowed(device: torch.device) -> bool:
    return device.type == "cuda" and not interpreting() and tune_mode() != "0" and not _capturing()


def pick_config(key, cands: list[GemvConfig], run, device: torch.device) -> GemvConfig:
    """The remembered config for `key`, else the fastest of `cands` (run(cfg) launches one)."""
    if key in _TUNED:
        return _TUNED[key]
    if len(cands) == 1 or not _tuning_allowed(device):
        return cands[0]
    best, best_t, log = cands[0], float("inf"), []
    for c in cands:
        try:
            t = time_ms(lambda: run(c))
        except (triton.runtime.errors.OutOfResources, triton.CompilationError, RuntimeError):
            log.append((c, None))
            continue  # a config the device cannot hold is simply not a candidate
        log.append((c, t))
        if t < best_t:
            best, best_t = c, t
    best = _runoff(log, run, best)
    if best.h2 or best.mma:
        best = checked_h2(best, cands, log, run)
    _TUNED[key], _TUNE_LOG[key] = best, log
    return best


RUNOFF_MARGIN = 0.08   # candidates within 8 % of the fastest are timed again: one median of 12 replays
RUNOFF_ROUNDS = 2      # moves by ~5 % between runs (bench/NOTES.md §10), which picked slower tiles
RUNOFF_MAX = 4


def _runoff(log: list, run, best: GemvConfig) -> GemvConfig:
    """The close finishers of a tuning pass, timed RUNOFF_ROUNDS more times in turn; each keeps its fastest
    median (the log shows it), and the fastest of those wins."""
    timed = sorted((t, i) for i, (c, t) in enumerate(log) if t is not None)
    if not timed:
        return best
    close = [i for t, i in timed if t <= timed[0][0] * (1 + RUNOFF_MARGIN)][:RUNOFF_MAX]
    if len(close) < 2:
        return best
    for _ in range(RUNOFF_ROUNDS):
        for i in close:
            c, t = log[i]
            log[i] = (c, min(t, time_ms(lambda: run(c))))
    return log[min(close, key=lambda i: log[i][1])][0]


def tune_key(kernel_name: str, N: int, G: int, T: int, x_dtype, has_res: bool, device) -> tuple:
    """The tuner's key: configs are chosen per kernel, shape, T bucket (powers of two), dtype, residual, device."""
    bucket = next_pow2(T) if T <= 16 else min(next_pow2(T), 4096)
    return (kernel_name, N, G, bucket, str(x_dtype), bool(has_res), str(torch.device(device)))


def choose_config(key, cands: list[GemvConfig], run, device, GS: int) -> tuple[GemvConfig, bool]:
    """(config for `key`, final: it will not change any more, so a plan may keep it). run(cfg) launches one
    candidate (only called when timing)."""
    if key in _TUNED:
        return _TUNED[key], True
    if len(cands) == 1 or device.type != "cuda" or interpreting():
        return cands[0], True
    from . import gemv_tune_cache as tc
    pkey = tc.make_key(key, GS, device)
    mode = tune_mode()
    cfg = tc.lookup(pkey, GS) if mode != "force" else tc.pinned(pkey, GS)   # a runtime pin outranks re-timing
    if cfg is None and mode == "0":
        cfg = tc.heuristic(pkey.fmt, pkey.t_bucket, cands)
    if cfg is not None:
        _TUNED[key] = cfg
        return cfg, True
    if _capturing():
        return cands[0], False   # cannot time inside a capture; the next eager call tunes
    cfg = pick_config(key, cands, run, device)
    times = [t for c, t in _TUNE_LOG.get(key, ()) if c == cfg and t is not None]
    if times:   # all candidates failing is not a choice worth remembering
        tc.record(pkey, cfg, times[0])
    return cfg, True


def gemv(kernel, weights: tuple, x, N: int, G: int, GS: int, fscale: float, out, residual, config, what: str,
         fold: bool = True, plans: dict | None = None):
    """Validate out/residual, pick a config (tuned on GPU), launch; returns out [T, N]. residual: None, a tensor
    to add, or a `gemv_glu.SwiGLUOut` (N = 2I gate/up rows: silu(gate) * up also goes there). With `plans` (a
    dict owned by the weight) a `GemvPlan` for (T, dtype, epilogue) is stored once the config is final."""
    T = x.shape[0]
    out = _check_out(out, residual, T, N, x, what)
    if N * G >= 2 ** 31:
        raise KernelInputError(f"{what}: [{N}, {G} groups] is too large for 32-bit offsets; split the rows")
    if config is not None and config.use_dot and config.block_g * GS < 16:
        raise KernelInputError(f"{what}: tl.dot needs block_g * {GS} >= 16, got block_g={config.block_g}")
    if config is not None and config.h2 and (T > 8 or not has_h2(kernel)):
        raise KernelInputError(f"{what}: GemvConfig.h2 needs an NVFP4, Q6_K or IQ3_S weight and T <= 8, got T={T}")
    if config is not None and config.mma and (T > 16 or not has_variant(kernel, "mma") or G % config.block_g):
        raise KernelInputError(f"{what}: GemvConfig.mma needs an NVFP4, Q6_K or IQ3_S weight, T <= 16 and K a "
                               f"multiple of {config.block_g * GS}, got T={T}, K={G * GS}")
    if config is not None:
        return launch(kernel, weights, x, N, G, fscale, out, residual, config, fold=fold)
    epi = epi_of(residual)
    key = tune_key(kernel.__name__, N, G, T, x.dtype, epi == EPI_RES, x.device)
    cands = glu_candidates(kernel_candidates(kernel, T, N, G, GS, x.dtype, x.device), epi, N, what)
    scratch = []

    def run(c):
        # time into a scratch buffer: out may alias residual (in-place residual add), and each timed run would
        # add the residual again
        if not scratch:
            scratch.append(torch.empty_like(out))
        return launch(kernel, weights, x, N, G, fscale, scratch[0], residual, c, fold=fold)

    cfg, final = glu_config(choose_config(key, cands, run, x.device, GS), cands, epi, N)
    compiled, grid, ws, cnt, scalars, consts, kernel = _launch(kernel, weights, x, N, G, fscale, out, residual,
                                                               cfg, fold=fold)
    if plans is not None and final:
        from .gemv_plan import GemvPlan
        plans[(T, x.dtype, epi)] = GemvPlan(kernel, grid, weights, ws, cnt, scalars, consts, compiled, x, out,
                                            res_slot(residual, out), epi)
    return out


def glu_candidates(cands: list, epi: int, N: int, what: str) -> list:
    """The candidates whose row blocks serve the SwiGLU epilogue (all of them for other epilogues). The tuner's
    key is the plain launch's: the epilogue runs after the K loop, so the tile that wins plain wins here."""
    if epi <= EPI_RES:
        return cands
    ok = [c for c in cands if fits(c.block_n, N)]
    if not ok:
        raise KernelInputError(f"{what}: no GEMV tile serves the SwiGLU epilogue at N={N}")
    return ok


def glu_config(chosen: tuple, cands: list, epi: int, N: int) -> tuple:
    """choose_config's (config, final), with a remembered config whose row block cannot serve the SwiGLU
    epilogue replaced by the first candidate that can."""
    cfg, final = chosen
    if epi > EPI_RES and not fits(cfg.block_n, N):
        cfg = cands[0]
    return cfg, final


def dequant(kernel, weights: tuple, N: int, G: int, GS: int, fscale: float, dtype, device, block=(32, 8)):
    """Dense [N, G*GS] weights in `dtype` (sm_70 prefill path and tests)."""
    out = torch.empty((N, G * GS), dtype=dtype, device=device)
    bn, bg = block
    kernel[(triton.cdiv(N, bn), triton.cdiv(G, bg))](*weights, out, float(fscale), N, G, BLOCK_N=bn, BLOCK_G=bg)
    return out
