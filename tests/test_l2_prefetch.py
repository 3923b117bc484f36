"""NINFER_GEMV_PREFETCH (kernels/l2_prefetch.py): who gets the L2 prefetch constexpr, and the switch's errors.

Where the prefetch lands in the compiled kernel (before the PDL wait, on sm_90 only) is test_kernels_compile's; the
GPU tests of the GEMV paths run with the switch on in bench/gpu_run.sh (PYTEST_ENV).
"""
import pytest
import torch

from ninfer_kernels import gemv_nvfp4_h2, gemv_nvfp4_mma, gemv_q6_k_h2, l2_prefetch
from ninfer_kernels.ops_common import KernelInputError


def test_off_by_default_and_off_the_gpu(monkeypatch):
    monkeypatch.delenv(l2_prefetch.PREFETCH_ENV, raising=False)
    assert l2_prefetch.chunks_env() == 0
    monkeypatch.setenv(l2_prefetch.PREFETCH_ENV, "2")
    assert l2_prefetch.chunks_env() == 2
    assert l2_prefetch.chunks_for(torch.device("cpu")) == 0
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert l2_prefetch.chunks_for(torch.device("cuda", 0)) == 0     # the interpreter cannot run the PTX


def test_sm90_only(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv(l2_prefetch.PREFETCH_ENV, "4")
    monkeypatch.setattr(l2_prefetch, "_capability", lambda index: (9, 0))
    assert l2_prefetch.chunks_for(torch.device("cuda", 0)) == 4
    monkeypatch.setattr(l2_prefetch, "_capability", lambda index: (7, 0))     # V100: no bulk prefetch
    assert l2_prefetch.chunks_for(torch.device("cuda", 0)) == 0


@pytest.mark.parametrize("value", ["-1", "x", "2.5", str(l2_prefetch.MAX_CHUNKS + 1)])
def test_bad_values_name_the_variable(monkeypatch, value):
    monkeypatch.setenv(l2_prefetch.PREFETCH_ENV, value)
    with pytest.raises(KernelInputError, match=f"NINFER_GEMV_PREFETCH={value!r}: expected"):
        l2_prefetch.chunks_env()


@pytest.mark.parametrize("mod", [gemv_nvfp4_h2, gemv_nvfp4_mma], ids=["h2", "mma"])
def test_nvfp4_launchers_carry_the_constexpr(monkeypatch, mod):
    """The NVFP4 packed-half2 (T = 1) and warp-MMA (verify) GEMVs get PF (0 by default) among their launch
    constexprs, which the plans' direct launch lists; the Q6_K one has no prefetch and no PF."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(l2_prefetch, "_capability", lambda index: (9, 0))
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr("ninfer_kernels.gemv_h2_common.h2_mode", lambda device: 3)
    monkeypatch.delenv(l2_prefetch.PREFETCH_ENV, raising=False)
    make = mod.h2_kernel if mod is gemv_nvfp4_h2 else mod.mma_kernel
    assert make(cuda).extra_consts == {"H2_MODE": 3, "PF": 0}
    monkeypatch.setenv(l2_prefetch.PREFETCH_ENV, "2")
    assert make(cuda).extra_consts == {"H2_MODE": 3, "PF": 2}
    assert "PF" not in gemv_q6_k_h2.h2_kernel(cuda).extra_consts
