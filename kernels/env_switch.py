"""Compile-time comparison switches read from the environment: a variable with a few allowed values, the first
the default. Each is read once where its kernels are defined (it becomes a global constexpr) and checked where
the runtime starts, so a bad value is a one-line error there instead of a silent fallback.
"""
from __future__ import annotations

import os


def switch_error(name: str, choices: tuple[str, ...]) -> str | None:
    """None, or a one-line message naming `name` when it holds anything but one of `choices` (two or more)."""
    v = os.environ.get(name, choices[0])
    if v in choices:
        return None
    allowed = f"{choices[0]} (the default)" + "".join(f", {c}" for c in choices[1:-1])
    return f"{name}={v!r}: expected {allowed} or {choices[-1]}"


def switch_value(name: str, choices: tuple[str, ...]) -> str:
    """The switch's value; the default when it is invalid (the runtime refuses that value at start)."""
    return os.environ.get(name, choices[0]) if switch_error(name, choices) is None else choices[0]
