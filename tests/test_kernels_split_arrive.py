"""NINFER_SPLIT_ARRIVE (kernels/gemv_split.py): the split-K arrival with a release-only atomic.

The switch is a global constexpr read when the kernels module is imported, so each setting runs in its own
process: the same output bits either way (the partials are summed in split order), and on sm_90 the only change
in the SASS is the acquire's L1 invalidation (CCTL.IVALL) after the counter's atomic.
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_RUN = r"""
import hashlib, json, os, sys, torch
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
from gemv_inputs import nvfp4_weights, rel_l2
from ninfer_kernels import reference
from ninfer_kernels.gemv_launch import GemvConfig, workspace
from ninfer_kernels.gemv_nvfp4 import gemv_nvfp4, repack_nvfp4
dev = "cuda" if torch.cuda.is_available() else "cpu"
out = {}
for T, cfg in ((1, GemvConfig(16, 4, 2, 1, split=3, h2=True)), (3, GemvConfig(16, 2, 2, 1, split=5))):
    codes, scales, gs = nvfp4_weights(45, 640, T, dev)
    x = torch.randn(T, 640, generator=torch.Generator().manual_seed(T)).to(dev)
    y = gemv_nvfp4(x, repack_nvfp4(codes, scales), gs, config=cfg)
    out[T] = [hashlib.sha256(y.float().cpu().numpy().tobytes()).hexdigest(),
              rel_l2(y, reference.ref_nvfp4(x, codes, scales, gs)), int(workspace(x.device, 0, 0)[1].abs().sum())]
print(json.dumps(out))
"""


def _run(arrive: str) -> dict:
    env = {**os.environ, "NINFER_SPLIT_ARRIVE": arrive}
    r = subprocess.run([sys.executable, "-c", _RUN, ROOT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_release_arrival_gives_the_same_bits():
    a, r = _run("acq_rel"), _run("release")
    assert a == r
    for digest, err, counters in r.values():
        assert err < 2e-3 and counters == 0      # fp32 output (as test_kernels_gemv_h2); counters back at zero


_SASS = r"""
from ninfer_kernels import compile_check as cc
v = cc.Variant("nvfp4_mma", "bfloat16", 8, 128, 8, use_split=True, epi=1, stages=2)
print(cc.sass(cc.compile_variant(v, 90)))
"""


def _sass(arrive: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["NINFER_SPLIT_ARRIVE"] = arrive
    r = subprocess.run([sys.executable, "-c", _SASS], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_release_arrival_drops_only_the_acquire():
    """sm_90 SASS of a split-K warp-MMA tile: the fence and the atomic stay, the L1 invalidation goes."""
    acq, rel = _sass("acq_rel"), _sass("release")
    for s in (acq, rel):
        assert "MEMBAR.ALL.GPU" in s and "ATOMG.E.ADD.STRONG.GPU" in s
    assert "CCTL.IVALL" in acq and "CCTL.IVALL" not in rel
    code = [ln for ln in rel.splitlines() if "/*" in ln and "CCTL" not in ln]
    assert abs(len(code) - len([ln for ln in acq.splitlines() if "/*" in ln and "CCTL" not in ln])) <= 8
