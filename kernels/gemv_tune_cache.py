"""The GEMV tuner's memory across processes: a user cache file and the shipped defaults.

Timing every candidate config compiles each one; on a fresh H200 that took 28-42 s per format and shape
(bench/NOTES.md), so a server spent minutes before answering. Choices therefore persist:

* user cache: `$NINFER_CACHE_DIR/gemv_tune.json` (else `~/.cache/ninfer/gemv_tune.json`), keyed by `TuneKey`
  (GPU name, compute capability, Triton version, format, N, K, T bucket, activation dtype, residual). Read once
  per process; rewritten atomically after each new choice, merged with what other processes (TP ranks) wrote
  meanwhile. Unreadable files or entries are ignored with one stderr line each.
* shipped defaults: `gemv_tuned.json` beside this file, the H200 winners of `bench/results/kernels.json`
  (regenerate: `python3 -m ninfer_kernels.gemv_tune_cache bench/results/kernels.json`). They match on GPU name,
  format, N, K, T bucket and dtype; the residual only adds an epilogue, so either value uses them, and a Triton
  upgrade keeps them (a stale winner is still a correct config). A pin in `bench/results/gemv_pins.json` replaces
  the tuner's pick where an in-step A/B of the whole decode step measured another config faster; NINFER_GEMV_PINS
  names a pins file that goes ahead of everything at run time (`gemv_pins`).
* heuristic: per (format, T bucket) the tiles that won most often there, ranked; `heuristic()` returns the
  first one among this shape's candidates (whose split was sized for this GPU), else the default candidate.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import triton

from ninfer_formats.atomic import write_json_atomic

from . import gemv_pins
from .gemv_launch import GemvConfig
from .gemv_pins import PINS_NAME, PinError, apply_pins, load_pins, parse_config, record_key

SHIPPED_PATH = Path(__file__).with_name("gemv_tuned.json")
# kernel formats with a packed-half2 variant (gemv_*_h2) and with a warp-MMA variant (gemv_*_mma; sm_80+); iq3_s4:
# IQ3_S weights in the 4-bit code planes (gemv_iq3_s4, NINFER_IQ3S_LAYOUT=codes4)
H2_FORMATS = ("nvfp4", "q6_k", "iq3_s", "iq3_s4")
MMA_FORMATS = ("nvfp4", "q6_k", "iq3_s", "iq3_s4")
_TILE = ("block_n", "block_g", "num_warps", "num_stages", "use_dot", "t_tile", "h2", "mma")   # without the split


@dataclass(frozen=True)
class TuneKey:
    gpu: str
    cc: str            # "9.0"
    triton: str
    fmt: str           # "nvfp4", "q6_k", "iq3_s", "f8_e4m3_row", "plain[<kind>]"
    N: int
    K: int
    t_bucket: int
    dtype: str         # "torch.bfloat16"
    residual: bool

    def __post_init__(self):
        for f in fields(self):
            v, want = getattr(self, f.name), {"str": str, "int": int, "bool": bool}[f.type]
            if not isinstance(v, want) or (want is int and (isinstance(v, bool) or v < 1)):
                raise TypeError(f"TuneKey.{f.name} must be a {f.type}{' >= 1' if want is int else ''}, got {v!r}")


def kernel_format(kernel_name: str) -> str:
    """nvfp4_gemv_kernel -> nvfp4, f8_gemv_kernel -> f8_e4m3_row, plain_gemv_kernel[1] -> plain[1],
    nvfp4_gemv_kernel+xpre -> nvfp4+xpre (the launch on prepared activations, `x16.py`)."""
    fmt = kernel_name.replace("_gemv_kernel", "")
    return "f8_e4m3_row" if fmt == "f8" else fmt


def base_format(fmt: str) -> str:
    """The weight format of a tune-cache format: nvfp4+xpre -> nvfp4."""
    return fmt.split("+", 1)[0]


def device_identity(device) -> tuple[str, str]:
    """(GPU name, compute capability "major.minor") of a CUDA device."""
    major, minor = torch.cuda.get_device_capability(device)
    return torch.cuda.get_device_name(device), f"{major}.{minor}"


def make_key(tune_key: tuple, GS: int, device) -> TuneKey:
    """The persistent key for a `gemv_launch.tune_key` tuple (kernel, N, G, bucket, dtype, residual, device)."""
    kernel_name, N, G, bucket, dtype, residual, _ = tune_key
    gpu, cc = device_identity(device)
    return TuneKey(gpu, cc, triton.__version__, kernel_format(kernel_name), N, G * GS, bucket, dtype, residual)


def cache_path() -> Path:
    root = os.environ.get("NINFER_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "ninfer") / "gemv_tune.json"


def _warn(msg: str) -> None:
    print(f"ninfer: {msg}", file=sys.stderr)


def _parse(obj) -> tuple[dict, int]:
    """{TuneKey: (GemvConfig, ms)} and the number of entries that could not be read."""
    entries = obj.get("entries") if isinstance(obj, dict) else None
    if not isinstance(entries, list):
        raise ValueError("no 'entries' list")
    out, bad = {}, 0
    for e in entries:
        try:
            out[TuneKey(**e["key"])] = (GemvConfig(**e["config"]), e.get("ms"))
        except (TypeError, KeyError, ValueError):
            bad += 1
    return out, bad


def _read(path: Path, quiet: bool = False) -> dict:
    try:
        entries, bad = _parse(json.loads(path.read_text()))
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except (OSError, ValueError, UnicodeDecodeError) as e:
        if not quiet:
            _warn(f"GEMV tuning cache {path} is unreadable ({e}); ignored")
        return {}
    if bad and not quiet:
        _warn(f"GEMV tuning cache {path}: {bad} unreadable entr{'y' if bad == 1 else 'ies'} ignored")
    return entries


_USER: dict | None = None
_WRITE_FAILED = False


def _user() -> dict:
    global _USER
    if _USER is None:
        _USER = _read(cache_path())
    return _USER


def reset() -> None:
    """Forget what was read (tests; a changed NINFER_CACHE_DIR)."""
    global _USER, _SHIPPED, _WRITE_FAILED
    _USER, _SHIPPED, _WRITE_FAILED = None, None, False
    gemv_pins.reset()


def record(key: TuneKey, cfg: GemvConfig, ms: float | None) -> None:
    """Remember a new choice and rewrite the cache file (a read-only home only costs one warning)."""
    global _WRITE_FAILED
    user = _user()
    user[key] = (cfg, ms)
    path = cache_path()
    merged = {**_read(path, quiet=True), **user}   # keep what other processes wrote since we read it
    body = {"version": 1, "entries": [{"key": asdict(k), "config": asdict(c), "ms": m}
                                      for k, (c, m) in merged.items()]}
    try:
        write_json_atomic(path, body)
    except OSError as e:
        if not _WRITE_FAILED:
            _warn(f"cannot write GEMV tuning cache {path} ({e}); choices are kept for this process only")
        _WRITE_FAILED = True


_SHIPPED: dict | None = None


def _shipped() -> dict:
    global _SHIPPED
    if _SHIPPED is None:
        try:
            _SHIPPED = json.loads(SHIPPED_PATH.read_text())
        except (OSError, ValueError) as e:
            _warn(f"shipped GEMV configs {SHIPPED_PATH} are unreadable ({e}); ignored")
            _SHIPPED = {}
    return _SHIPPED


def _usable(cfg: GemvConfig, GS: int, fmt: str = "nvfp4", t_bucket: int = 1, cc: str = "9.0", K: int = 0) -> bool:
    fmt = base_format(fmt)
    if cfg.h2 and (fmt not in H2_FORMATS or t_bucket > 8):   # the packed-half2 variants exist for T <= 8
        return False
    if cfg.mma and (fmt not in MMA_FORMATS or t_bucket > 16 or float(cc) < 8.0 or K % (cfg.block_g * GS)):
        return False
    return not (cfg.use_dot and cfg.block_g * GS < 16)   # the kernel's tl.dot needs >= 16 K per step


def _shipped_entry(key: TuneKey) -> dict | None:
    """The shipped entry for `key`'s GPU, format, shape and T bucket (the residual only adds an epilogue)."""
    ship = _shipped()
    if ship.get("dtype") != key.dtype:
        return None
    want = (key.fmt, key.N, key.K, key.t_bucket)
    return next((e for e in ship.get("gpus", {}).get(key.gpu, ())
                 if (e.get("fmt"), e.get("N"), e.get("K"), e.get("t_bucket")) == want), None)


def _runtime_pin(key: TuneKey) -> tuple | None:
    """(GemvConfig, us) of the runtime pin for `key`'s GPU, format, shape and T bucket (NINFER_GEMV_PINS)."""
    return gemv_pins.runtime_pins().get((key.gpu, key.fmt, key.N, key.K, key.t_bucket))


def pinned(key: TuneKey, GS: int) -> GemvConfig | None:
    """The runtime pin's config for `key` (NINFER_GEMV_PINS, `gemv_pins`) when it is usable here, else None."""
    pin = _runtime_pin(key)
    return pin[0] if pin is not None and _usable(pin[0], GS, key.fmt, key.t_bucket, key.cc, key.K) else None


def lookup(key: TuneKey, GS: int) -> GemvConfig | None:
    """The runtime pin for `key`, else the user cache's config, else the shipped one for its GPU, else None."""
    cfg = pinned(key, GS)
    if cfg is not None:
        return cfg
    hit = _user().get(key)
    if hit is not None and _usable(hit[0], GS, key.fmt, key.t_bucket, key.cc, key.K):
        return hit[0]
    e = _shipped_entry(key)
    if e is None:
        return None
    try:
        cfg = GemvConfig(**e["config"])
    except (TypeError, KeyError, ValueError):
        return None
    return cfg if _usable(cfg, GS, key.fmt, key.t_bucket, key.cc, key.K) else None


def remembered_ms(key: TuneKey) -> float | None:
    """The time remembered with `key`'s choice: the runtime pin's, else the user cache's, else the shipped entry's
    for its GPU; None if none has one."""
    pin = _runtime_pin(key)
    if pin is not None:
        return pin[1] / 1e3
    hit = _user().get(key)
    if hit is not None and isinstance(hit[1], (int, float)):
        return float(hit[1])
    us = (_shipped_entry(key) or {}).get("us")
    return float(us) / 1e3 if isinstance(us, (int, float)) else None


def heuristic(fmt: str, t_bucket: int, cands: list[GemvConfig]) -> GemvConfig:
    """The best-ranked shipped tile for (fmt, T bucket) that is among `cands`, else cands[0]; a format with no
    ranking of its own (nvfp4+xpre) takes its weight format's."""
    by_tile = {tuple(getattr(c, f) for f in _TILE): c for c in reversed(cands)}   # first candidate wins ties
    ranks = _shipped().get("heuristic", {})
    for tile in ranks.get(fmt, ranks.get(base_format(fmt), {})).get(str(t_bucket), ()):
        if not isinstance(tile, dict):
            continue
        c = by_tile.get(tuple(tile.get(f, False if f in ("h2", "mma") else None) for f in _TILE))
        if c is not None:
            return c
    return cands[0]


def build_shipped(records: list, source: str, dtype: str = "torch.bfloat16", pins: list = ()) -> dict:
    """The shipped-defaults document from bench/kernels.py records: the fastest record per (GPU, format,
    shape, T), or its pin (`apply_pins`), and, per (format, T), the shipped tiles ranked by how often they won."""
    best: dict = {}
    for r in records:
        if not isinstance(r.get("config"), str) or not r["config"].startswith("GemvConfig(") or "us" not in r:
            continue   # prefill records and untuned ("default") ones
        k = record_key(r)
        if k not in best or r["us"] < best[k]["us"]:
            best[k] = r
    gpus: dict = {}
    wins: dict = {}
    for (gpu, fmt, N, K, T), r in sorted(apply_pins(best, list(pins)).items()):
        cfg = parse_config(r["config"])
        e = {"fmt": fmt, "N": N, "K": K, "t_bucket": T, "config": asdict(cfg), "us": r["us"]}
        gpus.setdefault(gpu, []).append({**e, "pin": r["why"]} if "why" in r else e)
        wins.setdefault(fmt, {}).setdefault(str(T), Counter())[tuple(getattr(cfg, f) for f in _TILE)] += 1
    heur = {fmt: {T: [dict(zip(_TILE, tile)) for tile, _ in c.most_common()] for T, c in per.items()}
            for fmt, per in wins.items()}
    return {"version": 1, "source": source, "dtype": dtype, "gpus": gpus, "heuristic": heur}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Regenerate the shipped GEMV configs from bench/kernels.py results.")
    ap.add_argument("results", help="bench/results/kernels.json")
    ap.add_argument("--pins", help="in-step winners that replace the tuner's pick (default: gemv_pins.json beside "
                                   "the results, when it exists)")
    ap.add_argument("--out", default=str(SHIPPED_PATH))
    a = ap.parse_args(argv)
    pins_path = Path(a.pins) if a.pins else Path(a.results).with_name(PINS_NAME)
    try:
        pins = load_pins(pins_path) if a.pins or pins_path.exists() else []
        doc = build_shipped(json.loads(Path(a.results).read_text()), Path(a.results).name, pins=pins)
        write_json_atomic(a.out, doc)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: {pins_path if isinstance(e, PinError) else a.results}: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"out": a.out, "entries": sum(map(len, doc["gpus"].values())), "pins": len(pins)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
