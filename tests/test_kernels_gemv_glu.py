"""The SwiGLU epilogue of the fused gate/up GEMV (kernels/gemv_glu.py) against the unfused pair it replaces.

The fused launch must give exactly what the same GEMV config followed by `silu_mul` gives: the gate/up rows, y, and
y's prepared rows, bit for bit (same math and roundings), for every GEMV body (generic, packed-half2, warp-MMA),
with split-K, several T tiles, row blocks smaller and larger than a 128-column chunk; outputs NaN-poisoned; the
chunk counters left at zero (graph-safe). Then the dispatch entry point (plans, prepared input) and the backend op
with its switch and fallbacks. Interpreter on CPU; the compiled kernels on a GPU.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gemv_inputs import run_kernel  # noqa: E402
from ninfer_formats.errors import LoadError  # noqa: E402
from ninfer_kernels import dispatch, randweights, silu_mul  # noqa: E402
from ninfer_kernels import gemv_launch as gl  # noqa: E402
from ninfer_kernels.gemv_glu import SwiGLUOut, fits, swiglu_out  # noqa: E402
from ninfer_kernels.gemv_launch import GemvConfig, KernelInputError, interpreting  # noqa: E402
from ninfer_kernels.x16 import words_per_row, x16_prep  # noqa: E402
from ninfer_rt.weights import QWeight  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
MMA_OK = DEV == "cpu" or torch.cuda.get_device_capability() >= (8, 0)
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

CASES = {  # fmt, T, activation dtype, I, K, config, prepared copy of y
    "nvfp4-T1-f32-n32": ("nvfp4", 1, F32, 128, 256, GemvConfig(32, 16, 2, 1, split=1), True),
    "nvfp4-T3-bf16-n64-split2": ("nvfp4", 3, BF16, 256, 512, GemvConfig(64, 16, 2, 1, split=2), True),
    "nvfp4-h2-T2-n256-two-chunks": ("nvfp4", 2, BF16, 256, 256, GemvConfig(256, 16, 4, 1, split=1, h2=True), True),
    "q6_k-mma-T9-two-t-tiles-split2": ("q6_k", 9, BF16, 128, 512, GemvConfig(64, 8, 2, 1, split=2, mma=True), True),
    "iq3_s-h2-T1-f16": ("iq3_s", 1, F16, 128, 512, GemvConfig(64, 16, 4, 1, split=1, h2=True), False),
    "f8-T4-n128": ("f8_e4m3_row", 4, F32, 128, 64, GemvConfig(128, 8, 4, 1, split=1), False),
    "bf16-T2-n32-split3": ("bf16", 2, BF16, 128, 96, GemvConfig(32, 8, 2, 1, split=3), True),
}


def weight(fmt: str, N: int, K: int, seed: int = 3) -> QWeight:
    data = randweights.make(fmt, N, K, seed=seed)
    return QWeight(fmt, (N, K), {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in data.items()},
                   name="mlp.gate_up")


def unfused(gate_up, prepared: bool):
    """silu_mul's y and (when asked) its prepared rows: what the epilogue replaces."""
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    xp = torch.full((T, words_per_row(I)), -1, dtype=torch.int32, device=gate_up.device) if prepared else None
    return silu_mul.silu_mul(gate_up, xp=xp), xp


def poisoned_out(T: int, I: int, dtype, prepared: bool) -> SwiGLUOut:
    glu = swiglu_out(T, I, dtype, DEV, prepared)
    glu.y.fill_(float("nan"))
    if glu.xp is not None:
        glu.xp.fill_(-1)
    return glu


def counters_zero() -> bool:
    return all(int(cnt.abs().sum()) == 0 for _, cnt in gl._WS.values())


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.skipif(
    CASES[c][5].mma and not MMA_OK, reason="the warp-MMA variant needs sm_80+")) for c in CASES])
def test_swiglu_epilogue_is_the_unfused_pair(case):
    fmt, T, dtype, I, K, cfg, prepared = CASES[case]
    qw = weight(fmt, 2 * I, K)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(T)).to(dtype).to(DEV)
    want_gu = run_kernel(qw, x, None, None, cfg)
    want_y, want_xp = unfused(want_gu, prepared)
    glu = poisoned_out(T, I, dtype, prepared)
    gu = run_kernel(qw, x, None, glu, cfg)
    assert torch.equal(gu, want_gu)
    assert torch.equal(glu.y, want_y), "y differs from silu_mul of the same GEMV (or was left unwritten)"
    if prepared:
        assert torch.equal(glu.xp, want_xp)
    assert counters_zero(), "a chunk counter was left non-zero: the next launch (or graph replay) would misfire"


def test_fits_and_bad_outputs_are_one_line_errors():
    assert fits(64, 512) and fits(128, 512) and fits(256, 512) and not fits(512, 768) and not fits(64, 200)
    qw = weight("nvfp4", 256, 256)
    x = torch.randn(1, 256).to(DEV)
    with pytest.raises(KernelInputError, match="block_n=512 does not serve N=256"):
        run_kernel(qw, x, None, swiglu_out(1, 128, torch.float32, DEV, False), GemvConfig(512, 16, 4, 1, split=1))
    with pytest.raises(KernelInputError, match=r"y must be a contiguous \[1, 128\]"):
        run_kernel(qw, x, None, swiglu_out(2, 128, torch.float32, DEV, False), GemvConfig(64, 16, 2, 1, split=1))
    # the prepared rows start 4 bytes into another allocation: never right behind y (a caching allocator may
    # place two fresh allocations back to back)
    words = torch.empty(words_per_row(128) + 1, dtype=torch.int32, device=DEV)[1:].view(1, -1)
    apart = SwiGLUOut(torch.empty(1, 128, device=DEV), words)
    with pytest.raises(KernelInputError, match="directly follow y's rows"):
        run_kernel(qw, x, None, apart, GemvConfig(64, 16, 2, 1, split=1))
    # right behind y but packed (K/2 + K/128 words apart): the kernel writes rows row_stride(I) words apart
    buf = torch.empty(128 + words_per_row(128), dtype=torch.float32, device=DEV)
    packed = SwiGLUOut(buf[:128].view(1, 128), buf[128:].view(torch.int32).view(1, -1))
    with pytest.raises(KernelInputError, match="row_stride"):
        run_kernel(qw, x, None, packed, GemvConfig(64, 16, 2, 1, split=1))
    odd = weight("nvfp4", 2 * 96, 256)
    with pytest.raises(KernelInputError, match="2 \\* a multiple of 128"):
        run_kernel(odd, x, None, swiglu_out(1, 96, torch.float32, DEV, False), GemvConfig(64, 16, 2, 1, split=1))


@pytest.mark.parametrize("xp_in", [False, True], ids=["bf16-in", "prepared-in"])
def test_dispatch_linear_swiglu_twice(xp_in):
    """dispatch.linear_swiglu (the tuner's config, then the weight's stored plan) gives linear + silu_mul; with the
    input's prepared rows it takes the prepared-activation launch."""
    I, K = 128, 256
    qw = weight("nvfp4", 2 * I, K, seed=5)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(1)).to(BF16).to(DEV)
    xp = x16_prep(x) if xp_in else None
    want_y, want_xp = unfused(dispatch.linear(x, qw, xp=xp), True)
    for _ in range(2):
        glu = dispatch.linear_swiglu(x, qw, xp=xp, prepared=True)
        assert torch.equal(glu.y, want_y) and torch.equal(glu.xp, want_xp)
    assert counters_zero()
    with pytest.raises(KernelInputError, match="do not take the SwiGLU epilogue"):
        dispatch.linear_swiglu(torch.zeros(17, K, dtype=BF16, device=DEV), qw)


def test_backend_op_switch_and_fallbacks(monkeypatch):
    """TritonOps.linear_swiglu: linear + silu_mul with NINFER_SWIGLU_EPILOGUE=0, the epilogue with 1 where the
    GEMV can take it (not for I off a multiple of 128, nor prefill rows); the same y every way; a bad switch
    value is a one-line error at backend start."""
    from ninfer_rt.backends.torch_ops import TorchOps
    from ninfer_rt.backends.triton_ops import TritonOps
    monkeypatch.delenv("NINFER_SWIGLU_EPILOGUE", raising=False)
    assert TritonOps().swiglu_epilogue == "auto"
    monkeypatch.setenv("NINFER_SWIGLU_EPILOGUE", "0")
    plain = TritonOps()
    monkeypatch.setenv("NINFER_SWIGLU_EPILOGUE", "1")
    fused = TritonOps()
    assert (fused.swiglu_epilogue, plain.swiglu_epilogue) == ("1", "0")
    calls = []
    real = dispatch.linear_swiglu
    monkeypatch.setattr(dispatch, "linear_swiglu", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    for I, T in ((128, 2), (96, 2), (128, 17)):
        qw = weight("q6_k", 2 * I, 256, seed=I)
        x = torch.randn(T, 256, generator=torch.Generator().manual_seed(I)).to(DEV)
        got, want = fused.linear_swiglu(x, qw), plain.linear_swiglu(x, qw)
        assert got.shape == (T, I) and torch.equal(got, want)
        ref = TorchOps().linear_swiglu(x.cpu(), QWeight("q6_k", qw.shape, {"blocks": qw.blocks().cpu()}))
        assert float((got.cpu() - ref).norm() / ref.norm()) < 1e-4
    assert calls == [(256, 256)], "only the fusable call (I = 128, T = 2) takes the epilogue, and only when on"
    monkeypatch.setenv("NINFER_SWIGLU_EPILOGUE", "yes")
    with pytest.raises(LoadError, match="NINFER_SWIGLU_EPILOGUE='yes'"):
        TritonOps()
    monkeypatch.setenv("NINFER_SWIGLU_EPILOGUE", "0")
    assert TritonOps().swiglu_epilogue == "0"


def test_epilogue_default_follows_pdl(monkeypatch):
    """NINFER_SWIGLU_EPILOGUE=auto: on for CUDA devices whose launches do not use PDL (it won there, lost with PDL:
    bench/NOTES.md §21-§22), off on the CPU; 0 and 1 force it."""
    from ninfer_rt.backends import triton_ops
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(triton_ops, "pdl_kw", lambda device: {"PDL": 1, "launch_pdl": True})
    assert not triton_ops.swiglu_epilogue_on("auto", cuda) and triton_ops.swiglu_epilogue_on("1", cuda)
    monkeypatch.setattr(triton_ops, "pdl_kw", lambda device: {})
    assert triton_ops.swiglu_epilogue_on("auto", cuda) and not triton_ops.swiglu_epilogue_on("0", cuda)
    assert not triton_ops.swiglu_epilogue_on("auto", torch.device("cpu"))
