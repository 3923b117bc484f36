"""The producing kernels' prepared copy (kernels/x16.py layout): rmsnorm / add_rmsnorm (alone and with the GDN
gates), silu_mul, sigmoid_mul and gated_rmsnorm write, beside their output y, exactly `x16_ref(y)` (bit for bit: the
same fp32 math on y as its dtype rounds it), including tail column blocks, strided inputs and several rows. What
they refuse."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gemv_inputs import wide_range_x  # noqa: E402
from ninfer_kernels import gated_rmsnorm, rmsnorm, rmsnorm_gates, silu_mul  # noqa: E402
from ninfer_kernels.gemv_launch import KernelInputError, interpreting  # noqa: E402
from ninfer_kernels.x16 import words_per_row, x16_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")   # sigmoid of huge inputs
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16")]


def _poisoned(T, K):
    return torch.full((T, words_per_row(K)), -1, dtype=torch.int32, device=DEV)


def _x(T, K, dtype, seed):
    return (wide_range_x(T, K, seed=seed) * 0.1).to(dtype).to(DEV)


def _check(y, xp):
    y2 = y.reshape(y.shape[0], -1)
    assert torch.equal(xp.cpu(), x16_ref(y2.cpu()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,D,res", [(1, 384, False), (3, 640, True), (5, 128, True)],
                         ids=["T1-pow2-padded", "T3-residual", "T5-one-chunk-residual"])
def test_rmsnorm_writes_prepared(dtype, T, D, res):
    x, w = _x(T, D, dtype, T), (torch.randn(D) * 0.3).to(DEV)
    xp = _poisoned(T, D)
    if res:
        r = _x(T, D, dtype, T + 1)
        y, s = rmsnorm.add_rmsnorm(x, r, w, 1e-6, True, xp=xp)
        y0, s0 = rmsnorm.add_rmsnorm(x, r, w, 1e-6, True)
        assert torch.equal(s, s0)
    else:
        y = rmsnorm.rmsnorm(x, w, 1e-6, False, xp=xp)
        y0 = rmsnorm.rmsnorm(x, w, 1e-6, False)
    assert torch.equal(y, y0)          # the prepared copy leaves the output alone
    _check(y, xp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,D,res", [(1, 384, True), (3, 640, False)], ids=["T1-residual", "T3-first-layer"])
def test_rmsnorm_gates_writes_prepared(dtype, T, D, res):
    """The norm + gates kernel's norm rows are add_rmsnorm's / rmsnorm's, bit for bit, with the prepared copy."""
    x, w = _x(T, D, dtype, T), (torch.randn(D) * 0.3).to(DEV)
    r = _x(T, D, dtype, T + 1) if res else None
    w_ba, h = (torch.randn(6, D) * 0.1).to(dtype).to(DEV), torch.zeros(3, device=DEV)
    xp = _poisoned(T, D)
    y, s, _, _ = rmsnorm_gates.add_rmsnorm_gates(x, r, w, 1e-6, w_ba, h, h, xp=xp)
    y0, s0 = rmsnorm.add_rmsnorm(x, r, w, 1e-6, True) if res else (rmsnorm.rmsnorm(x, w, 1e-6, True), None)
    assert torch.equal(y, y0) and (s is None if s0 is None else torch.equal(s, s0))
    _check(y, xp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I", [(1, 1152), (4, 256)], ids=["T1-tail-block", "T4-short"])
def test_silu_mul_writes_prepared(dtype, T, I):
    gu = _x(T, 2 * I + 64, dtype, I)[:, :2 * I]       # strided rows: a column slice
    xp = _poisoned(T, I)
    y = silu_mul.silu_mul(gu, xp=xp)
    assert torch.equal(y, silu_mul.silu_mul(gu))
    _check(y, xp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,D", [(1, 5, 256), (3, 3, 128)], ids=["T1-tail-block", "T3-heads"])
def test_sigmoid_mul_writes_prepared(dtype, T, H, D):
    o = _x(T, H * D, dtype, H).reshape(T, H, D)
    qg = _x(T, H * 2 * D, dtype, D).reshape(T, H, 2 * D)
    xp = _poisoned(T, H * D)
    y = silu_mul.sigmoid_mul(o, qg[..., D:], xp=xp)          # the gate: a strided head slice
    assert torch.equal(y, silu_mul.sigmoid_mul(o, qg[..., D:]))
    _check(y, xp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,D", [(1, 3, 128), (2, 2, 256)], ids=["T1-dv128", "T2-dv256"])
def test_gated_rmsnorm_writes_prepared(dtype, T, H, D):
    o = _x(T, H * D, dtype, T).reshape(T, H, D)
    zz = _x(T, 2 * H * D, dtype, H).reshape(T, H, 2 * D)
    w = (torch.randn(D) * 0.3 + 1).to(DEV)
    xp = _poisoned(T, H * D)
    y = gated_rmsnorm.gated_rmsnorm(o, zz[..., :D], w, 1e-6, xp=xp)
    assert torch.equal(y, gated_rmsnorm.gated_rmsnorm(o, zz[..., :D], w, 1e-6))
    _check(y, xp)


def test_producers_refuse_bad_prepared_buffers():
    x = torch.randn(2, 256, device=DEV)
    with pytest.raises(KernelInputError, match="rmsnorm: the prepared output must be int32 \\[2, "):
        rmsnorm.rmsnorm(x, torch.ones(256, device=DEV), 1e-6, True, xp=_poisoned(3, 256))
    with pytest.raises(KernelInputError, match="silu_mul: .*K=100"):
        silu_mul.silu_mul(torch.randn(2, 200, device=DEV), xp=_poisoned(2, 128))
    with pytest.raises(KernelInputError, match="sigmoid_gate: .*int32"):
        silu_mul.sigmoid_mul(x, x, xp=_poisoned(2, 256).float())
    with pytest.raises(KernelInputError, match="gated_rmsnorm: .*dv a multiple of 128"):
        o = torch.randn(2, 2, 64, device=DEV)
        gated_rmsnorm.gated_rmsnorm(o, o, torch.ones(64, device=DEV), 1e-6, xp=_poisoned(2, 128))


# ---- TritonOps: the producers' prepared copy reaches the next linear layer (ninfer_rt/backends/prepared.py) ----

def _nvfp4_qweight(N, K, seed):
    import numpy as np

    from ninfer_formats import codecs
    from ninfer_rt.weights import QWeight
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05
    c, s, g = codecs.nvfp4.quantize(w)
    data = {"codes": torch.from_numpy(c).to(DEV), "scales": torch.from_numpy(s).to(DEV), "gscale": float(g)}
    return QWeight("nvfp4", (N, K), data, name="test.nvfp4")


@pytest.fixture
def spy(monkeypatch):
    """The prepared activations each TritonOps.linear call passed on (None: it read x)."""
    from ninfer_rt.backends import triton_ops
    seen, real = [], triton_ops._LINEAR

    def linear(x, w, xp=None, **kw):
        seen.append(xp)
        return real(x, w, xp=xp, **kw)
    monkeypatch.setattr(triton_ops, "_LINEAR", linear)
    return seen


def test_triton_ops_hands_prepared_activations_to_linear(spy):
    from ninfer_rt.backends.triton_ops import TritonOps
    ops, plain = TritonOps(xpre=True), TritonOps(xpre=False)
    T, D, I = 3, 256, 384
    x, w = _x(T, D, torch.float32, 1), torch.randn(D, device=DEV) * 0.2
    up, down = _nvfp4_qweight(2 * I, D, 1), _nvfp4_qweight(D, I, 2)
    y = ops.rmsnorm(x, w, 1e-6, True)
    a = ops.linear(y, up)
    assert spy[-1] is not None and torch.equal(spy[-1].cpu(), x16_ref(y.cpu()))
    b = plain.linear(plain.rmsnorm(x, w, 1e-6, True), up)
    assert spy[-1] is None and float((a - b).norm() / b.norm()) < 2e-3     # f16 activations vs fp32 ones
    h = ops.silu_mul(a)
    ops.linear(h, down)
    assert spy[-1] is not None and torch.equal(spy[-1].cpu(), x16_ref(h.cpu()))
    o = ops.gated_rmsnorm(_x(T, 256, torch.float32, 3).reshape(T, 2, 128), _x(T, 256, torch.float32, 4).reshape(
        T, 2, 128), torch.ones(128, device=DEV), 1e-6)
    ops.linear(o.reshape(T, 256), up)
    assert spy[-1] is not None and torch.equal(spy[-1].cpu(), x16_ref(o.reshape(T, 256).cpu()))


def test_triton_ops_never_hands_a_stale_or_partial_copy(spy):
    from ninfer_rt.backends.triton_ops import TritonOps
    ops = TritonOps(xpre=True)
    x, w, qw = _x(4, 256, torch.float32, 2), torch.ones(256, device=DEV), _nvfp4_qweight(32, 256, 3)
    y = ops.rmsnorm(x, w, 1e-6, False)
    ops.linear(y[:2], qw)                       # a row slice: not what was prepared
    assert spy[-1] is None
    y.mul_(2)                                    # changed after it was prepared
    ops.linear(y, qw)
    assert spy[-1] is None
    y2 = ops.sigmoid_gate(x, x)
    y3 = ops.rmsnorm(x, w, 1e-6, False)          # a later output does not hide an earlier one
    ops.linear(y2, qw)
    assert spy[-1] is not None and torch.equal(spy[-1].cpu(), x16_ref(y2.cpu()))
    ops.linear(y3, _plain_weight(32, 256))      # a plain weight reads x
    assert spy[-1] is None
    big = ops.rmsnorm(_x(17, 256, torch.float32, 4), w, 1e-6, False)   # more rows than a prepared GEMV serves
    ops.linear(big, qw)
    assert spy[-1] is None
    off = TritonOps(xpre=False)
    off.linear(off.rmsnorm(x, w, 1e-6, False), qw)
    assert spy[-1] is None


def _plain_weight(N, K):
    from ninfer_rt.weights import QWeight
    return QWeight("f32", (N, K), {"w": torch.randn(N, K, device=DEV)}, name="test.f32")


def test_xpre_modes(monkeypatch):
    from ninfer_kernels.x16 import auto_on, xpre_env
    from ninfer_rt.backends.triton_ops import TritonOps
    monkeypatch.setenv("NINFER_XPRE", "yes")
    with pytest.raises(KernelInputError, match="NINFER_XPRE='yes': expected one of auto, 0, 1"):
        xpre_env()
    monkeypatch.delenv("NINFER_XPRE")
    assert xpre_env() == "auto" and TritonOps().xpre == "auto" and not auto_on("cpu")
    monkeypatch.setenv("NINFER_XPRE", "1")
    assert TritonOps().xpre == "1" and TritonOps(xpre=False).xpre == "0"
