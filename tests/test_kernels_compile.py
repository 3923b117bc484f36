"""Every GEMV kernel and dequantizer compiles for sm_70 (V100, fp16 activations) and sm_90 (H200, bf16).

Runs `python -m ninfer_kernels.compile_check` in a subprocess without TRITON_INTERPRET: kernels decorated
in interpreter mode cannot be compiled, and this test must exercise the real backend (ptxas included) even
when the rest of the suite is interpreted.
"""
import json
import os
import subprocess
import sys

import pytest

CCS = (70, 90)


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, "-m", "ninfer_kernels.compile_check", "--json", "--cc", *map(str, CCS)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.stdout.strip(), f"compile_check printed nothing (rc={r.returncode}): {r.stderr[-2000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_every_variant_compiles(compiled):
    bad = [f"{row['variant']}@sm_{row['cc']}: {row['error']}" for row in compiled if not row["ok"]]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("cc", CCS)
def test_all_kernels_and_paths_covered(compiled, cc):
    names = {row["variant"] for row in compiled if row["cc"] == cc}
    for fmt in ("nvfp4", "q6_k", "iq3_s", "iq3_s4", "f8", "plain:bf16", "plain:f16", "plain:f32"):
        mine = {n for n in names if n.startswith(fmt + "-")}
        assert any(n.endswith("-split-res") for n in mine), (fmt, cc)   # elementwise + split-K + residual
        assert any(n.endswith("-dot") for n in mine), (fmt, cc)         # tl.dot path
        assert fmt.startswith("plain") or any("-dequant-" in n for n in mine), (fmt, cc)


def test_warp_mma_values_stay_in_their_threads(compiled):
    """The warp-MMA kernel's inline PTX (mma.sync, shuffles) assumes element e of its per-thread tensors sits in
    thread e; every layout Triton chose for those operands must say so, on both targets and both Tritons."""
    from ninfer_kernels.compile_check import LANE_EXACT
    rows = [row for row in compiled if row["variant"].split("-")[0] in LANE_EXACT]
    assert {(row["variant"].split("-")[0], row["cc"]) for row in rows} == {(f, cc) for f in LANE_EXACT for cc in CCS}
    for row in (r for r in rows if r["cc"] >= 80):   # below sm_80 the warp steps are Triton ops (no lane math)
        assert row["lane_layouts_bad"] == [], f"{row['variant']}@sm_{row['cc']}: {row['lane_layouts_bad']}"


def test_gemvs_follow_the_pdl_protocol(compiled):
    """On sm_90 every GEMV kernel (not the dequantizers: prefill only) has both griddepcontrol instructions, waits
    before its first global load and store, and triggers only after a load, i.e. after its K loop
    (ninfer_kernels.pdl); none on sm_70."""
    for row in compiled:
        want = None if row["cc"] < 90 or "-dequant-" in row["variant"] else True
        assert row["pdl_ok"] is want, f"{row['variant']}@sm_{row['cc']}: {row['pdl_ok']}"


def test_weight_eviction_priority(compiled):
    """NINFER_GEMV_EVICT's default (`nvfp4`): on sm_90 the NVFP4 decode GEMVs (packed-half2 and warp-MMA) load their
    weights evict-first; no other format does, and sm_70 compiles no eviction hint at all."""
    for row in compiled:
        fmt = row["variant"].split("-")[0]
        want = row["cc"] >= 80 and fmt in ("nvfp4_h2", "nvfp4_mma")
        if fmt == "nvfp4" and row["cc"] >= 80:
            continue     # the fp32 loop and the dequantizer share the tile load (evict-first); the tl.dot route has its own
        assert row["evict_first"] is want, f"{row['variant']}@sm_{row['cc']}: {row['evict_first']}"


def test_no_spills_and_sane_registers(compiled):
    for row in compiled:
        # ptxas spills to the STACK (LOCAL stays 0): the sm_70 FMA tl.dot with a wide K step showed 3 KB there
        assert row["local"] == 0 and row["stack"] == 0 and row["spill"] == 0, \
            f"{row['variant']}@sm_{row['cc']}: {row['local']} B local, {row['stack']} B stack, {row['spill']} B spilled"
        assert 0 < row["regs"] <= 255, row


# Every triton.language name the GEMV kernels use, each checked to exist in Triton 3.6 (the oldest Triton the
# GPU machines run; CI has a newer one). A name outside this list needs the same check before it is added.
TL_NAMES_IN_3_6 = {
    "arange", "atomic_add", "atomic_xchg", "bfloat16", "cdiv", "constexpr", "debug_barrier", "dot", "float16",
    "float32", "int16", "int32", "int64", "join", "load", "max_contiguous", "minimum", "multiple_of",
    "num_programs", "program_id", "reshape", "split", "static_assert", "static_range", "store", "sum", "uint16",
    "uint32", "where", "zeros", "zeros_like",
    # gemv_nvfp4_h2, run on the H200 with Triton 3.6 (bench/results/kernels_h2_check.json: 96/96 ok)
    "abs", "full", "inline_asm_elementwise", "max", "maximum",
    # pipelined elementwise loops and NVFP4 scale words (bench/gpu_session3.sh, Triton 3.6 on the H200)
    "range", "pointer_type",
    # gemv_nvfp4_mma / gemv_mma_common: compiled with Triton 3.6.0 for sm_70 and sm_90 (a CPU venv, no GPU)
    "broadcast_to",
    # gemv_iq3_s_h2: run on the H200 with Triton 3.6 (GPU tests 37/37, bench/results/kernels_check.json)
    "gather", "permute",
    # gemv_glu (the SwiGLU epilogue): as in silu_mul.py, which every decode step on the H200 (Triton 3.6) runs
    "sigmoid"}


def test_kernels_use_only_triton_3_6_language():
    import re
    kdir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
    used = {}
    for f in sorted(os.listdir(kdir)):
        if f.startswith("gemv_") and f.endswith(".py"):
            for name in re.findall(r"\btl\.([a-z_0-9]+)", open(os.path.join(kdir, f)).read()):
                used.setdefault(name, f)
    newer = {n: f for n, f in used.items() if n not in TL_NAMES_IN_3_6}
    assert used and not newer, f"tl names not verified against Triton 3.6: {newer}"
