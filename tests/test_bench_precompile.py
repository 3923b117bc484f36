"""bench/gemv_precompile.py (the precompile of bench/kernels.py and bench/decode_rank.py): it compiles what a run
will launch -- the remembered (shipped or cached) config of each tuner key on the path the runtime takes (bf16 or
prepared activations), with and without a residual -- and every candidate on both paths only where nothing is
remembered or tuning is forced; jobs are merged only when they would compile the same binaries."""
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ninfer_kernels import gemv_launch as gl  # noqa: E402
from ninfer_kernels import gemv_tune_cache as tc  # noqa: E402
from ninfer_kernels import x16  # noqa: E402
from ninfer_kernels.gemv_launch import GemvConfig  # noqa: E402

A, B, C = (GemvConfig(bn, 16, 4, 1, split=2, h2=True) for bn in (32, 64, 128))


sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))
import gemv_precompile as kb  # noqa: E402


@pytest.fixture
def remembered(monkeypatch):
    """tc.lookup remembers B for N = 96 and C for N = 160, nothing for other shapes; every key has A, B, C."""
    monkeypatch.delenv("NINFER_GEMV_TUNE", raising=False)
    picks = {96: B, 160: C}
    monkeypatch.setattr(tc, "make_key", lambda key, gs, dev: key)      # the tuner key: (name, N, G, T, ...)
    monkeypatch.setattr(tc, "lookup", lambda key, gs: picks.get(key[1]))
    monkeypatch.setattr(gl, "kernel_candidates", lambda *a, **k: [A, B, C])
    monkeypatch.setattr(x16, "prepared_candidates", lambda *a, **k: [A, B, C])
    return picks


def test_to_compile_takes_the_remembered_config(remembered, monkeypatch):
    dev = torch.device("cpu")
    assert kb._to_compile("nvfp4_gemv_kernel", [A, B, C], 96, 16, 16, 1, False, dev) == [B]
    assert kb._to_compile("nvfp4_gemv_kernel", [A, B, C], 64, 16, 16, 1, False, dev) == [A, B, C]   # nothing kept
    monkeypatch.setenv("NINFER_GEMV_TUNE", "force")
    assert kb._to_compile("nvfp4_gemv_kernel", [A, B, C], 96, 16, 16, 1, False, dev) == [A, B, C]


def test_inputs_cover_the_prepared_launch_with_runtime_strides(monkeypatch):
    monkeypatch.setenv("NINFER_GEMV_TUNE", "force")        # both launches (the kernels step times both)
    kern, _, gs = kb.kernel_spec("nvfp4")
    dev = torch.device("cpu")
    got = kb._precompile_inputs(kern, "nvfp4", 96, 256, 1, gs, dev, False)
    assert [name for _, _, name, _ in got] == [kern.__name__, kern.__name__ + x16.XPRE_SUFFIX]
    (x, plain, _, _), (xp, extra, _, _) = got
    assert x.dtype == torch.bfloat16 and plain is None and extra == {"XPRE": True}
    assert xp.dtype == torch.int32 and xp.stride(0) == x16.row_stride(256) and xp.stride(0) % 16 == 0
    assert [n for _, _, n, _ in kb._precompile_inputs(*kb.kernel_spec("bf16")[:1], "bf16", 96, 256, 1, 4, dev, False)] \
        == [kb.kernel_spec("bf16")[0].__name__]                        # no prepared form of bf16 weights


def test_jobs_merge_only_when_they_compile_the_same(remembered, monkeypatch):
    ran = []

    class Pool:
        def __init__(self, workers):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def imap_unordered(self, fn, jobs):
            ran.extend(jobs)
            return iter(())

    import multiprocessing
    monkeypatch.setattr(multiprocessing, "get_context", lambda kind: type("Ctx", (), {"Pool": Pool}))
    monkeypatch.setattr(kb, "DEV", "cpu")
    kb.precompile([("nvfp4", 96, 256, 1), ("nvfp4", 160, 256, 1)], workers=2)    # B against C: both compile
    assert sorted(j[1] for j in ran) == [96, 160]
    ran.clear()
    remembered[160] = B
    kb.precompile([("nvfp4", 96, 256, 1), ("nvfp4", 160, 256, 1)], workers=2)    # the same binaries: once
    assert len(ran) == 1


@pytest.mark.parametrize("xpre_on,preferred,force,fmt,T,want", [
    (True, True, False, "nvfp4", 1, (False, True)),      # the runtime's path: prepared only
    (True, False, False, "nvfp4", 4, (True, False)),     # the plain launch remembered faster
    (False, True, False, "nvfp4", 1, (True, False)),     # NINFER_XPRE off (or a GPU without it)
    (True, True, True, "nvfp4", 4, (True, True)),        # the kernels step times both
    (True, True, False, "q6_k", 1, (False, True)),       # the Q6_K h2 variant reads prepared input too
    (True, True, False, "iq3_s", 1, (False, True)),      # and the IQ3_S one
    (True, True, False, "iq3_s", 17, (True, False)),     # no prepared launch past T = 16
    (True, True, False, "bf16", 4, (True, False)),
], ids=["xpre", "plain-faster", "xpre-off", "forced", "q6k-T1", "iq3s-T1", "iq3s-T17", "bf16"])
def test_launched_mirrors_the_runtime_choice(monkeypatch, xpre_on, preferred, force, fmt, T, want):
    monkeypatch.setenv("NINFER_GEMV_TUNE", "force" if force else "1")
    monkeypatch.setattr(x16, "xpre_on", lambda mode, dev: xpre_on)
    monkeypatch.setattr(x16, "prefer_prepared", lambda qw, T, dtype, res, dev: preferred)
    assert kb._launched(fmt, 96, 256, T, False, torch.device("cpu")) == want


def test_job_compiles_only_the_launched_path(remembered, monkeypatch):
    launched = []
    monkeypatch.setattr(kb, "DEV", "cpu")
    monkeypatch.setattr(x16, "xpre_on", lambda mode, dev: True)
    monkeypatch.setattr(x16, "prefer_prepared", lambda qw, T, dtype, res, dev: not res)
    monkeypatch.setattr(gl, "_launch", lambda kern, w, x, *a, extra=None, **k: launched.append(
        (extra is not None, a[4] is not None)))
    kb._precompile_job(("nvfp4", 96, 256, 1))
    assert launched == [(True, False), (False, True)]   # prepared without the residual, bf16 with it
