"""Multi-process tensor parallelism: one process per rank, spawned by `ninfer-rt` itself.

Rank 0 lives in the calling process (it runs the engine / server); ranks 1..N-1 are spawned with
torch.multiprocessing ("spawn") and run `follower_fn(group, *args)`. Rendezvous goes through a TCPStore
on 127.0.0.1 bound to a free port by the OS; rank 0 watches the followers while they join, so a follower
that dies early is reported instead of hanging. gloo on CPU, NCCL on GPU (NVLink multicast off).

Every group is checked at startup with a known-pattern all-reduce/all-gather whose sums are exact in
fp32 and bf16; a mismatch refuses to run (a broken transport would otherwise give plausible garbage).
GPU groups then set up the peer-memory one-shot all-reduce for small messages (allreduce.py), which verifies
itself the same way and falls back to NCCL for everything when it cannot be used.
"""
from __future__ import annotations

import atexit
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ninfer_formats.errors import NinferError
from ninfer_formats.proc_signals import exit_with_parent, ignore_in_child, parent_signals_blocked

from . import allreduce
from .tp_group import TPGroup

# NVLink SHARP / multicast paths are unreliable on the lent machines; every rank gets these
TP_ENV = dict(allreduce.NO_MULTICAST)
JOIN_TIMEOUT_S = 300.0
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)
# followers of an idle server wait on the control plane indefinitely; data collectives keep the short timeout
CONTROL_TIMEOUT = datetime.timedelta(days=365)


class TPError(NinferError):
    """The tensor-parallel process group could not be formed or failed its self-check."""


class DistGroup(TPGroup):
    """TPGroup over the default torch.distributed process group, plus the control-plane helpers."""

    def __init__(self, rank: int, size: int, device: torch.device, control=None):
        self.rank, self.size, self.device = rank, size, torch.device(device)
        self.control = control       # gloo group on CPU for step messages and sampled tokens
        self.p2p = None              # allreduce.P2PAllReduce for small GPU messages (set by _init)
        self.nccl_native = True      # 2 GPU ranks: NCCL sums bf16/fp16 partials natively (checked by allreduce.setup)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # the choice depends only on shape/dtype, so every rank takes the same path for the same call
        if self.p2p is not None:
            impl = self.p2p.pick(x)
            if impl != "nccl":
                return self.p2p.run(x, impl)
        return self.nccl_all_reduce(x)

    def nccl_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The process-group all-reduce: half-precision partials are summed in fp32 and rounded once (the
        reference's TP numerics). For two GPU ranks NCCL's native bf16/fp16 sum of the two partials is that
        same single rounding, with half the bytes and no conversion kernels; it may reuse x's storage."""
        if self.nccl_native and self.size == 2 and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            y = x.contiguous()
            dist.all_reduce(y)
            return y
        y = x.float() if x.dtype != torch.float32 else x.contiguous()
        dist.all_reduce(y)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's CPU tensor on every rank, over the control plane (same shape/dtype everywhere)."""
        x = x.cpu().contiguous()
        dist.broadcast(x, src=0, group=self.control)
        return x

    def broadcast_object(self, obj=None):
        """Rank 0's (small, picklable) control message on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def all_gather_object(self, obj) -> list:
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.control)
        return out


def check_collectives(group: TPGroup, device="cpu") -> None:
    """Exact known-pattern collectives; raises TPError naming the first wrong element."""
    n, s, r = 1000, group.size, group.rank
    base = torch.arange(n, dtype=torch.float32, device=device)
    x = base * (r + 1) + 7 * r
    want = base * (s * (s + 1) // 2) + 7 * (s * (s - 1) // 2)
    _expect(group.all_reduce(x.clone()), want, "all_reduce fp32", s)
    small = torch.remainder(base, 16)          # <= 15 * 36: integers exact in bf16 for TP <= 8
    xb = (small * (r + 1)).to(torch.bfloat16)
    _expect(group.all_reduce(xb.clone()).float(), small * (s * (s + 1) // 2), "all_reduce bf16", s)
    g = torch.full((3, 5), float(r), device=device) + torch.arange(5, device=device)
    want_g = torch.cat([torch.full((3, 5), float(k), device=device) + torch.arange(5, device=device)
                        for k in range(s)], dim=-1)
    _expect(group.all_gather_last(g), want_g, "all_gather_last", s)


def _expect(got: torch.Tensor, want: torch.Tensor, what: str, size: int) -> None:
    if got.shape != want.shape:
        raise TPError(f"tensor-parallel self-check: {what} over {size} ranks returned shape "
                      f"{tuple(got.shape)}, expected {tuple(want.shape)}; refusing to run")
    bad = (got.float() != want.float()).flatten().nonzero()
    if len(bad):
        i = int(bad[0])
        raise TPError(f"tensor-parallel self-check: {what} over {size} ranks is wrong at element {i} "
                      f"(got {got.flatten()[i].item()}, expected {want.flatten()[i].item()}); refusing to run")


def agree(group: TPGroup, error: str | None) -> None:
    """Collective: every rank raises if any rank reports an error (e.g. its shard failed to load)."""
    if group.size == 1:
        if error:
            raise TPError(error)
        return
    errors = group.all_gather_object(error)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        r, e = bad[0]
        raise TPError(e if r == group.rank else f"rank {r}: {e}")


def rank_device(device: str, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")


def _init(rank: int, size: int, store, device: str) -> DistGroup:
    os.environ.update(TP_ENV)
    dev = rank_device(device, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:        # ranks share the host's cores: oversubscribed BLAS threads slow every rank down
        torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // size)))
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=size, timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    group = DistGroup(rank, size, dev, control)
    check_collectives(group, dev)
    group.p2p = allreduce.setup(group)           # None on CPU, or when the peer-memory path is unusable
    return group


def _follower_entry(rank, size, port, device, follower_fn, args):
    # Ctrl-C / SIGTERM reach the whole process group: rank 0 owns the shutdown (it stops the followers, or
    # closes the group, which ends them here); they were blocked while this process started (proc_signals)
    ignore_in_child()
    exit_with_parent(os.getppid(), RANK0_GONE, 1.0)    # rank 0 killed: do not sit in a collective
    os.environ.update(TP_ENV)
    group = None
    try:
        store = dist.TCPStore("127.0.0.1", port, size, False, timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
        store.set(f"joined/{rank}", "1")
        group = _init(rank, size, store, device)
        follower_fn(group, *args)
    except TPError:
        sys.exit(2)             # agreed by every rank: rank 0 reports it, once
    except NinferError as e:
        print(f"error: rank {rank}: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:
        if group is not None and _peer_gone(e):
            sys.exit(RANK0_GONE)    # rank 0 closed the group (interrupted, or it failed and reports it)
        raise
    finally:
        if group is not None:
            group.p2p = None        # the symmetric buffer goes before the process group it was exchanged over
        if dist.is_initialized():
            dist.destroy_process_group()


RANK0_GONE = 3      # a follower's exit code when rank 0 closed the group under it


def _peer_gone(e: BaseException) -> bool:
    """A collective failed because another rank closed its connections (rank 0 shut the group down)."""
    if isinstance(e, getattr(dist, "DistNetworkError", ())):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(k in text for k in (
        "connection closed", "connection reset", "broken pipe", "socket closed"))


class Launch:
    """A formed TP group: rank 0 here (`group`), followers in child processes."""

    def __init__(self, group: DistGroup, procs: list):
        self.group, self.procs = group, procs

    def close(self, timeout_s: float = 60.0, released: bool = True) -> None:
        """Wait up to timeout_s for the followers to exit, then kill the rest. released=False: they were not
        told to stop (a step or the load was interrupted or failed) and sit in a collective that rank 0 will
        never join, so they are killed at once."""
        self.group.p2p = None
        if not released:
            _kill(self.procs)
        if dist.is_initialized():
            dist.destroy_process_group()
        _kill(self.procs, grace_s=timeout_s)    # stuck in a collective after rank 0 gave up: end our own children

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def launch(size: int, follower_fn, args=(), *, device: str = "cpu", join_timeout_s: float = JOIN_TIMEOUT_S) -> Launch:
    """Spawn ranks 1..size-1 running follower_fn(group, *args); return rank 0's Launch in this process."""
    if size < 2:
        raise TPError(f"--tp {size}: launch needs at least 2 ranks")
    if device == "cuda" and torch.cuda.device_count() < size:
        raise TPError(f"--tp {size}: needs {size} GPUs, {torch.cuda.device_count()} visible")
    os.environ.update(TP_ENV)
    store = dist.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=join_timeout_s))
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(store.port)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_follower_entry, args=(r, size, store.port, device, follower_fn, args),
                         daemon=True) for r in range(1, size)]
    with parent_signals_blocked():      # the followers ignore them once started (proc_signals)
        for p in procs:
            p.start()
    _STARTED[:] = [p for p in _STARTED if p.exitcode is None] + procs
    try:
        _wait_joined(store, procs, join_timeout_s)
        group = _init(0, size, store, device)
    except BaseException:
        _kill(procs, grace_s=0.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    return Launch(group, procs)


_STARTED: list = []     # every follower this process started (end_followers)


def end_followers() -> None:
    """Kill the followers still running (they ignore SIGINT/SIGTERM). Registered at exit, ahead of
    multiprocessing's own exit hook, which would only send SIGTERM and then wait for them."""
    _kill(_STARTED)


atexit.register(end_followers)


def _kill(procs, grace_s: float = 0.0) -> None:
    """SIGKILL the followers still running after `grace_s` (they ignore SIGINT/SIGTERM) and reap them."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.kill()
            p.join(5)


def _wait_joined(store, procs, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    keys = [f"joined/{r}" for r in range(1, len(procs) + 1)]
    while not store.check(keys):
        for r, p in enumerate(procs, start=1):
            if not p.is_alive():
                raise TPError(f"tensor-parallel rank {r} exited (code {p.exitcode}) before joining the group")
        if time.monotonic() > deadline:
            raise TPError(f"tensor-parallel ranks did not join within {timeout_s:.0f} s")
        time.sleep(0.05)
