"""Command-line plumbing the benchmark scripts share (no torch: bench/decode.py's orchestrator forks artifact
writers and must stay CUDA-free): argument errors as one `error: ...` line, integer and list argument types,
and the scratch folder a synthetic artifact is built in."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from ninfer_formats.errors import NinferError


class ArgParser(argparse.ArgumentParser):
    """argparse whose bad-argument exit is the project's: one line `error: <message>` on stderr, exit 2
    (argparse's own prints the whole usage first; -h still shows it)."""

    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def _int_at_least(low: int, what: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v
    return parse


positive_int = _int_at_least(1, "a positive integer")
nonneg_int = _int_at_least(0, "an integer >= 0")


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated positive integers, in the given order."""
    try:
        v = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not v or min(v) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return v


def name_list(allowed: tuple[str, ...]):
    """An argparse type: a comma-separated, non-empty subset of `allowed`."""
    def parse(text: str) -> tuple[str, ...]:
        v = tuple(x.strip() for x in text.split(",") if x.strip())
        if not v or any(x not in allowed for x in v):
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {', '.join(allowed)}, "
                                             f"got {text!r}")
        return v
    return parse


def pick_dir(given: str | None, need: int) -> str:
    """The folder for a synthetic artifact of `need` bytes: `given`, else ninfer-bench under /dev/shm (the
    load then measures the page cache, not a disk) or the temp dir, whichever has the room."""
    if given:
        return given
    for base in ("/dev/shm", tempfile.gettempdir()):
        try:
            free = shutil.disk_usage(base).free
        except OSError:
            continue
        if free > need * 1.05 + (1 << 30):
            return os.path.join(base, "ninfer-bench")
    raise NinferError(f"no folder with {need / 1e9:.1f} GB free (tried /dev/shm and {tempfile.gettempdir()}); "
                      f"pass --dir")
