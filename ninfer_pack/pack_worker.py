"""One conversion task inside a worker: read rows lazily, encode, cut per rank, pwrite via RankWriter.

A tensor is encoded in row chunks of about CHUNK_ELEMS weights. Every format quantizes rows independently
(NVFP4 given its global scale, which is computed over the whole fusion group first), so concatenating the
chunk encodings gives exactly the whole-tensor encoding; each chunk is cut per rank with
`codecs.slice_encoded`, and each rank's shard is assembled from its pieces. Peak memory per worker is one
chunk's working set plus the tensor's encoded bytes, whatever the tensor's size.
"""
from __future__ import annotations

import os
import time

import numpy as np
import xxhash

from ninfer_formats import codecs
from ninfer_formats.codecs import fp8, nvfp4
from ninfer_formats.constants import FORMATS
from ninfer_formats.errors import SourceError

from .hf_source import TensorReader, to_f32
from .pack_plan import Task, TensorJob, numel

CHUNK_ELEMS = int(os.environ.get("NINFER_PACK_CHUNK_ELEMS", 1 << 22))   # env: tests force many chunks
_ROW_MAJOR = frozenset({"f32", "f16", "bf16", "i32", "q6_k", "iq3_s"})   # encoded rows are contiguous
_WRITERS: list | None = None


def init_worker(writers, parent_pid: int | None = None) -> None:
    """Pool initializer: the rank writers (pickled; each process reopens the .partial files). Ctrl-C is the
    parent's to handle (it ends the workers and prints one line); the workers ignore SIGINT."""
    import signal
    from ninfer_formats.proc_signals import exit_with_parent, ignore_in_child
    ignore_in_child((signal.SIGINT,))
    global _WRITERS
    _WRITERS = writers
    if parent_pid is not None:
        exit_with_parent(parent_pid, 1)


def chunks(shape: tuple[int, ...]):
    n = shape[0] if shape else 1
    per_row = max(1, numel(shape[1:]))
    step = max(1, CHUNK_ELEMS // per_row)
    for a in range(0, n, step):
        yield a, min(n, a + step)


class ShardAssembler:
    """Collects encoded row pieces of one rank's shard, in row order, into the shard's container bytes."""

    def __init__(self, fmt: str, shape: tuple[int, ...]):
        self.fmt, self.shape = fmt, shape
        self.size = FORMATS[fmt].encoded_size(shape)
        self.buf = np.empty(self.size, np.uint8) if fmt in _ROW_MAJOR else None
        self.pos, self.parts, self.rows = 0, [], 0

    def add(self, data: np.ndarray, shape: tuple[int, ...]) -> None:
        self.rows += shape[0] if shape else 1
        if self.buf is not None:
            self.buf[self.pos:self.pos + data.size] = data
            self.pos += data.size
        elif self.fmt == "nvfp4":
            self.parts.append(codecs.split_nvfp4(data, shape))
        else:                                         # f8_e4m3_row: row scales, then codes
            self.parts.append(fp8.split(data, shape))

    def result(self) -> np.ndarray:
        if self.buf is not None:
            out = self.buf
        elif self.fmt == "nvfp4":
            codes, scales, s2 = zip(*self.parts)
            out = nvfp4.join(np.concatenate(codes), np.concatenate(scales), s2[0])
        else:
            scale, codes = zip(*self.parts)
            out = fp8.join(np.concatenate(scale), np.concatenate(codes))
        if out.size != self.size or (self.buf is not None and self.pos != self.size):
            raise AssertionError(f"shard of {self.shape} assembled to {out.size} bytes, expected {self.size}")
        return out


def _pieces(job: TensorJob, enc, cshape, rank: int, a: int, b: int):
    """This chunk's part of `rank`'s shard: (bytes, shape) pieces in row order."""
    sp = job.split
    if sp.replicated:
        return [(enc, cshape)]
    if sp.dim == len(cshape) - 1 and len(cshape) > 1:          # column cut: every chunk contributes
        (s, t), = sp.ranges[rank]
        return [codecs.slice_encoded(job.fmt, enc, cshape, sp.dim, s, t, name=job.name)]
    out = []
    for s, t in sp.ranges[rank]:                               # row runs (several for in_proj_qkv/conv1d)
        lo, hi = max(s, a), min(t, b)
        if lo < hi:
            whole = (lo, hi) == (a, b)
            out.append((enc, cshape) if whole else
                       codecs.slice_encoded(job.fmt, enc, cshape, 0, lo - a, hi - a, name=job.name))
    return out


def _hash_rows(h, raw: np.ndarray) -> None:
    h.update(np.ascontiguousarray(raw).reshape(-1).view(np.uint8).data)


def source_digest(src) -> str:
    """xxh3-128 of a source tensor's stored bytes: tells a resume whether a touched file really changed."""
    h = xxhash.xxh3_128()
    with TensorReader(src) as rd:
        for a, b in chunks(src.shape):
            _hash_rows(h, rd.rows(a, b))
    return h.hexdigest()


def _encode(job: TensorJob, raw: np.ndarray, gscale):
    if job.fmt == job.src.fmt:                                  # same dtype: bits pass through unchanged
        return codecs.encode(job.fmt, raw, name=job.name)
    kw = {"global_scale": gscale} if job.fmt == "nvfp4" else {}
    return codecs.encode(job.fmt, to_f32(raw), name=job.name, **kw)


def group_scale(task: Task):
    """The NVFP4 global scale shared by the task's nvfp4 members (amax over all of them), or None."""
    members = [j for j in task.jobs if j.fmt == "nvfp4"]
    if not members:
        return None
    hi = lo = np.float32(0)
    for j in members:
        with TensorReader(j.src) as rd:
            for a, b in chunks(j.src.shape):
                x = to_f32(rd.rows(a, b))
                hi, lo = max(hi, x.max()), min(lo, x.min())
                if not (np.isfinite(hi) and np.isfinite(lo)):
                    raise SourceError(f"{j.src.file}: tensor {j.src.hf_name} contains NaN or Inf")
    probe = np.zeros((1, FORMATS["nvfp4"].k_multiple), np.float32)   # the codec's amax rule sees hi and lo
    probe[0, :2] = hi, lo
    return nvfp4.global_scale(probe, name=members[0].name)


def convert_job(job: TensorJob, ranks: tuple[int, ...], gscale, writers) -> dict:
    """Encode one tensor, write its shard to each rank in `ranks`; returns its report entry."""
    t0 = time.perf_counter()
    keys = (0,) if job.split.replicated else ranks
    asm = {r: ShardAssembler(job.fmt, job.split.rank_shape) for r in keys}
    err2 = ref2 = 0.0
    src_hash = xxhash.xxh3_128()
    with TensorReader(job.src) as rd:
        for a, b in chunks(job.src.shape):
            raw = rd.rows(a, b)
            _hash_rows(src_hash, raw)
            cshape = (b - a,) + tuple(job.src.shape[1:])
            enc = _encode(job, raw, gscale)
            if job.fmt != job.src.fmt:        # pass-through is exact: no error to measure
                ref = to_f32(raw)
                ref2 += float(np.square(ref).sum(dtype=np.float64))
                err2 += float(np.square(codecs.decode(job.fmt, enc, cshape) - ref).sum(dtype=np.float64))
            for r, s in asm.items():
                for data, shape in _pieces(job, enc, cshape, r, a, b):
                    s.add(data, shape)
    for r in ranks:
        writers[r].write(job.name, asm[0 if job.split.replicated else r].result())
    size = FORMATS[job.fmt].encoded_size(job.src.shape)
    return {"name": job.name, "role": job.role, "format": job.fmt, "source_dtype": job.src.fmt,
            "shape": list(job.src.shape), "rank_shape": list(job.split.rank_shape),
            "bits_per_weight": round(8 * size / max(1, numel(job.src.shape)), 4),
            "rel_rmse": float(np.sqrt(err2 / ref2)) if ref2 > 0 else float(np.sqrt(err2)),
            "seconds": round(time.perf_counter() - t0, 4), "source_xxh3": src_hash.hexdigest()}


def run_task(task: Task, writers=None) -> list[dict]:
    """Convert every job of `task` that some rank still needs (all members count for the NVFP4 scale)."""
    writers = _WRITERS if writers is None else writers
    gscale = group_scale(task)
    return [convert_job(j, todo, gscale, writers) for j, todo in zip(task.jobs, task.todo) if todo]
