"""Peer-memory all-reduce: size/dtype selection, the pattern checks (with fake reductions), run() over stand-in
kernels, the NCCL/gloo path on CPU unchanged; the startup fallback is in test_allreduce_setup.py. GPU test: 2 GPUs."""
from __future__ import annotations

import math

import pytest
import torch

from ninfer_rt import allreduce as ar
from ninfer_rt import allreduce_check as chk
from ninfer_rt import tp
from ninfer_rt.tp import DistGroup

KIB = 1024
BF, F16, F32 = torch.bfloat16, torch.float16, torch.float32
TWO_ROWS = ((64 * KIB, "one_shot"), (1024 * KIB, "two_shot"))


# ---- selection ----
@pytest.mark.parametrize("nbytes,want", [
    (10 * KIB, "one_shot"), (16, "one_shot"), (64 * KIB, "one_shot"), (64 * KIB + 16, "two_shot"),
    (1024 * KIB, "two_shot"), (1024 * KIB + 16, "nccl"), (0, "nccl"), (10 * KIB + 2, "nccl"), (8, "nccl"),
    (2048 * KIB, "nccl")],
    ids=["10KiB", "16B", "at_bound", "past_bound", "at_two_shot_bound", "past_table", "empty", "unaligned",
         "under_16B", "over_capacity"])
def test_choose_follows_the_table(nbytes, want):
    assert ar.choose(nbytes, TWO_ROWS, capacity=ar.capacity_for(TWO_ROWS)) == want


def test_choose_never_exceeds_the_buffer():
    assert ar.choose(512 * KIB, ((1024 * KIB, "one_shot"),), capacity=256 * KIB) == "nccl"
    assert ar.choose(10 * KIB, (), capacity=256 * KIB) == "nccl"


@pytest.mark.parametrize("dtype,world,want", [(BF, 2, BF), (F32, 2, F32), (F16, 2, F32), (BF, 4, F32),
                                              (F32, 8, F32), (torch.int32, 2, None), (torch.float64, 2, None)],
                         ids=["bf16-2", "f32-2", "f16-2", "bf16-4", "f32-8", "i32", "f64"])
def test_wire_dtype(dtype, world, want):
    assert ar.wire_dtype(dtype, world) == want


def test_rows_for_modes():
    assert ar.rows_for(2, "auto") == ar.CROSSOVER[2]
    assert ar.rows_for(3, "auto") == ar.DEFAULT_ROWS
    assert ar.rows_for(2, "nccl") == ()
    top = max(b for b, _ in ar.CROSSOVER[2])
    assert ar.rows_for(2, "two_shot") == ((top, "two_shot"),)
    for rows in ar.CROSSOVER.values():          # bounds ascending, known impls, 16-byte multiples
        assert [b for b, _ in rows] == sorted(b for b, _ in rows)
        assert all(i in ar.IMPLS and b % ar.ALIGN == 0 for b, i in rows)


class FakeTensor:
    """What pick() reads of a tensor."""

    def __init__(self, numel, dtype=BF, cuda=True, contiguous=True, offset=0):
        self.dtype, self.is_cuda, self._n, self._c, self._o = dtype, cuda, numel, contiguous, offset

    def numel(self):
        return self._n

    def is_contiguous(self):
        return self._c

    def storage_offset(self):
        return self._o

    def element_size(self):
        return torch.empty((), dtype=self.dtype).element_size()


def cpu_p2p(world=2, rows=TWO_ROWS):
    return ar.P2PAllReduce(torch.zeros(ar.capacity_for(rows), dtype=torch.uint8), "0", world, rows)


@pytest.mark.parametrize("x,want", [
    (FakeTensor(5120), "one_shot"), (FakeTensor(5120, F32), "one_shot"), (FakeTensor(5120 * 13), "two_shot"),
    (FakeTensor(5120, F16), "one_shot"), (FakeTensor(5120, cuda=False), "nccl"),
    (FakeTensor(5120, contiguous=False), "nccl"), (FakeTensor(5120, offset=3), "nccl"),
    (FakeTensor(5120, offset=8), "one_shot"), (FakeTensor(5121), "nccl"), (FakeTensor(5120, torch.int64), "nccl"),
    (FakeTensor(1024 * KIB), "nccl")],
    ids=["bf16_row", "f32_row", "13_rows", "f16_widened", "cpu", "strided", "odd_offset", "aligned_offset",
         "odd_size", "int64", "huge"])
def test_pick(x, want):
    assert cpu_p2p().pick(x) == want


def test_pick_in_world_four_counts_widened_bytes():
    p = cpu_p2p(world=4)
    assert p.pick(FakeTensor(16 * KIB)) == "one_shot"           # 32 KiB bf16 -> 64 KiB fp32: at the bound
    assert p.pick(FakeTensor(16 * KIB + 8)) == "two_shot"       # fp32 bytes past the one-shot bound


def test_pick_outside_capture_when_eager_is_slower(monkeypatch):
    p = cpu_p2p()
    p.eager = False
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert p.pick(FakeTensor(5120)) == "nccl"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert p.pick(FakeTensor(5120)) == "one_shot"


def test_fits_and_impls():
    p = cpu_p2p()
    assert p.impls == ("one_shot", "two_shot")
    assert p.fits((ar.capacity_for(TWO_ROWS) // 2,), BF) and not p.fits((ar.capacity_for(TWO_ROWS) // 2 + 8,), BF)
    assert not p.fits((3,), BF) and not p.fits((4,), torch.int32)


# ---- DistGroup dispatch (CPU: gloo path unchanged) ----
class FakeP2P:
    def __init__(self, impl):
        self.impl, self.calls = impl, []

    def pick(self, x):
        return self.impl

    def run(self, x, impl):
        self.calls.append(impl)
        return x * 0 + 42


def test_dist_group_routes_by_pick(monkeypatch):
    seen = []
    monkeypatch.setattr(tp.dist, "all_reduce", lambda y: seen.append(y.dtype) or y.mul_(2))
    g = DistGroup(0, 2, "cpu")
    x = torch.ones(8, dtype=BF)
    assert g.p2p is None and torch.equal(g.all_reduce(x), torch.full((8,), 2.0, dtype=BF))
    assert seen == [F32]                       # CPU half precision still goes as fp32 partials
    g.p2p = FakeP2P("one_shot")
    assert torch.equal(g.all_reduce(x), torch.full((8,), 42.0, dtype=BF)) and g.p2p.calls == ["one_shot"]
    g.p2p = FakeP2P("nccl")
    assert torch.equal(g.all_reduce(torch.ones(4)), torch.full((4,), 2.0)) and g.p2p.calls == []


def test_tp_env_keeps_multicast_off():
    assert tp.TP_ENV == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                         "NVSHMEM_DISABLE_NVLS": "1"}


# ---- pattern checks ----
def rne(v: float, dtype) -> float:
    """Exact round-to-nearest-even of a Python float (an exact sum) to bf16/fp16/fp32, subnormals included."""
    bits, emin = {BF: (8, -133), F16: (11, -24), F32: (24, -149)}[dtype]
    if v == 0:
        return 0.0
    _, e = math.frexp(v)
    q = 2.0 ** max(e - bits, emin)
    return round(v / q) * q


@pytest.mark.parametrize("dtype", [BF, F16, F32], ids=["bf16", "f16", "f32"])
def test_round_expected_is_one_rounding_of_the_exact_sum(dtype):
    c = chk.Case("round", (2048,), dtype, seed=5)
    a, b = (chk.contribution(c, r, 2).double().tolist() for r in range(2))
    want = torch.tensor([rne(x + y, dtype) for x, y in zip(a, b)], dtype=torch.float64)
    got = chk.expected(c, 2).double()
    assert torch.equal(got, want)
    exact = torch.tensor(a, dtype=torch.float64) + torch.tensor(b, dtype=torch.float64)
    assert exact.ne(got).any()                   # rounding actually happens in the case


@pytest.mark.parametrize("world", [2, 4, 8], ids=["w2", "w4", "w8"])
def test_patterns_are_exact_and_rank_dependent(world):
    for c in chk.default_cases(world, 4 * KIB):
        parts = [chk.contribution(c, r, world) for r in range(world)]
        want = chk.expected(c, world)
        assert want.dtype == c.dtype and tuple(want.shape) == c.shape
        if c.kind != "round":
            assert torch.equal(want.double(), sum(p.double() for p in parts)), c.label   # exact in the dtype
        for r, p in enumerate(parts):
            assert not torch.equal(want, p), c.label                               # peers dropped
            assert not torch.equal(want.float(), p.float() * world), c.label       # one rank counted for all
            shifted = sum(q.float() for k, q in enumerate(parts) if k != r) + p.flatten().roll(1).reshape(p.shape)
            assert not torch.equal(want.float(), shifted.to(c.dtype).float()), c.label  # read at an offset


CASES2 = [chk.Case("ramp", (40,), BF), chk.Case("blocks", (3, 256), F32), chk.Case("round", (2, 96), BF, 1)]


def fault(kind, case, rank):
    want = chk.expected(case, 2)
    mine, peer = chk.contribution(case, rank, 2), chk.contribution(case, 1 - rank, 2)
    if kind == "local_only":
        return mine
    if kind == "peer_only":
        return peer
    if kind == "doubled":
        return (mine.float() * 2).to(case.dtype)
    if kind == "peer_shifted":
        return (mine.float() + peer.flatten().roll(1).reshape(peer.shape).float()).to(case.dtype)
    if kind == "half_reduced":
        out = want.clone().flatten()
        out[out.numel() // 2:] = mine.flatten()[out.numel() // 2:]
        return out.reshape(want.shape)
    if kind == "one_ulp":
        out = want.clone().flatten()
        out[-1] = torch.nextafter(out[-1:].float(), torch.tensor([1e9])).to(case.dtype)[0] \
            if case.dtype == F32 else (out[-1:].view(torch.int16) + 1).view(case.dtype)[0]
        return out.reshape(want.shape)
    if kind == "nan":
        return want.clone().flatten().index_fill_(0, torch.tensor([3]), float("nan")).reshape(want.shape)
    if kind == "truncated":       # fp32 sum truncated instead of rounded to nearest-even
        s = (mine.float() + peer.float()).view(torch.int32) & ~0xFFFF if case.dtype == BF else None
        return s.view(F32).to(BF) if s is not None else want.clone()
    if kind == "shape":
        return want.reshape(1, -1)
    return want.to(F32 if case.dtype != F32 else BF)


@pytest.mark.parametrize("rank", [0, 1], ids=["rank0", "rank1"])
@pytest.mark.parametrize("kind", ["local_only", "peer_only", "doubled", "peer_shifted", "half_reduced", "one_ulp",
                                  "nan", "shape", "dtype"])
def test_run_cases_catches_a_broken_reduction(kind, rank):
    for case in CASES2:
        msg = chk.run_cases(lambda x, c=case: fault(kind, c, rank), [case], rank, 2, "cpu")
        assert msg and msg.startswith(case.label), (kind, case.label)


def test_run_cases_catches_truncation_in_round_cases():
    case = chk.Case("round", (4096,), BF, 9)
    assert chk.run_cases(lambda x: fault("truncated", case, 0), [case], 0, 2, "cpu")


def test_run_cases_accepts_a_correct_reduction_and_waits_once():
    cases = chk.default_cases(2, 8 * KIB)
    it, waits = iter(cases), []
    assert chk.run_cases(lambda x: chk.expected(next(it), 2), cases, 1, 2, "cpu", lambda: waits.append(1)) is None
    assert waits == [1]


def test_variant_changes_every_case_contents():
    for c in chk.default_cases(2, 4 * KIB):
        assert not torch.equal(chk.contribution(c, 0, 2), chk.contribution(chk.variant(c), 0, 2)), c.label


def test_case_validation():
    with pytest.raises(ValueError, match="kind"):
        chk.Case("zigzag", (4,), BF)
    with pytest.raises(ValueError, match="shape"):
        chk.Case("ramp", (0,), BF)
    with pytest.raises(ValueError, match="2 ranks"):
        chk.contribution(chk.Case("round", (8,), BF), 0, 4)


# ---- 2 GPUs ----
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_peer_memory_equals_nccl_bit_for_bit_on_two_gpus():
    from allreduce_workers import compare_program
    with tp.launch(2, compare_program, (3,), device="cuda") as lch:
        res = compare_program(lch.group, 3)
    # the fast path may only be off where the GPUs cannot reach each other's memory; then the calls went
    # to NCCL and must still agree with it
    assert res["p2p"] or not torch.cuda.can_device_access_peer(0, 1)
    assert res["eager_mismatch"] == [] and res["graph_mismatch"] == []
    assert all(p.exitcode == 0 for p in lch.procs)


class FakeKernels:
    """Stand-ins for the symm_mem kernels: check the buffer view they get, and reduce as if every one of
    `world` ranks held the same partial."""

    def __init__(self, p2p, world):
        self.p2p, self.world, self.seen = p2p, world, []

    def _check(self, view, shape, dtype):
        assert view.data_ptr() == self.p2p.buf.data_ptr() and view.is_contiguous()
        assert tuple(view.shape) == tuple(shape) and view.dtype == dtype

    def copy(self, view, local, op, name):
        self._check(view, local.shape, local.dtype)
        self.seen.append(("one_shot", local.dtype))
        view.copy_(local)
        return view * self.world

    def plain(self, view, op, name):         # one_shot_all_reduce: the caller copied the partial in
        self.seen.append(("one_shot", view.dtype))
        return view * self.world

    def two_shot_out(self, view, op, name, out):
        self._check(view, out.shape, out.dtype)
        self.seen.append(("two_shot", view.dtype))
        return out.copy_(view * self.world)


@pytest.mark.parametrize("world,dtype,wire", [(2, BF, BF), (2, F32, F32), (2, F16, F32), (4, BF, F32)],
                         ids=["bf16-2", "f32-2", "f16-2-widened", "bf16-4-widened"])
@pytest.mark.parametrize("impl", ["one_shot", "one_shot_without_copy_op", "two_shot"])
def test_run_passes_the_buffer_view_and_narrows_once(monkeypatch, world, dtype, wire, impl):
    p = cpu_p2p(world=world)
    k = FakeKernels(p, world)
    p._copy_op = None if impl == "one_shot_without_copy_op" else k.copy
    impl = impl.removesuffix("_without_copy_op")
    monkeypatch.setattr(torch.ops.symm_mem, "two_shot_all_reduce_out", k.two_shot_out, raising=False)
    monkeypatch.setattr(torch.ops.symm_mem, "one_shot_all_reduce", k.plain, raising=False)
    x = (torch.randn(3, 40) * 7).to(dtype)
    y = p.run(x, impl)
    assert k.seen == [(impl, wire)] and y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, (x.float() * world).to(dtype)) and y.data_ptr() != p.buf.data_ptr()
    with pytest.raises(ValueError, match="unknown implementation"):
        p.run(x, "three_shot")
