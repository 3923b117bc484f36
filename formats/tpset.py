"""Verifying files and folders: every file's structure and checksums, then TP-set consistency (FORMAT.md §4)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from .constants import PARTIAL_SUFFIX, SUFFIX
from .errors import FormatError, NinferError
from .reader import open_artifact


@dataclass(frozen=True)
class FileInfo:
    path: str
    artifact_id: str
    rank: int
    tp_size: int
    tp_files: list
    identity: dict
    model: dict
    n_tensors: int
    n_bytes: int

    def summary(self) -> str:
        return (f"rank {self.rank}/{self.tp_size}, {self.n_tensors} tensors, {self.n_bytes} bytes, "
                f"artifact {self.artifact_id}")


@dataclass
class Report:
    ok: list[FileInfo] = field(default_factory=list)        # files whose own checks passed, in order
    problems: list[str] = field(default_factory=list)       # one line each, in discovery order
    bad_files: set = field(default_factory=set)


def _expand(paths, report: Report) -> list[str]:
    out = []
    for p in map(os.fspath, paths):
        if os.path.isdir(p):
            found = sorted(os.path.join(p, n) for n in os.listdir(p)
                           if n.endswith(SUFFIX) and not n.endswith(PARTIAL_SUFFIX))
            if not found:
                report.problems.append(f"{p}: no {SUFFIX} files in this folder")
            out += found
        elif os.path.exists(p):
            out.append(p)
        else:
            report.problems.append(f"{p}: no such file or folder")
    seen, unique = set(), []
    for p in out:
        key = os.path.realpath(p)
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique


def _check_file(path: str, report: Report) -> FileInfo | None:
    try:
        with open_artifact(path, verify=True) as a:
            info = FileInfo(path, a.artifact_id, a.tp["rank"], a.tp["size"], a.tp["files"], a.identity,
                            a.model, len(a.tensors), a.header.file_size)
    except NinferError as e:
        report.problems.append(str(e))
        report.bad_files.add(os.path.realpath(path))
        return None
    except OSError as e:
        report.problems.append(f"{path}: {e.strerror or e}")
        report.bad_files.add(os.path.realpath(path))
        return None
    _check_name(info, report)
    report.ok.append(info)
    return info


def _check_name(info: FileInfo, report: Report) -> None:
    """The runtime finds siblings by the names recorded inside (tp.files); a renamed or swapped file passes
    every checksum yet cannot load, so its name must be the one its own directory records for its rank."""
    recorded = info.tp_files[info.rank]["name"]
    named = os.path.basename(info.path)
    if named != recorded:
        report.problems.append(f"{info.path}: file name does not match its contents: named {named}, "
                               f"but it records itself as {recorded} (rank {info.rank} of tp {info.tp_size})")


def _check_set(members: list[FileInfo], checked: dict, report: Report) -> None:
    """`members`: verified files of one artifact in one folder; find and check the missing ranks by name."""
    ref = members[0]
    folder = os.path.dirname(ref.path)
    by_rank: dict[int, FileInfo] = {}
    for m in members:
        if m.rank in by_rank:
            report.problems.append(f"{m.path}: duplicate of rank {m.rank} ({by_rank[m.rank].path})")
        by_rank.setdefault(m.rank, m)
    for r in range(ref.tp_size):
        if r in by_rank:
            continue
        sib = os.path.join(folder, ref.tp_files[r]["name"])
        key = os.path.realpath(sib)
        if key in report.bad_files:
            continue                                      # already reported as broken
        if not os.path.exists(sib):
            report.problems.append(f"{ref.path}: incomplete TP set: rank {r} file {sib} is missing")
            continue
        info = checked.get(key) or _check_file(sib, report)
        checked[key] = info
        if info is None:
            continue
        if info.artifact_id != ref.artifact_id:
            report.problems.append(f"{sib}: mixed TP set: artifact {info.artifact_id}, but {ref.path} "
                                   f"expects {ref.artifact_id}")
        elif info.rank != r:
            report.problems.append(f"{sib}: is rank {info.rank}, expected rank {r}")
        else:
            by_rank[r] = info
    for m in by_rank.values():
        for what in ("tp_files", "identity", "model"):
            if getattr(m, what) != getattr(ref, what):
                report.problems.append(f"{m.path}: {what.replace('_', '.')} differs from {ref.path}")
                break


def check_paths(paths) -> Report:
    """Verify files and folders (non-recursive): structure, every checksum, and complete consistent TP sets."""
    report = Report()
    checked: dict[str, FileInfo | None] = {}
    for p in _expand(paths, report):
        checked[os.path.realpath(p)] = _check_file(p, report)
    groups: dict[tuple, list[FileInfo]] = {}
    for info in [i for i in checked.values() if i is not None]:
        groups.setdefault((info.artifact_id, os.path.dirname(os.path.realpath(info.path))), []).append(info)
    for members in groups.values():
        _check_set(sorted(members, key=lambda m: m.rank), checked, report)
    return report


def verify_paths(paths, *, raise_first: bool = False) -> list[str]:
    """Problems found (empty when everything is good); with raise_first, raise FormatError on the first."""
    problems = check_paths(paths).problems
    if problems and raise_first:
        raise FormatError(problems[0])
    return problems
