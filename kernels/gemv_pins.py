"""GEMV config pins: a config chosen by measuring the whole decode step, in place of the standalone tuner's pick.

The tuner times each GEMV alone (back-to-back launches in a graph). Inside a decode step a kernel's tail is not
hidden behind its next launch, so a near-tie alone can lose in the step (bench/NOTES.md §25: the prepared gate/up
T = 1 tile, split 3 ways, 0.8 % ahead alone and 2 % behind the unsplit one in the step). A pin is a kernels.json
record (gpu, format, shape, T, config) with its standalone `us` and a `why`:

* shipped pins: `bench/results/gemv_pins.json`, applied when the shipped table is built
  (`gemv_tune_cache.build_shipped`): only in-step A/B winners go there;
* runtime pins: the file named by NINFER_GEMV_PINS (unset, empty or "0": none), ahead of the user cache and the
  shipped table for their keys, with NINFER_GEMV_TUNE=force too: what a sweep uses to A/B candidates in the step
  (`bench/near_ties.py` writes one).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .gemv_launch import GemvConfig

PINS_NAME = "gemv_pins.json"     # beside bench/results/kernels.json
PINS_ENV = "NINFER_GEMV_PINS"
_FIELDS = ("gpu", "format", "shape", "T", "config", "us", "why")


class PinError(ValueError):
    """A pin that names no measured key, lacks a field or has an unreadable config."""


def parse_config(text: str) -> GemvConfig:
    """GemvConfig from its repr (what bench/kernels.py records)."""
    m = re.fullmatch(r"GemvConfig\((.*)\)", text.strip())
    if not m:
        raise ValueError(f"not a GemvConfig repr: {text!r}")
    kv = dict(p.split("=", 1) for p in m.group(1).split(", "))
    return GemvConfig(**{k: v == "True" if v in ("True", "False") else int(v) for k, v in kv.items()})


def record_key(r: dict) -> tuple:
    """(gpu, format, N, K, T) of a kernels.json record or a pin."""
    return (r["gpu"], r["format"], int(r["shape"][0]), int(r["shape"][1]), int(r["T"]))


def _where(i: int, p) -> str:
    return f"pin {i} ({p.get('format')} {p.get('shape')} T={p.get('T')})" if isinstance(p, dict) else f"pin {i}"


def check_pin(i: int, p) -> tuple[tuple, GemvConfig]:
    """(record key, config) of pin `i`; a PinError naming it when a field is missing or unreadable."""
    where = _where(i, p)
    if not isinstance(p, dict) or not set(_FIELDS) <= p.keys():
        raise PinError(f"{where}: needs {', '.join(_FIELDS[:-1])} and {_FIELDS[-1]}")
    try:
        cfg = parse_config(p["config"])
        key = record_key(p)
        float(p["us"])
    except (ValueError, TypeError, IndexError, AttributeError) as e:
        raise PinError(f"{where}: {e}") from None
    return key, cfg


def load_pins(path) -> list:
    """The pins file's list; anything unreadable is a PinError."""
    try:
        pins = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise PinError(f"unreadable ({e})") from None
    if not isinstance(pins, list):
        raise PinError("expected a list of pins")
    for i, p in enumerate(pins):
        check_pin(i, p)
    return pins


def apply_pins(best: dict, pins: list) -> dict:
    """`best` (record key -> kernels.json record) with each pin in its key's place; a pin must name a key that
    kernels.json measured."""
    out = dict(best)
    for i, p in enumerate(pins):
        key, _ = check_pin(i, p)
        if key not in best:
            raise PinError(f"{_where(i, p)}: no kernels.json record for that GPU, format, shape and T")
        out[key] = p
    return out


_RUNTIME: dict | None = None


def _env_path() -> str | None:
    v = os.environ.get(PINS_ENV, "")
    return None if v in ("", "0") else v


def runtime_pins() -> dict:
    """{(gpu, format, N, K, T bucket): (GemvConfig, us)} from NINFER_GEMV_PINS; {} when unset. Read once."""
    global _RUNTIME
    if _RUNTIME is None:
        path = _env_path()
        pins = load_pins(path) if path else []
        _RUNTIME = {record_key(p): (parse_config(p["config"]), float(p["us"])) for p in pins}
    return _RUNTIME


def pins_env_error() -> str | None:
    """None, or a one-line message when NINFER_GEMV_PINS names a file that is not a readable pins list."""
    path = _env_path()
    if path is None:
        return None
    try:
        load_pins(path)
    except PinError as e:
        return f"{PINS_ENV}={path!r}: {e}"
    return None


def reset() -> None:
    """Forget the runtime pins read (tests; a changed NINFER_GEMV_PINS)."""
    global _RUNTIME
    _RUNTIME = None
