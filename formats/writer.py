"""Writing one TP set of `.ninfer` files: planned layout, pwrite per tensor, journal for resume, atomic publish.

Tensors go into `<path>.partial` (sized to the final layout up front, so gaps are zero holes); every finished
tensor appends `{name, xxh3}` to `<path>.partial.journal`. After a crash a new RankWriter with the same plan
reuses both and `done()` re-hashes the journaled tensors, so only missing or damaged ones are written again.
The header and directory are written last by `finalize_set`, then the file is fsynced and renamed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import mmap
import os
import threading

from .constants import PARTIAL_SUFFIX
from .directory import (artifact_id, dump_directory, rank_file_name, shard_digest,
                        split_rank_file_name, xxh3_hex)
from .errors import FormatError
from .header import make_header, payload_offset_for
from .plan import PLACEHOLDER, ArtifactPlan, plan_layout

_MAX_PWRITE = 1 << 30                  # Linux caps one write at ~2 GiB; stay well below
_SIBLING_LENGTH_BOUND = 10 ** 19       # 20 digits: the widest u64, stands in for unknown sibling sizes


class RankWriter:
    """Writes one rank file. Safe to share across threads, and across processes by pickling (fds reopen)."""

    def __init__(self, path, plan: ArtifactPlan):
        self.path = os.fspath(path)
        self.partial = self.path + PARTIAL_SUFFIX
        self.journal = self.partial + ".journal"
        self.plan = plan
        parts = split_rank_file_name(os.path.basename(self.path))
        if parts is None or parts[1:] != (plan.tp_size, plan.rank):
            raise FormatError(f"{self.path}: rank files must be named "
                              f"'<stem>.tp{plan.tp_size}-rank{plan.rank}.ninfer'")
        self.stem = parts[0]
        layout = plan_layout(plan)
        self._tensors = {t.name: t for t in layout.tensors}
        self._resources = layout.resources
        self.payload_length = layout.payload_length
        self._identity = plan.identity_fields()
        self._files = [{"name": rank_file_name(self.stem, plan.tp_size, r), "payload_length": _SIBLING_LENGTH_BOUND,
                        "shard_digest": PLACEHOLDER} for r in range(plan.tp_size)]
        planned = self._directory(self._files, PLACEHOLDER, layout.tensors)
        self.dir_len = len(planned)
        self.payload_offset = payload_offset_for(self.dir_len)
        self.file_size = self.payload_offset + self.payload_length
        self.fingerprint = xxh3_hex(planned)         # names the layout: a .partial of another plan is not reused
        self._fd = self._pid = None
        self._lock = threading.Lock()
        self._digest = None
        self._open_partial()
        for entry, data in zip(layout.resources, layout.stored):
            self._pwrite(data, self.payload_offset + entry.offset)

    # ---- files ----
    def _open_partial(self) -> None:
        if self._resumable():
            self._ensure_fd()
            return
        for p in (self.journal, self.partial):
            if os.path.exists(p):
                os.unlink(p)
        fd = os.open(self.partial, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        with _naming(self.partial):
            os.ftruncate(fd, self.file_size)
        self._fd, self._pid = fd, os.getpid()
        self._append_journal({"plan": self.fingerprint})

    def _resumable(self) -> bool:
        try:
            if os.path.getsize(self.partial) != self.file_size:
                return False
            with open(self.journal, "rb") as f:
                first = f.readline()
            return json.loads(first) == {"plan": self.fingerprint}
        except (OSError, ValueError):
            return False

    def _ensure_fd(self) -> int:
        with self._lock:
            if self._fd is None or self._pid != os.getpid():     # first use in a (forked/unpickled) process
                self._fd, self._pid = os.open(self.partial, os.O_RDWR), os.getpid()
            return self._fd

    def _pwrite(self, data, pos: int) -> None:
        fd, mv = self._ensure_fd(), memoryview(data).cast("B")
        with _naming(self.partial):
            while len(mv):
                n = os.pwrite(fd, mv[:_MAX_PWRITE], pos)
                mv, pos = mv[n:], pos + n

    def _append_journal(self, record: dict) -> None:
        # one O_APPEND write per record: concurrent writers never interleave inside a line
        with _naming(self.journal):
            fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
            finally:
                os.close(fd)

    def __getstate__(self):
        state = dict(self.__dict__, _fd=None, _pid=None)
        del state["_lock"]
        state["plan"] = dataclasses.replace(self.plan, resources={})   # already written; keep pickles small
        return state

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())

    # ---- tensors ----
    def write(self, name: str, data) -> None:
        """pwrite tensor `name` (bytes, or a C-contiguous array viewed as bytes) at its planned offset."""
        entry = self._tensors.get(name)
        if entry is None:
            raise FormatError(f"{self.path}: write: {name!r} is not a tensor of this rank's plan")
        mv = _as_bytes(data, name)
        if len(mv) != entry.length:
            raise FormatError(f"{self.path}: tensor {name}: got {len(mv)} bytes, {entry.fmt} "
                              f"{list(entry.shape)} encodes to {entry.length}")
        self._pwrite(mv, self.payload_offset + entry.offset)
        self._append_journal({"name": name, "xxh3": xxh3_hex(mv)})
        self._digest = None

    def _journaled(self) -> dict[str, str]:
        out = {}
        try:
            with open(self.journal, "rb") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            return out
        for line in lines:
            try:
                rec = json.loads(line)
                if isinstance(rec, dict) and rec.get("name") in self._tensors and isinstance(rec.get("xxh3"), str):
                    out[rec["name"]] = rec["xxh3"]          # later records win (a rewrite)
            except ValueError:
                continue                                    # a line torn by a kill mid-write
        return out

    def _verified(self) -> dict[str, str]:
        """name -> xxh3 for journaled tensors whose bytes in the .partial still hash to the journal."""
        journaled, ok = self._journaled(), {}
        if not journaled:
            return ok
        with open(self.partial, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            mv = memoryview(mm)
            try:
                for name, h in journaled.items():
                    e = self._tensors[name]
                    start = self.payload_offset + e.offset
                    # the slice is released even when Ctrl-C lands in the hash: a traceback that kept it
                    # would make closing the mmap raise BufferError in place of the KeyboardInterrupt
                    with mv[start:start + e.length] as part:
                        if xxh3_hex(part) == h:
                            ok[name] = h
            finally:
                mv.release()
        return ok

    def done(self) -> set[str]:
        """Tensors already written whose bytes are intact (re-hashed now): skip these when resuming."""
        return set(self._verified())

    def missing(self) -> list[str]:
        have = self._verified()
        return [n for n in self._tensors if n not in have]

    # ---- finalize ----
    def _tables(self) -> tuple[list, list]:
        have = self._verified()
        missing = [n for n in self._tensors if n not in have]
        if missing:
            raise FormatError(f"{self.path}: {len(missing)} of {len(self._tensors)} tensors not written "
                              f"(first: {missing[0]})")
        tensors = [dataclasses.replace(t, xxh3=have[t.name]) for t in self._tensors.values()]
        return tensors, list(self._resources)

    def shard_digest(self) -> str:
        """xxh3_128 of this rank's final tensor + resource tables; every tensor must be written."""
        if self._digest is None:
            tensors, resources = self._tables()
            self._digest = (shard_digest([t.to_json() for t in tensors], [r.to_json() for r in resources]),
                            tensors)
        return self._digest[0]

    def _directory(self, files, aid: str, tensors) -> bytes:
        identity = dict(self._identity, artifact_id=aid)
        tp = {"size": self.plan.tp_size, "rank": self.plan.rank, "files": files}
        return dump_directory(self.plan.config.to_dict(), identity, tp, tensors, self._resources)

    def _write_head(self, files, aid: str) -> None:
        self.shard_digest()
        directory = self._directory(files, aid, self._digest[1])
        if len(directory) > self.dir_len:       # cannot happen: every variable field was bounded
            raise FormatError(f"{self.path}: directory grew past its planned {self.dir_len} bytes")
        directory += b" " * (self.dir_len - len(directory))
        self._pwrite(make_header(directory, self.payload_length) + directory, 0)
        with _naming(self.partial):
            os.fsync(self._ensure_fd())

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None


@contextlib.contextmanager
def _naming(path: str):
    """fd calls (pwrite, write, fsync) raise OSError without a file name; a full disk must name the file."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, path) from None


def _as_bytes(data, name: str) -> memoryview:
    if hasattr(data, "is_contiguous") and hasattr(data, "numpy"):        # a torch tensor, any dtype
        import torch
        data = data.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    elif hasattr(data, "view") and hasattr(data, "dtype"):                # numpy, incl. ml_dtypes
        import numpy as np
        if not data.flags.c_contiguous:
            raise FormatError(f"tensor {name}: data is not C-contiguous")
        data = data.reshape(-1).view(np.uint8)
    try:
        mv = memoryview(data)
    except TypeError:
        raise FormatError(f"tensor {name}: expected bytes or an array, got {type(data).__name__}") from None
    if not mv.c_contiguous:
        raise FormatError(f"tensor {name}: data is not C-contiguous")
    return mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv


def finalize_set(writers: list[RankWriter]) -> list[str]:
    """Fill in the TP set and artifact id, write every header, fsync, and rename *.partial -> final."""
    ws = sorted(writers, key=lambda w: w.plan.rank)
    if not ws:
        raise FormatError("finalize_set: no writers")
    n, first = ws[0].plan.tp_size, ws[0]
    if [w.plan.rank for w in ws] != list(range(n)) or any(w.plan.tp_size != n for w in ws):
        raise FormatError(f"finalize_set: need ranks 0..{n - 1} of tp_size {n} exactly once, "
                          f"got {[(w.plan.rank, w.plan.tp_size) for w in ws]}")
    for w in ws[1:]:
        if (w.stem, os.path.dirname(w.path)) != (first.stem, os.path.dirname(first.path)):
            raise FormatError(f"finalize_set: {w.path} is not a sibling of {first.path} (same folder and stem)")
        if w.plan.config != first.plan.config or w._identity != first._identity:
            raise FormatError(f"finalize_set: {w.path}: model config or meta differs from rank 0")
    digests = [w.shard_digest() for w in ws]
    files = [{"name": os.path.basename(w.path), "payload_length": w.payload_length, "shard_digest": d}
             for w, d in zip(ws, digests)]
    aid = artifact_id(digests)
    for w in ws:
        w._write_head(files, aid)
    for w in ws:
        w.close()
        os.replace(w.partial, w.path)
    _fsync_dir(os.path.dirname(first.path) or ".")
    for w in ws:
        if os.path.exists(w.journal):
            os.unlink(w.journal)
    return [w.path for w in ws]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
