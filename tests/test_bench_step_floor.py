"""bench/step_floor.py off the GPU: the step's launch list (what the runtime fuses, in order, MTP left out) and the
read kernel on the interpreter (every 16-byte vector read once, in the lanes the reference says)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import step_floor  # noqa: E402


def test_step_launches_are_the_27b_decode_gemvs():
    launches = step_floor.step_launches("nvfp4")
    names = [n for n, _ in launches]
    assert len(names) == 64 * 4 + 1 and names[-1] == "lm_head"
    assert names[:4] == ["gdn_qkvz", "gdn_out", "mlp_gate_up", "mlp_down"]
    assert names[12:16] == ["attn_qkv", "attn_o", "mlp_gate_up", "mlp_down"]       # layer 3: full attention
    size = dict(launches)
    nv = lambda n, k: n * k // 2 + n * k // 16                                     # codes + e4m3 scales
    assert abs(size["gdn_qkvz"] - nv(16384, 5120)) < 64 and abs(size["mlp_gate_up"] - nv(34816, 5120)) < 64
    assert abs(size["attn_qkv"] - nv(14336, 5120)) < 64 and abs(size["lm_head"] - 248320 * 5120 // 256 * 210) < 64


@pytest.mark.parametrize("n_vec,sms,wait", [(3000, 3, 1), (1, 1, 1), (4097, 2, 2)],
                         ids=["3000v-3sm", "1v", "4097v-2sm-preload"])
def test_read_kernel_reads_every_vector_once(n_vec, sms, wait):
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("the read kernel runs on the interpreter here (GPU: bench/step_floor.py itself)")
    rng = np.random.default_rng(n_vec)
    words = rng.integers(0, 1 << 20, size=2 * n_vec + 6, dtype=np.int64)            # + a tail it must not read
    per, grid = step_floor.read_plan(n_vec, sms)
    out = torch.full((grid[0] + 1,), float("nan"))
    out[: grid[0]] = 0.0
    step_floor.read_kernel[grid](torch.from_numpy(words), out, n_vec, per, BLOCK=step_floor.BLOCK,
                                 UNROLL=step_floor.UNROLL, PDL=0, LATE=1, WAIT=wait)
    vec = words[: 2 * n_vec].reshape(n_vec, 2)
    for p in range(grid[0]):
        part = np.zeros((per, 2), np.int64)
        mine = vec[p * per: (p + 1) * per]
        part[: len(mine)] = mine
        want = np.bitwise_xor.reduce(part.reshape(-1, step_floor.BLOCK, 2), axis=0).sum()
        assert out[p].item() == np.float32(want), p
    assert torch.isnan(out[grid[0]])
