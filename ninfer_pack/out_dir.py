"""The output folder of a conversion: what is complete, what is resumable, and what may be replaced.

While a conversion is unfinished the folder holds `.ninfer-pack.json` (the arguments fingerprint and the
source files' sizes and mtimes) and `report.jsonl.partial` (one line per finished tensor). A rerun with the
same fingerprint resumes; a rerun with other arguments is refused (or, with --force, starts over). Only the
files of the artifact being written (`<stem>.tp*-rank*.ninfer*`), the state, the journal and a README.md /
report.json that ninfer-pack wrote are ever deleted or replaced; a README.md or report.json without our
marker is the user's, and --force is needed to replace it. Other artifacts' rank files are never touched.
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
CARD_MARKER = "<!-- written by ninfer-pack convert: replaced when this folder is converted again -->"
REPORT_MARKER = ("written_by", "ninfer-pack convert")       # key/value every report.json we write carries


def _rank_file(stem: str) -> re.Pattern:
    return re.compile(re.escape(stem) + r"\.tp\d+-rank\d+" + re.escape(SUFFIX) + r"(\.partial(\.journal)?)?")


def _ours(d: Path, stem: str) -> list[Path]:
    names = {STATE, REPORT_JOURNAL, *PUBLISHED, *(n + PARTIAL_SUFFIX for n in PUBLISHED)}
    rx = _rank_file(stem)
    return sorted(p for p in d.iterdir() if p.name in names or rx.fullmatch(p.name))


def complete_files(d: Path, stem: str | None = None) -> list[Path]:
    rx = _rank_file(stem) if stem else re.compile(r".+\.tp\d+-rank\d+" + re.escape(SUFFIX))
    return sorted(p for p in d.glob("*" + SUFFIX) if rx.fullmatch(p.name))


def read_state(d: Path) -> dict | None:
    try:
        return json.loads((d / STATE).read_text())
    except (OSError, ValueError):
        return None


def written_by_us(path: Path) -> bool:
    """README.md / report.json carrying our marker (so replacing it loses nothing the user wrote)."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    if path.name == "README.md":
        return CARD_MARKER.encode() in data
    try:
        rep = json.loads(data)
    except ValueError:
        return False
    return isinstance(rep, dict) and rep.get(REPORT_MARKER[0]) == REPORT_MARKER[1]


def _guard_foreign(d: Path) -> None:
    for name in PUBLISHED:
        p = d / name
        if p.exists() and not written_by_us(p):
            raise SourceError(f"{p}: not written by ninfer-pack (no marker); the conversion would replace it, "
                              "so move it away or add --force")


def _source_changed(old: dict, state: dict) -> str | None:
    """Which source file changed size (or config/headers), when only the source differs from the old run."""
    if old.get("args") != state["args"]:
        return None
    was, now = old.get("source_files", {}), state["source_files"]
    for name in sorted(set(was) | set(now)):
        if name not in now or name not in was or was[name][0] != now[name][0]:
            return f"source file {name} was added, removed or changed size"
    return "the source's config.json or tensor headers changed"


def _refuse(d: Path, old: dict | None, state: dict, finals: list[Path]) -> None:
    if old is None:
        raise SourceError(f"{d}: already holds a complete artifact ({finals[0].name}); "
                          "add --force to replace it")
    why = _source_changed(old, state)
    if why:
        raise SourceError(f"{d}: holds an unfinished conversion of an earlier version of the source ({why}); "
                          "add --force to start over")
    raise SourceError(f"{d}: holds an unfinished conversion with other arguments "
                      f"({old.get('summary', 'unknown')}); rerun those arguments to resume, "
                      "or add --force to start over")


def _reopen_finals(finals: list[Path]) -> None:
    """A kill between finalize's renames leaves some ranks final, others .partial. Their journals are still
    there (finalize drops them last), so renaming a final rank back to .partial makes its writer resume it
    (every tensor re-hashes as done) instead of converting it again; finalize then redoes the renames."""
    for p in finals:
        partial = p.with_name(p.name + PARTIAL_SUFFIX)
        if Path(str(partial) + ".journal").exists() and not partial.exists():
            os.replace(p, partial)


def _drop_rank_journals(finals: list[Path]) -> None:
    """Killed after finalize's renames but before it dropped the journals: every rank is final, so the
    journals are leftovers that `verify` ignores but that would otherwise stay in the folder forever."""
    for p in finals:
        p.with_name(p.name + PARTIAL_SUFFIX + ".journal").unlink(missing_ok=True)


def prepare(d: Path, state: dict, force: bool, stem: str) -> str:
    """Make `d` ready; returns "fresh", "resume" or "publish" (ranks final, card/report still to write)."""
    d.mkdir(parents=True, exist_ok=True)
    old, finals = read_state(d), complete_files(d, stem)
    if old is not None and old.get("fingerprint") == state["fingerprint"]:
        names = {p.name for p in finals}
        if finals and names == set(state["files"]):
            _drop_rank_journals(finals)
            return "publish"
        if names <= set(state["files"]):
            _reopen_finals(finals)
            return "resume"
    if not force:
        if finals or old is not None:
            _refuse(d, old, state, finals)
        _guard_foreign(d)
    for p in _ours(d, stem):
        p.unlink()
    write_state(d, state)
    return "fresh"


def write_state(d: Path, state: dict) -> None:
    (d / (STATE + PARTIAL_SUFFIX)).write_text(json.dumps(state, sort_keys=True, indent=1))
    os.replace(d / (STATE + PARTIAL_SUFFIX), d / STATE)


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
    path = d / REPORT_JOURNAL
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, b"".join((json.dumps(e, sort_keys=True) + "\n").encode() for e in entries))
        finally:
            os.close(fd)
    except OSError as e:          # os.write on an fd names no file (disk full would print "error: : ...")
        raise OSError(e.errno, e.strerror, str(path)) from None


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
