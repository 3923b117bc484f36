"""bench/kernels.py's graph runoff: the tuner's close finishers re-timed the way the records are, the fastest
shipped; what it leaves alone (far finishers, failed candidates, a single one)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench_kernels_module import load_bench_kernels  # noqa: E402
from ninfer_kernels import gemv_launch as gl  # noqa: E402
from ninfer_kernels.gemv_launch import GemvConfig  # noqa: E402


kb = load_bench_kernels("bench_kernels")


class Q:
    def __init__(self):
        self.cache = {"triton.plans": {"old": 1}, "triton.q6_k": "planes"}


@pytest.fixture
def tuned(monkeypatch):
    """A tuner log for one key: a (1.00 ms, picked), b (1.10), c (1.20), d failed, e (2.00: too far)."""
    a, b, c, d, e = (GemvConfig(bn, 8, 4, 1, split=s) for bn, s in ((128, 5), (128, 4), (64, 3), (256, 2), (32, 1)))
    key = ("k", 1, 2, 4, "torch.bfloat16", False, "cuda:0")
    monkeypatch.setitem(gl._TUNE_LOG, key, [(a, 1.0), (b, 1.1), (c, 1.2), (d, None), (e, 2.0)])
    monkeypatch.setitem(gl._TUNED, key, a)
    return key, (a, b, c, d, e)


def test_runoff_ships_the_fastest_back_to_back(monkeypatch, tuned):
    key, (a, b, c, d, e) = tuned
    graph_us = {a: 24.8, b: 20.9, c: 22.0}
    monkeypatch.setattr(kb, "graph_us", lambda fns, quick: [f() for f in fns] and graph_us[gl._TUNED[key]])
    qws, calls = [Q(), Q()], []
    out = kb.graph_runoff(key, qws, lambda q: calls.append((gl._TUNED[key], "triton.plans" in q.cache)), True, 5)
    assert out == [(a, 24.8), (b, 20.9), (c, 22.0)]                 # e is past the margin, d failed
    assert gl.tuned_configs()[key] == b
    assert all(not has_plan for _, has_plan in calls)               # each finalist ran without a stale plan
    assert all("triton.plans" not in q.cache and q.cache["triton.q6_k"] == "planes" for q in qws)
    assert kb.graph_runoff(key, qws, lambda q: None, True, 1) == [] and gl.tuned_configs()[key] == b


def test_runoff_needs_two_timed_finishers(monkeypatch):
    key = ("k2", 1, 2, 1, "torch.bfloat16", False, "cuda:0")
    monkeypatch.setitem(gl._TUNE_LOG, key, [(GemvConfig(64, 8), 1.0), (GemvConfig(32, 8), None)])
    assert kb.graph_runoff(key, [Q()], lambda q: None, True) == []
    assert kb.graph_runoff(("never tuned",), [Q()], lambda q: None, True) == []


def test_negative_runoff_is_a_one_line_error(capsys):
    assert kb.main(["--runoff", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --runoff -1") and err.count("\n") == 1


@pytest.mark.parametrize("fmt", ["nvfp4", "q6_k"])
def test_check_runs_on_released_weights(fmt, monkeypatch):
    """`--check`'s explicit packed-half2 probe reads the kernels' planes: on CUDA the stored tensors are released
    after the repack (it once read the released codes and failed every NVFP4 shape on the device)."""
    from ninfer_kernels import dispatch, randweights, reference
    from ninfer_rt.weights import QWeight
    monkeypatch.setattr(kb, "SMOKE", True)
    N, K = 24, 256
    qw = QWeight(fmt, (N, K), randweights.make(fmt, N, K, seed=1), name="w")
    dispatch.release(qw, dispatch._packed(qw))
    x, res = torch.randn(3, K), torch.randn(3, N)
    y = kb._h2_runner(fmt, qw, K)(x, res)
    ref = reference.ref_linear(x, fmt, qw, residual=res)
    assert float((y - ref).norm() / ref.norm()) < 2e-3          # f16 block sums (gemv_nvfp4_h2)


def test_xpre_records_time_the_prepared_launch(monkeypatch):
    """A "<fmt>+xpre" record times the prepared launch even where dispatch.linear would take the plain one
    (remembered faster): on the H200 run of s12 nine such records timed the plain launch under the xpre name."""
    from ninfer_kernels import dispatch, randweights, x16
    from ninfer_rt.weights import QWeight
    monkeypatch.setattr(kb, "SMOKE", True)
    monkeypatch.setattr(kb, "DEV", "cpu")
    monkeypatch.setattr(x16, "prefer_prepared", lambda *a, **k: False)
    calls = []
    real = x16.prepared_linear
    monkeypatch.setattr(x16, "prepared_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    N, K = 32, 256
    qws = [QWeight("nvfp4", (N, K), randweights.make("nvfp4", N, K, seed=i), name="w") for i in range(2)]
    for q in qws:
        dispatch.prepare(q)
    recs = kb.time_format("nvfp4", qws, randweights.packed_bytes("nvfp4", N, K), N, K, [2], True, 1.0, {},
                          xpre=True, runoff=0)
    assert [r["format"] for r in recs] == ["nvfp4+xpre"] and len(calls) >= 3


def test_merge_keeps_another_gpus_records(tmp_path):
    """--merge replaces a record only with the same measurement on the same GPU model: an H100 run of s45
    replaced the shipped H200 IQ3_S rows, and the table builder then lost the rows its pins name."""
    def rec(gpu, us, T=1):
        return {"format": "iq3_s", "name": "attn_o", "tp": 1, "shape": [5120, 6144], "T": T, "us": us, "gpu": gpu}
    out = str(tmp_path / "kernels.json")
    base = [rec("NVIDIA H200", 10.0), rec("NVIDIA H200", 12.0, T=2)]
    kb.save(out, base, [rec("NVIDIA H100 80GB HBM3", 13.4), rec("NVIDIA H200", 11.0, T=2)], [])
    got = sorted((r["gpu"], r["T"], r["us"]) for r in kb.read_base(out))
    assert got == [("NVIDIA H100 80GB HBM3", 1, 13.4), ("NVIDIA H200", 1, 10.0), ("NVIDIA H200", 2, 11.0)]
