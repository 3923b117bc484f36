"""Peer-memory all-reduce startup: every rank's problem, setup failure or check failure is agreed over the
control plane and sends all ranks to NCCL with one log line; a hung check is fatal; local prerequisites."""
from __future__ import annotations

import pytest
import torch

from ninfer_rt import allreduce as ar

GPU0 = torch.device("cuda", 0)           # only described, never touched (no CUDA needed)


def cpu_p2p(rows):
    return ar.P2PAllReduce(torch.zeros(ar.capacity_for(rows), dtype=torch.uint8), "0", 2, rows)


class FakeGroup:
    """Rank 0 of a 2-rank GPU group whose other rank answers the control-plane gathers with `peer_errors`."""

    def __init__(self, peer_errors=(), device=GPU0):
        self.rank, self.size, self.device = 0, 2, device
        self.nccl_native, self.peer_errors, self.gathers = True, list(peer_errors), 0

    def all_gather_object(self, obj):
        self.gathers += 1
        return [obj, self.peer_errors.pop(0) if self.peer_errors else None]

    def broadcast_object(self, obj=None):
        return obj


class SetupSpy:
    def __init__(self, monkeypatch, *, local=None, verify=None, nccl=None, create_error=None):
        self.created, self.logs = [], []
        monkeypatch.setattr(ar, "_check_nccl_native", lambda g: nccl)
        monkeypatch.setattr(ar, "local_problem", lambda g: local)
        monkeypatch.setattr(ar, "verify", verify if callable(verify) else (lambda p, g: verify))
        monkeypatch.setattr(ar, "calibrate", lambda p, g: (True, 3e-6, 2.2e-5))

        def create(group, rows):
            if create_error:
                raise RuntimeError(create_error)
            p = cpu_p2p(rows)
            self.created.append(p)
            return p
        monkeypatch.setattr(ar.P2PAllReduce, "create", staticmethod(create))

    def setup(self, group, mode="auto"):
        return ar.setup(group, mode=mode, log=self.logs.append)


def test_setup_on_cpu_does_nothing(monkeypatch):
    spy = SetupSpy(monkeypatch, local="must not be asked")
    g = FakeGroup(device=torch.device("cpu"))
    assert spy.setup(g) is None and g.gathers == 0 and spy.logs == [] and g.nccl_native


def test_setup_builds_and_reports_the_path(monkeypatch):
    spy = SetupSpy(monkeypatch)
    p = spy.setup(FakeGroup())
    assert p is spy.created[0] and p.eager
    assert len(spy.logs) == 1 and "peer memory (one_shot/two_shot) up to 4096 KiB" in spy.logs[0] and "22.0 us" in spy.logs[0]


@pytest.mark.parametrize("where", ["local", "peer_local", "create", "peer_create", "verify", "peer_verify"])
def test_any_rank_failing_sends_every_rank_to_nccl(monkeypatch, where):
    peer = {"peer_local": [None, "cuda:1 has no peer access to cuda:0"],
            "peer_create": [None, None, "symmetric memory setup failed: boom"],
            "peer_verify": [None, None, None, "one_shot: ramp bfloat16[5120]: 1 of 5120 elements wrong"]}
    spy = SetupSpy(monkeypatch, local="cuda:0 has no peer access to cuda:1" if where == "local" else None,
                   create_error="cuMemCreate failed" if where == "create" else None,
                   verify="one_shot: blocks float32[2, 5120]: 3 elements wrong" if where == "verify" else None)
    g = FakeGroup(peer.get(where, []))
    assert spy.setup(g) is None
    assert len(spy.logs) == 1 and spy.logs[0].startswith("all-reduce: NCCL for every message; peer-memory path off")
    assert ("rank 1: " if where.startswith("peer") else "rank 0: ") in spy.logs[0]
    assert g.nccl_native                        # NCCL's own check passed: native bf16 stays


@pytest.mark.parametrize("mode", ["nccl", "bogus"])
def test_setup_mode_override(monkeypatch, mode):
    spy = SetupSpy(monkeypatch)
    assert spy.setup(FakeGroup(), mode=mode) is None and not spy.created
    assert "NCCL for every message" in spy.logs[0] and mode in spy.logs[0]


def test_setup_reads_the_environment(monkeypatch):
    spy = SetupSpy(monkeypatch)
    monkeypatch.setenv(ar.ENV_MODE, "nccl")
    assert ar.setup(FakeGroup(), log=spy.logs.append) is None and "NINFER_ALLREDUCE=nccl" in spy.logs[0]


def test_failed_native_nccl_check_widens_nccl_partials(monkeypatch):
    spy = SetupSpy(monkeypatch)
    g = FakeGroup(["round bfloat16[5120]: 7 of 5120 elements wrong"])     # the first gather: NCCL native
    assert spy.setup(g) is not None and not g.nccl_native
    assert "NCCL gets fp32 partials" in spy.logs[0] and "rank 1" in spy.logs[0]


def test_a_hung_check_is_fatal_not_a_fallback(monkeypatch):
    def hang(p, g):
        raise ar.AllReduceHang("the peer-memory all-reduce check did not finish within 60 s")
    spy = SetupSpy(monkeypatch, verify=hang)
    with pytest.raises(ar.AllReduceHang, match="did not finish"):
        spy.setup(FakeGroup())


def test_an_exception_in_a_check_becomes_an_agreed_error(monkeypatch):
    def broken(p, g):
        raise RuntimeError("one_shot_all_reduce: input ptr + offset must be at least 16-byte aligned.\ntrace")
    spy = SetupSpy(monkeypatch, verify=broken)
    assert spy.setup(FakeGroup()) is None
    assert "RuntimeError: one_shot_all_reduce: input ptr" in spy.logs[0] and "trace" not in spy.logs[0]


def test_local_problem_names_the_reason(monkeypatch):
    g = FakeGroup()
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    assert "NCCL_NVLS_ENABLE" in ar.local_problem(g)
    for k, v in ar.NO_MULTICAST.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert ar.local_problem(g) == "1 GPUs visible for 2 ranks"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    assert ar.local_problem(g) == "cuda:0 has no peer access to cuda:1"
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    assert ar.local_problem(g) is None
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "gloo")
    assert "not NCCL" in ar.local_problem(g)
