"""The output folder of a conversion: what is complete, what is resumable, and what may be replaced.

While a conversion is unfinished the folder holds `.ninfer-pack.json` (the arguments fingerprint) and
`report.jsonl.partial` (one line per finished tensor). A rerun with the same fingerprint resumes; a rerun
with other arguments is refused (or, with --force, starts over). Only files this packer names are ever
deleted.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ninfer_formats.constants import PARTIAL_SUFFIX, SUFFIX
from ninfer_formats.errors import SourceError

STATE = ".ninfer-pack.json"
REPORT_JOURNAL = "report.jsonl" + PARTIAL_SUFFIX
PUBLISHED = ("report.json", "README.md")
_RANK_FILE = re.compile(r"^.+\.tp\d+-rank\d+" + re.escape(SUFFIX) + r"(\.partial(\.journal)?)?$")


def _ours(d: Path) -> list[Path]:
    names = {STATE, REPORT_JOURNAL, *PUBLISHED, *(n + PARTIAL_SUFFIX for n in PUBLISHED)}
    return sorted(p for p in d.iterdir() if p.name in names or _RANK_FILE.match(p.name))


def complete_files(d: Path) -> list[Path]:
    return sorted(p for p in d.glob("*" + SUFFIX) if _RANK_FILE.match(p.name))


def read_state(d: Path) -> dict | None:
    try:
        return json.loads((d / STATE).read_text())
    except (OSError, ValueError):
        return None


def prepare(d: Path, state: dict, force: bool) -> str:
    """Make `d` ready; returns "fresh", "resume" or "publish" (ranks final, card/report still to write)."""
    d.mkdir(parents=True, exist_ok=True)
    old, finals = read_state(d), complete_files(d)
    if old is not None and old.get("fingerprint") == state["fingerprint"]:
        expected = set(state["files"])
        if finals and {p.name for p in finals} == expected:
            return "publish"
        if not finals:
            return "resume"
    if (finals or old is not None) and not force:
        if old is None:
            raise SourceError(f"{d}: already holds a complete artifact ({finals[0].name}); "
                              "add --force to replace it")
        raise SourceError(f"{d}: holds an unfinished conversion with other arguments "
                          f"({old.get('summary', 'unknown')}); rerun those arguments to resume, "
                          "or add --force to start over")
    for p in _ours(d):
        p.unlink()
    (d / (STATE + PARTIAL_SUFFIX)).write_text(json.dumps(state, sort_keys=True, indent=1))
    os.replace(d / (STATE + PARTIAL_SUFFIX), d / STATE)
    return "fresh"


def load_reports(d: Path) -> dict[str, dict]:
    """Report entries of tensors finished by earlier (killed) runs; torn last lines are ignored."""
    out = {}
    try:
        lines = (d / REPORT_JOURNAL).read_bytes().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            e = json.loads(line)
            out[e["name"]] = e
        except (ValueError, KeyError, TypeError):
            continue
    return out


def append_reports(d: Path, entries: list[dict]) -> None:
    fd = os.open(d / REPORT_JOURNAL, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"".join((json.dumps(e, sort_keys=True) + "\n").encode() for e in entries))
    finally:
        os.close(fd)


def publish(d: Path, files: dict[str, bytes]) -> None:
    """Write each file to a temp name, rename into place, then drop the resume state."""
    for name, data in files.items():
        tmp = d / (name + PARTIAL_SUFFIX)
        tmp.write_bytes(data)
        os.replace(tmp, d / name)
    for name in (REPORT_JOURNAL, STATE):
        try:
            (d / name).unlink()
        except FileNotFoundError:
            pass
