"""bench/round_gaps.py: the per-round GPU spans and gaps from events around every graph step (fake events on the
CPU: each records a tick of a counter), through the real Engine with round graphs in eager mode."""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch
from hf_tiny import build_hf_model, loaded_model

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))     # last: bench/ must not shadow anything
import engine_mtp  # noqa: E402
import round_gaps  # noqa: E402

from ninfer_rt.backends.torch_ops import TorchOps  # noqa: E402
from ninfer_rt.engine import Engine  # noqa: E402
from ninfer_rt.graphs import GraphConfig, GraphRunner  # noqa: E402
from ninfer_rt.speculative import SpecConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


class FakeEvent:
    """record() takes the next tick (ms) of a shared counter; elapsed_time as torch's: other - self."""
    clock = itertools.count()

    def __init__(self, t=None, **kw):
        self.t = t

    def record(self):
        self.t = float(next(FakeEvent.clock))

    def elapsed_time(self, other) -> float:
        return other.t - self.t


def test_summarize_per_round():
    e = [FakeEvent(t) for t in (0, 5, 6, 7, 9, 10, 15, 16)]
    marks = [("round", e[0], e[1]), ("mtp", e[2], e[3]), ("round", e[4], e[5]), ("mtp", e[6], e[7])]
    got = round_gaps.summarize(marks, rounds=2)
    assert got == {"rounds": 2, "steps": 4, "busy_ms": {"mtp": 1.0, "round": 3.0},
                   "gap_ms": {"round->mtp": 3.0, "mtp->round": 1.0}, "span_ms": 8.0}
    assert round_gaps.summarize([], 0)["span_ms"] == 0.0


def test_gap_run_marks_every_graph_step(monkeypatch):
    """An Engine with round graphs (eager mode): each round is one `round` step and one `mtp` re-alignment; the
    patch is gone afterwards."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    real = GraphRunner._run
    cfg = GraphConfig(batch_sizes=(1,), tokens=(1, 2, 3), mtp_tokens=(1, 2, 3), kv_buckets=(64,), eager=True,
                      round_drafts=2)
    eng = engine_mtp.make_rigged(Engine)(loaded_model(build_hf_model(seed=3)), TorchOps(),
                                         spec=SpecConfig(num_draft_tokens=2), max_batch=1, graphs=cfg)
    eng.rate = 0.5
    got = round_gaps.gap_run(eng, engine_mtp.generate, list(range(5, 14)), 12, 1)
    assert GraphRunner._run is real
    assert {"round", "mtp"} <= set(got["busy_ms"]) and got["rounds"] >= 4
    assert {"round->mtp", "mtp->round"} <= set(got["gap_ms"]) and got["steps"] >= 2 * got["rounds"] - 1
    assert all(v > 0 for v in got["busy_ms"].values()) and got["span_ms"] > 0
