"""One-shot all-reduce over peer-to-peer GPU memory for decode-sized tensor-parallel messages; NCCL for the rest.

A decode step of the 27B model does 128 all-reduces of one 5120-wide bf16 row (10 KiB). NCCL spends ~22 us on
each inside a CUDA graph on 2 x H200 (~2.8 ms per token, close to a whole TP1 step at roofline). Here each rank owns
a static symmetric-memory buffer (PyTorch `torch.distributed._symmetric_memory`, CUDA backend, multicast off)
mapped into every peer; one kernel (`symm_mem::one_shot_all_reduce_copy`) copies the local partial into it,
meets the peers at a signal-pad barrier, sums every rank's buffer and meets them again before the buffer may be
reused. No host synchronisation, static buffers: it captures into CUDA graphs and replays.

Numerics: with 2 ranks the partials travel in their own dtype (bf16 or fp32): the sum of two bf16 values
rounded once is exactly the reference's "fp32 sum of the bf16 partials, one rounding", whatever the order.
With more ranks half-precision partials are widened to fp32 first and narrowed once after the sum.

Which path a call takes is a pure function of the message (shape, dtype, world size) and the crossover table
below, so every rank picks the same one. At startup (`setup`, called by tp._init on GPU groups) every rank
checks peer access, builds the buffer and verifies it with exact known patterns (allreduce_check.py), eagerly
and inside a CUDA graph; any failure on any rank sends all ranks to NCCL with one stderr line. NINFER_ALLREDUCE
= auto (default) | nccl | one_shot | two_shot forces a choice (every rank inherits the launcher's environment).
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time

import torch
from ninfer_formats.errors import NinferError

from . import allreduce_check as chk

KIB = 1024
ENV_MODE = "NINFER_ALLREDUCE"
MODES = ("auto", "nccl", "one_shot", "two_shot")
IMPLS = ("one_shot", "two_shot")
# NVLink SHARP / multicast paths are unreliable on the lent machines: every TP process runs with these
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# (largest message in bytes, implementation) per world size; first match wins, larger messages go to NCCL.
# Measured with bench/allreduce.py on 2xH200 (NV18), CUDA-graph timings (bench/results/allreduce.json):
# one-shot 7.1 us vs NCCL 17.2 us at 10 KiB, ahead up to 1 MiB; two-shot ahead from 2 to 4 MiB.
CROSSOVER: dict[int, tuple[tuple[int, str], ...]] = {
    2: ((1024 * KIB, "one_shot"), (4096 * KIB, "two_shot")),
}
DEFAULT_ROWS: tuple[tuple[int, str], ...] = ((256 * KIB, "one_shot"),)
ALIGN = 16                   # the kernels' 16-byte vector loads: sizes and offsets must be multiples
CHECK_TIMEOUT_S = 60.0       # a verification that has not finished by then is a hung peer-memory barrier
CALIBRATE_BYTES = 10 * KIB
CALIBRATE_ITERS = 50


class AllReduceHang(NinferError):
    """A peer-memory all-reduce did not complete: the GPU is stuck in its barrier; the process must end."""


def wire_dtype(dtype: torch.dtype, world: int) -> torch.dtype | None:
    """The dtype the partials travel in on the peer-memory path (None: not supported there)."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    if world == 2 and dtype != torch.float16:     # the kernels take bf16 and fp32, not fp16
        return dtype
    return torch.float32


def rows_for(world: int, mode: str) -> tuple[tuple[int, str], ...]:
    """The crossover rows in force: the table's (auto) or every size up to its bound on one forced impl."""
    rows = CROSSOVER.get(world, DEFAULT_ROWS)
    if mode in IMPLS:
        return ((max(b for b, _ in rows), mode),)
    return rows if mode == "auto" else ()


def choose(nbytes: int, rows, capacity: int) -> str:
    """Implementation for a message of `nbytes` (in the wire dtype): the first row whose bound covers it, else
    "nccl". Empty, unaligned or larger-than-buffer messages always go to NCCL."""
    if nbytes <= 0 or nbytes % ALIGN or nbytes > capacity:
        return "nccl"
    for bound, impl in rows:
        if nbytes <= bound:
            return impl
    return "nccl"


def capacity_for(rows) -> int:
    top = max((b for b, _ in rows), default=0)
    return max(ALIGN, -(-top // ALIGN) * ALIGN)


class P2PAllReduce:
    """One rank's symmetric buffer plus the PyTorch symmetric-memory kernels over it."""

    def __init__(self, buf: torch.Tensor, group_name: str, world: int, rows):
        self.buf, self.group_name, self.world, self.rows = buf, group_name, world, tuple(rows)
        self.capacity = buf.numel()
        self.eager = True           # False: use it only while a CUDA graph is being captured (see calibrate)
        self._views = {dt: buf.view(dt) for dt in (torch.bfloat16, torch.float32)}
        ops = torch.ops.symm_mem
        self._copy_op = ops.one_shot_all_reduce_copy if hasattr(ops, "one_shot_all_reduce_copy") else None

    @classmethod
    def create(cls, group, rows) -> P2PAllReduce:
        """Collective: allocate the buffer on group.device and exchange its handles with every rank."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm
        name = dist.group.WORLD.group_name
        # plain CUDA IPC mappings (not NVSHMEM); refused once memory is in use; older builds: CUDA is the default
        with contextlib.suppress(Exception):
            symm.set_backend("CUDA")
        buf = symm.empty(capacity_for(rows), dtype=torch.uint8, device=group.device)
        buf.zero_()
        torch.cuda.synchronize(group.device)    # allocation (signal pads zeroed) done before any peer can signal
        _rendezvous(symm, buf, name)
        return cls(buf, name, group.size, rows)

    @property
    def impls(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(impl for _, impl in self.rows))

    def fits(self, shape, dtype) -> bool:
        """Whether a message of this shape and dtype can take the peer-memory path at all (buffer, alignment)."""
        wd = wire_dtype(dtype, self.world)
        n = 1
        for d in shape:
            n *= d
        return wd is not None and 0 < n * _size(wd) <= self.capacity and (n * _size(wd)) % ALIGN == 0

    def pick(self, x: torch.Tensor) -> str:
        """"one_shot" | "two_shot" | "nccl" for this message (the same on every rank for the same shape)."""
        wd = wire_dtype(x.dtype, self.world)
        if wd is None or not x.is_cuda or not x.is_contiguous():
            return "nccl"
        if wd == x.dtype and (x.storage_offset() * x.element_size()) % ALIGN:
            return "nccl"
        impl = choose(x.numel() * _size(wd), self.rows, self.capacity)
        if impl != "nccl" and not self.eager and not torch.cuda.is_current_stream_capturing():
            return "nccl"
        return impl

    def run(self, x: torch.Tensor, impl: str) -> torch.Tensor:
        """The sum over ranks of `x` (a new tensor; `x` is left as is). Every rank must call it with the same
        shape, dtype and impl, in the same order relative to other collectives."""
        wire = x if wire_dtype(x.dtype, self.world) == x.dtype else x.float()
        view = self._views[wire.dtype][:wire.numel()].view(wire.shape)
        if impl == "one_shot":
            if self._copy_op is not None:
                out = self._copy_op(view, wire, "sum", self.group_name)
            else:
                view.copy_(wire)
                out = torch.ops.symm_mem.one_shot_all_reduce(view, "sum", self.group_name)
        elif impl == "two_shot":
            view.copy_(wire)
            out = torch.empty_like(wire)
            torch.ops.symm_mem.two_shot_all_reduce_out(view, "sum", self.group_name, out)
        else:
            raise ValueError(f"all-reduce: unknown implementation {impl!r}")
        return out if out.dtype == x.dtype else out.to(x.dtype)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _rendezvous(symm, buf, name: str) -> None:
    """Exchange handles. Older PyTorch wants the group registered first (enable_symm_mem_for_group); newer ones
    resolve it themselves and warn on that call (and registering makes every kernel call consult the store),
    so it is only made when the plain rendezvous asks for it, which it does before any exchange."""
    try:
        symm.rendezvous(buf, name)
    except RuntimeError as e:
        if "group" not in str(e).lower() or not hasattr(symm, "enable_symm_mem_for_group"):
            raise
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            symm.enable_symm_mem_for_group(name)
        symm.rendezvous(buf, name)


# ---- startup: checks, verification, calibration (collective: every rank of the group runs `setup`) ----
def setup(group, *, mode: str | None = None, log=None) -> P2PAllReduce | None:
    """After the NCCL self-check on a GPU group: verify NCCL's native half-precision sum (2 ranks; else it gets
    fp32 partials) and build and verify the peer-memory path. Returns it, or None (NCCL for every message).
    `group` is a tp.DistGroup (rank, size, device, nccl_all_reduce, nccl_native, control-plane helpers)."""
    if group.device.type != "cuda" or group.size < 2:
        return None
    mode = os.environ.get(ENV_MODE, "auto") if mode is None else mode
    say = (log or _stderr) if group.rank == 0 else (lambda msg: None)
    err = _agreed(group, _guard(_check_nccl_native, group))
    if err:
        group.nccl_native = False
        say(f"all-reduce: NCCL gets fp32 partials (its native half-precision sum failed the check: {err})")
    if mode not in MODES:
        say(f"all-reduce: NCCL for every message ({ENV_MODE}={mode!r} is not one of {', '.join(MODES)})")
        return None
    if mode == "nccl":
        say(f"all-reduce: NCCL for every message ({ENV_MODE}=nccl)")
        return None
    rows = rows_for(group.size, mode)
    p2p, err = None, _agreed(group, _guard(local_problem, group))
    if err is None:
        try:
            p2p = P2PAllReduce.create(group, rows)
        except Exception as e:          # noqa: BLE001 - any failure here means: use NCCL
            err = f"symmetric memory setup failed: {_one_line(e)}"
        err = _agreed(group, err)
    if err is None:
        err = _agreed(group, _guard(verify, p2p, group))
    if err is not None:
        say(f"all-reduce: NCCL for every message; peer-memory path off: {err}")
        return None
    p2p.eager, t_p2p, t_nccl = calibrate(p2p, group)
    top = max(b for b, _ in rows)
    say(f"all-reduce: peer memory ({'/'.join(p2p.impls)}) up to {top / KIB:g} KiB, NCCL above; 10 KiB eager "
        f"{t_p2p * 1e6:.1f} us vs NCCL {t_nccl * 1e6:.1f} us"
        + ("" if p2p.eager else " -> eager calls use NCCL, CUDA graphs the peer-memory path"))
    return p2p


def local_problem(group) -> str | None:
    """Why this rank cannot use the peer-memory path (None: it can)."""
    import torch.distributed as dist
    for k, v in NO_MULTICAST.items():
        if os.environ.get(k) != v:
            return f"{k}={os.environ.get(k)!r}, expected {v!r} (NVLink multicast must stay off)"
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return "the default process group is not NCCL"
    if torch.cuda.device_count() < group.size:
        return f"{torch.cuda.device_count()} GPUs visible for {group.size} ranks"
    me = group.device.index
    for p in range(group.size):       # rank p runs on cuda:p (tp.rank_device)
        if p != me and not torch.cuda.can_device_access_peer(me, p):
            return f"cuda:{me} has no peer access to cuda:{p}"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError as e:
        return f"this PyTorch has no symmetric memory ({e})"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce"):
        return "this PyTorch has no symm_mem.one_shot_all_reduce kernel"
    return None


def verify(p2p: P2PAllReduce, group) -> str | None:
    """Every implementation in use on every check case, eagerly and replayed twice from a CUDA graph."""
    dev, rank, world = group.device, group.rank, group.size
    cases = [c for c in chk.default_cases(world, p2p.capacity) if p2p.fits(c.shape, c.dtype)]
    wait = lambda: wait_gpu(dev, CHECK_TIMEOUT_S, "the peer-memory all-reduce check")
    for impl in p2p.impls:
        msg = chk.run_cases(lambda x: p2p.run(x, impl), cases, rank, world, dev, wait)    # noqa: B023
        if msg:
            return f"{impl}: {msg}"
        msg = graph_check(p2p, impl, cases, rank, world, dev, wait)
        if msg:
            return f"{impl} in a CUDA graph: {msg}"
    return None


def graph_check(p2p: P2PAllReduce, impl: str, cases, rank: int, world: int, device, wait) -> str | None:
    """Capture one call per case over static inputs, then replay with two different input sets."""
    static = [chk.contribution(c, rank, world).to(device) for c in cases]
    cur, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    side.wait_stream(cur)
    with torch.cuda.stream(side):               # warm-up outside the capture, as torch.cuda.graph asks
        for x in static:
            p2p.run(x, impl)
    cur.wait_stream(side)
    wait()                                      # before the capture's device synchronize (no timeout there)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        outs = [p2p.run(x, impl) for x in static]
    for batch in (list(cases), [chk.variant(c) for c in cases]):
        for x, c in zip(static, batch):          # the stream is idle here: these copies cannot block on a peer
            x.copy_(chk.contribution(c, rank, world))
        g.replay()
        wait()
        for c, y in zip(batch, outs):
            msg = chk.mismatch(c, y.cpu(), chk.expected(c, world))
            if msg:
                return f"{c.label}: {msg}"
    return None


def calibrate(p2p: P2PAllReduce, group) -> tuple[bool, float, float]:
    """Eager 10 KiB all-reduce, peer memory vs NCCL, host wall time per call (rank 0's numbers decide for
    all ranks). Eager calls pay host overheads a graph replay does not; if they make the peer-memory call
    the slower one, eager calls keep NCCL and only graph captures use peer memory."""
    impl = choose(CALIBRATE_BYTES, p2p.rows, p2p.capacity)
    if impl == "nccl":
        return True, float("nan"), float("nan")
    x = torch.zeros(CALIBRATE_BYTES // 2, dtype=torch.bfloat16, device=group.device)
    t_p2p = _host_time(lambda: p2p.run(x, impl), group.device)
    t_nccl = _host_time(lambda: group.nccl_all_reduce(x), group.device)
    t_p2p, t_nccl = group.broadcast_object((t_p2p, t_nccl) if group.rank == 0 else None)
    return t_p2p <= t_nccl, t_p2p, t_nccl


def wait_gpu(device, timeout_s: float, what: str) -> None:
    """Wait for the current stream without blocking forever in the driver (a stuck barrier never returns)."""
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    deadline = time.monotonic() + timeout_s
    while not ev.query():
        if time.monotonic() > deadline:
            raise AllReduceHang(f"{what} did not finish within {timeout_s:.0f} s on {device} (a peer never "
                                f"reached the barrier); rerun with {ENV_MODE}=nccl")
        time.sleep(0.0005)


def _check_nccl_native(group) -> str | None:
    if group.size != 2:
        return None
    h = chk.HIDDEN
    cases = [chk.Case("round", (h,), torch.bfloat16, 11), chk.Case("round", (3, h), torch.float16, 12),
             chk.Case("ramp", (h,), torch.bfloat16)]
    group.nccl_native = True
    return chk.run_cases(group.nccl_all_reduce, cases, group.rank, group.size, group.device,
                         lambda: torch.cuda.synchronize(group.device))


def _host_time(fn, device) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(CALIBRATE_ITERS):
        fn()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t) / CALIBRATE_ITERS


def _agreed(group, err: str | None) -> str | None:
    """Collective: the first rank's error (prefixed with its rank), the same string on every rank."""
    for r, e in enumerate(group.all_gather_object(err)):
        if e:
            return f"rank {r}: {e}"
    return None


def _guard(fn, *args) -> str | None:
    try:
        return fn(*args)
    except AllReduceHang:
        raise
    except Exception as e:              # noqa: BLE001 - reported, then NCCL takes over
        return _one_line(e)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
