"""Prepared activations (kernels/x16.py) and the NVFP4 f16 GEMV variants that read them (XPRE).

The prep kernel is bit-exact against its torch reference (the same fp32 math and f16 roundings) and stands for x
within half an f16 ulp of each 128-activation chunk's largest value, zero, huge and tiny chunks included. The
packed-half2 (T <= 8) and warp-MMA (T <= 16) NVFP4 GEMVs on prepared activations match the codec reference
like their plain forms (interpreter on CPU; the PTX paths on a GPU).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gemv_inputs import extreme_x, nvfp4_weights, rel_l2, wide_range_x  # noqa: E402
from ninfer_kernels import reference  # noqa: E402
from ninfer_kernels import gemv_launch as gl  # noqa: E402
from ninfer_kernels.gemv_launch import GemvConfig, KernelInputError, interpreting  # noqa: E402
from ninfer_kernels.gemv_nvfp4 import gemv_nvfp4_prepared, repack_nvfp4  # noqa: E402
from ninfer_kernels.x16 import CHUNK, H2_FORMATS, words_per_row, x16_decode, x16_prep, x16_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
GPU_MMA = DEV != "cuda" or torch.cuda.get_device_capability() >= (8, 0)
RTOL_F32 = 2e-3      # fp32 output: activations rounded to f16 (2**-11 relative), f16 block sums (h2)
RTOL_HALF = 1e-2     # bf16/f16 output rounding dominates
HALF_ULP = 2.0 ** -11


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("T,K,cpp", [(1, 128, 4), (3, 640, 2), (2, 1024, 3)], ids=["one-chunk", "odd-T", "ragged-grid"])
def test_prep_matches_reference_and_stands_for_x(dtype, T, K, cpp):
    x = wide_range_x(T, K, seed=K)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    x = x.to(dtype).to(DEV)
    out = torch.full((T, words_per_row(K)), -1, dtype=torch.int32, device=DEV)    # poisoned
    p = x16_prep(x, out, chunks_per_program=cpp)
    assert torch.equal(p.cpu(), x16_ref(x.cpu()))
    err = (x16_decode(p.cpu(), K) - x.float().cpu()).abs()
    amax = x.float().cpu().abs().reshape(T, K // CHUNK, CHUNK).amax(-1).repeat_interleave(CHUNK, 1)
    assert bool((err <= HALF_ULP * amax).all())


def test_prep_extreme_chunks():
    """All-zero, near-fp32-top, fp32-subnormal and beyond-f16 chunks: finite, and back * x' is x to f16 precision."""
    x = extreme_x(512, CHUNK, DEV)
    p = x16_prep(x)
    assert torch.equal(p.cpu(), x16_ref(x.cpu()))
    d = x16_decode(p.cpu(), 512)
    assert torch.isfinite(d).all() and bool((d[0, :CHUNK] == 0).all())
    amax = x.cpu().abs().reshape(2, 4, CHUNK).amax(-1).repeat_interleave(CHUNK, 1)
    assert bool(((d - x.cpu()).abs() <= HALF_ULP * amax).all())


@pytest.mark.parametrize("K", [128, 3072, 5120, 6144, 8704, 17408])
def test_prepared_buffers_have_16_word_row_strides(K):
    """Every allocator of prepared rows spaces them a multiple of 16 words apart: Triton specializes a stride
    divisible by 16, the compile checks assume it (`compile_check._DIVISIBLE`), and without it the warp-MMA tiles'
    activation loads lose their vector width (114 instead of 72 registers, bench/NOTES.md §22)."""
    from ninfer_kernels.gemv_glu import swiglu_out
    from ninfer_rt.backends.prepared import PreparedMemo
    bufs = [x16_prep(torch.zeros(3, K, device=DEV)) if K <= 640 else None, PreparedMemo.buffer(3, K, DEV),
            swiglu_out(3, K, torch.bfloat16, DEV, True).xp]
    for b in [b for b in bufs if b is not None]:
        assert tuple(b.shape) == (3, words_per_row(K)) and b.stride(1) == 1
        assert b.stride(0) % 16 == 0 and b.stride(0) - words_per_row(K) < 16 and b.data_ptr() % 64 == 0


def test_bad_align_switch_is_a_one_line_error(monkeypatch):
    from ninfer_formats.errors import LoadError
    from ninfer_rt.backends.triton_ops import TritonOps
    monkeypatch.setenv("NINFER_X16_ALIGN", "8")
    with pytest.raises(LoadError, match="NINFER_X16_ALIGN='8': expected 16"):
        TritonOps()


def test_prep_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 128"):
        x16_prep(torch.zeros(2, 200, device=DEV))


CASES = {  # T, dtype, N, K, config (h2: block_n, block_g, num_warps, stages, split; mma likewise), residual
    "h2-T1-f32": (1, torch.float32, 37, 384, GemvConfig(32, 16, 2, 1, split=1, h2=True), False),
    "h2-T1-bf16-split2-res": (1, torch.bfloat16, 29, 640, GemvConfig(64, 8, 2, 1, split=2, h2=True), True),
    "h2-T3-f16-ragged-g": (3, torch.float16, 21, 384, GemvConfig(32, 16, 2, 1, split=1, h2=True), False),
    "mma-T1-bf16": (1, torch.bfloat16, 37, 256, GemvConfig(32, 8, 2, 1, split=1, mma=True), False),
    "mma-T5-f32-split3-prefetch-res": (5, torch.float32, 37, 384, GemvConfig(64, 8, 2, 2, split=3, mma=True), True),
    "mma-T11-bf16-g16": (11, torch.bfloat16, 33, 512, GemvConfig(32, 16, 2, 1, split=1, mma=True), False),
    "mma-T6-bf16-triple-buffer-res": (6, torch.bfloat16, 37, 1024, GemvConfig(64, 8, 2, 3, split=2, mma=True), True),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.skipif(
    CASES[c][4].mma and not GPU_MMA, reason="the warp-MMA variant needs sm_80+")) for c in CASES])
def test_prepared_gemv_matches_reference(case):
    T, dtype, N, K, cfg, has_res = CASES[case]
    codes, scales, gs = nvfp4_weights(N, K, T + K, DEV)
    x = wide_range_x(T, K, seed=T)
    x = (x.clamp(-6e4, 6e4) if dtype == torch.float16 else x).to(dtype).to(DEV)
    res = torch.randn(T, N).to(dtype).to(DEV) if has_res else None
    out = torch.full((T, N), float("nan"), dtype=dtype, device=DEV)
    y = gemv_nvfp4_prepared(x16_prep(x), repack_nvfp4(codes, scales), gs, out, res, config=cfg)
    assert y is out and torch.isfinite(y).all()
    ref = reference.ref_nvfp4(x, codes, scales, gs, residual=res)
    assert rel_l2(y, ref) < (RTOL_F32 if dtype == torch.float32 else RTOL_HALF)


def test_prepared_gemv_input_errors():
    codes, scales, gs = nvfp4_weights(32, 256, 0, DEV)
    xp = x16_prep(torch.randn(1, 256, device=DEV))
    out = torch.empty(1, 32, device=DEV)
    with pytest.raises(KernelInputError, match="prepared"):
        gemv_nvfp4_prepared(xp[:, :-1], repack_nvfp4(codes, scales), gs, out, config=GemvConfig(32, 16, 2, h2=True))
    with pytest.raises(KernelInputError, match="h2 config"):
        gemv_nvfp4_prepared(xp, repack_nvfp4(codes, scales), gs, out, config=GemvConfig(32, 16, 2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU check of the script; on a GPU the benchmark itself runs "
                    "(and the device image's older Triton interpreter cannot run the f16 kernels)")
def test_bench_xpre_smoke(tmp_path):
    """bench/xpre.py end to end on the interpreter (one tiny shape, T=1): records with the named fields."""
    from bench_smoke import bench_smoke
    (rec,), stdout = bench_smoke("xpre.py", tmp_path, "--T", "1")
    for k in ("format", "shape", "T", "config", "us", "us_xpre", "us_xpre_best", "us_prep", "pct_copy_bw",
              "pct_copy_bw_xpre", "copy_tbps", "gpu"):
        assert k in rec, k
    assert rec["T"] == 1 and rec["us_xpre_best"] <= rec["us_xpre"] and "tiny" in stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU check of the script; on a GPU ncu drives it")
def test_bench_ncu_gemv_smoke():
    """bench/ncu_gemv.py (the Nsight Compute driver) on the interpreter: the shipped-config launches run and the
    output is finite."""
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "bench" / "ncu_gemv.py"
    p = subprocess.run([sys.executable, str(script), "--smoke", "--calls", "2"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "tiny [96, 256] T=1" in p.stdout and "2 calls, out finite True" in p.stdout


@pytest.mark.parametrize("fmt,kind", [("nvfp4", "h2"), ("nvfp4", "mma"), ("q6_k", "h2"), ("q6_k", "mma"),
                                      ("iq3_s", "h2"), ("iq3_s", "mma"), ("iq3_s4", "h2"), ("iq3_s4", "mma")])
def test_launch_passes_every_constexpr_of_the_variant(monkeypatch, fmt, kind):
    """GemvPlan's direct launch (kernels/gemv_plan.py) needs the launcher's constexprs to be exactly the kernel's
    constexpr parameters; a defaulted one (XPRE) left out would silently disable it."""
    import importlib

    from ninfer_kernels.gemv_plan import _FIXED
    base = getattr(importlib.import_module(f"ninfer_kernels.gemv_{fmt}"), f"{fmt}_gemv_kernel")
    real = gl.variant(base, kind, torch.device(DEV))
    seen = {}

    class Stub:
        __name__, jit = real.__name__, real.jit
        per_thread, extra_consts = real.per_thread, real.extra_consts

        def __getitem__(self, grid):
            return lambda *a, **kw: seen.update(kw)
    monkeypatch.setattr(gl, "variant", lambda k, kd, dev: Stub())
    names = list(Stub.jit.arg_names)
    n_w = names.index("out_ptr") - 1                     # the weight arguments sit between x_ptr and out_ptr
    cfg = GemvConfig(32, 16, 2, 1, h2=True) if kind == "h2" else GemvConfig(32, 8, 2, 1, mma=True)
    x, out = torch.zeros(2, 256, device=DEV), torch.zeros(2, 32, device=DEV)
    gl._launch(base, (x,) * n_w, x, 32, 16, 1.0, out, None, cfg)
    consts = names[len(_FIXED) + n_w:]
    assert names[names.index("stride_rt") + 1:] == consts
    # the variants that read prepared x: every warp-MMA one, and the h2 ones that x16.prepared_ok routes there
    assert ("XPRE" in consts) == (fmt in H2_FORMATS or kind == "mma")
    # launch options, not parameters (launch_pdl: on sm_90, ninfer_kernels.pdl)
    given = {k for k in seen if k not in ("num_warps", "num_stages", "launch_pdl")} | set(Stub.extra_consts)
    assert set(consts) == given and len(consts) == len(given)


@pytest.mark.parametrize("fmt,T", [("nvfp4", 1), ("nvfp4", 3), ("nvfp4", 11), ("q6_k", 1), ("q6_k", 4),
                                   ("iq3_s", 1), ("iq3_s", 3), ("iq3_s", 11)],
                         ids=["nvfp4-T1-h2", "nvfp4-T3-h2", "nvfp4-T11-mma", "q6_k-T1", "q6_k-T4",
                              "iq3_s-T1-h2", "iq3_s-T3-h2", "iq3_s-T11-mma"])
def test_linear_on_prepared_activations(fmt, T):
    """dispatch.linear(x, qw, xp=x16_prep(x)) against the codec reference, with a residual; what it refuses."""
    import numpy as np

    from ninfer_formats import codecs
    from ninfer_kernels import dispatch
    from ninfer_kernels.x16 import prepared_ok
    from ninfer_rt.weights import QWeight
    N, K = 37, 256
    w = np.random.default_rng(T).standard_normal((N, K)).astype(np.float32) * 0.05
    if fmt == "nvfp4":
        c, s, g = codecs.nvfp4.quantize(w)
        data = {"codes": torch.from_numpy(c).to(DEV), "scales": torch.from_numpy(s).to(DEV), "gscale": float(g)}
    else:
        data = {"blocks": torch.from_numpy(codecs.quantize(fmt, w)).to(DEV)}
    qw = QWeight(fmt, (N, K), data, name=f"test.{fmt}")
    x = wide_range_x(T, K, seed=T).to(DEV)
    res = torch.randn(T, N).to(DEV)
    assert prepared_ok(qw, T, x.device)
    xp = x16_prep(x)
    y = dispatch.linear(x, qw, residual=res, xp=xp)
    assert rel_l2(y, reference.ref_linear(x, fmt, qw, residual=res)) < RTOL_F32
    # the second call takes the plan the first one left (kernels/gemv_plan.py): the same numbers
    assert ("xpre", T, x.dtype, True) in qw.cache["triton.plans"]
    assert torch.equal(dispatch.linear(x, qw, residual=res, xp=xp), y)
    y0 = dispatch.linear(x, qw, xp=xp)          # without the residual: its own plan
    assert rel_l2(y0 + res, y) < 1e-6 and ("xpre", T, x.dtype, False) in qw.cache["triton.plans"]
    with pytest.raises(KernelInputError, match="prepared activations"):
        dispatch.linear(x, qw, xp=x16_prep(torch.cat([x, x])))             # rows do not match
    assert not prepared_ok(qw, 17, x.device) and (fmt in H2_FORMATS or not prepared_ok(qw, 1, x.device))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the interpreter takes minutes over a model; "
                    "tests/test_kernels_x16_producers.py covers the hand-over on CPU)")
def test_model_with_prepared_activations_gpu(tmp_path, monkeypatch):
    """The bf16 tiny nvfp4 artifact (bench/synth_artifact.py) on TritonOps with and without the producers'
    prepared copy: the same logits up to bf16 rounding for a decode step (h2), a 4-token verify (MMA) and a batch
    of 3, and the prepared path is what the linear layers took."""
    import sys
    from pathlib import Path
    sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))
    import synth_artifact as synth

    from ninfer_rt.backends.triton_ops import TritonOps
    from ninfer_rt.loader import load
    from ninfer_rt.model import Model, SeqInput
    from ninfer_rt.state import CacheConfig
    monkeypatch.setenv("NINFER_GEMV_TUNE", "0")      # the heuristic's tiles: timing every tiny shape takes minutes
    paths, _ = synth.build(str(tmp_path), synth.TINY, "nvfp4", workers=1)
    dtype = torch.bfloat16
    lm = load(paths[0], device="cuda", dtype=dtype)
    cache = CacheConfig(num_pages=64, page_size=16, max_seqs=4)
    models = [Model(lm.config, lm.weights, TritonOps(xpre=x), cache=cache, dtype=dtype) for x in (False, True)]
    from ninfer_rt.backends import triton_ops
    prepared, real = [], triton_ops._LINEAR
    monkeypatch.setattr(triton_ops, "_LINEAR",
                        lambda x, w, xp=None: prepared.append(xp is not None) or real(x, w, xp=xp))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1000, (n,), generator=g) for n in (9, 17, 5)]
    states = [[m.new_state() for _ in prompts] for m in models]
    for m, st in zip(models, states):
        m.forward([SeqInput(p, s) for p, s in zip(prompts, st)])
    steps = [lambda st: [SeqInput(torch.tensor([7]), st[0])],
             lambda st: [SeqInput(torch.tensor([7, 8, 9, 10]), st[1])],
             lambda st: [SeqInput(torch.tensor([11]), s) for s in st]]
    for make in steps:
        prepared.clear()
        a, b = (m.forward(make(st)).logits for m, st in zip(models, states))
        assert rel_l2(b, a) < 2e-2
        n = len(prepared) // 2     # the first model's calls, then the second's: qkv / in_proj, out / o, gate_up, down
        assert not any(prepared[:n]) and sum(prepared[n:]) >= 3 * lm.config.num_hidden_layers, prepared


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU check of the script; on a GPU the benchmark itself runs")
def test_bench_kernels_xpre_smoke(tmp_path):
    """bench/kernels.py --xpre on the interpreter: "<fmt>+xpre" records beside the plain ones (of the --shapes
    named only), with the named fields, and the shipped-defaults builder takes both formats."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from ninfer_kernels import gemv_tune_cache as tc
    out = tmp_path / "kernels.json"
    script = Path(__file__).resolve().parents[1] / "bench" / "kernels.py"
    p = subprocess.run([sys.executable, str(script), "--smoke", "--formats", "nvfp4", "--T", "1", "2", "--xpre",
                        "--tp", "1", "--shapes", "attn_o", "gdn_out", "--no-precompile", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    recs = json.loads(out.read_text())
    assert {(r["format"], r["T"]) for r in recs} == {("nvfp4", 1), ("nvfp4", 2), ("nvfp4+xpre", 1), ("nvfp4+xpre", 2)}
    assert {r["name"] for r in recs} == {"attn_o", "gdn_out"}      # --shapes
    for r in recs:
        for k in ("format", "shape", "T", "us", "gbps", "pct_copy_bw", "torch_bf16_us", "gpu"):
            assert k in r, k
    fake = [{**r, "config": "GemvConfig(block_n=32, block_g=16, num_warps=2, num_stages=1, split=1, h2=True)"}
            for r in recs]
    built = tc.build_shipped(fake, "kernels.json")
    assert {e["fmt"] for e in next(iter(built["gpus"].values()))} == {"nvfp4", "nvfp4+xpre"}


@pytest.mark.parametrize("broken", [False, True], ids=["agrees", "disagrees"])
def test_prepared_variant_is_checked_against_the_fp32_kernel(monkeypatch, capsys, broken):
    """The first prepared plan of a format and variant is compared with the fp32 kernel on the activations the
    prepared rows stand for (on CUDA; forced here). A variant that disagrees (simulated: its launches add 1) turns
    prepared input off for that format: this call and later ones, other weights too, come from plain x."""
    import numpy as np

    from ninfer_formats import codecs
    from ninfer_kernels import dispatch, x16, x16_check
    from ninfer_rt.weights import QWeight
    monkeypatch.setattr(x16_check, "_CHECKED", {})
    monkeypatch.setattr(x16_check, "checkable", lambda device: True)
    if broken:
        real = x16.launch_prepared

        def launch_wrong(*a, **k):
            return real(*a, **k).add_(1.0)
        monkeypatch.setattr(x16, "launch_prepared", launch_wrong)
    N, K, T = 37, 256, 1

    def weight(seed):
        w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05
        return QWeight("iq3_s", (N, K), {"blocks": torch.from_numpy(codecs.quantize("iq3_s", w)).to(DEV)},
                       name=f"test.{seed}")
    qw, other = weight(0), weight(1)
    x = torch.randn(T, K).to(DEV)
    y = dispatch.linear(x, qw, xp=x16_prep(x))
    assert rel_l2(y, reference.ref_linear(x, "iq3_s", qw)) < RTOL_F32
    (key, ok), = x16_check._CHECKED.items()          # the variant the tuner took (on a GPU h2 or warp-MMA)
    assert key[0] == "iq3_s" and key[2] == x.device and ok == (not broken)
    assert x16_check.disagreed("iq3_s") == broken and not x16_check.disagreed("nvfp4")
    assert ("disagrees with the fp32 kernel" in capsys.readouterr().err) == broken
    assert x16.prefer_prepared(other, T, x.dtype, False, x.device) == (not broken)
    assert (("xpre", T, x.dtype, False) in qw.cache["triton.plans"]) == (not broken)
