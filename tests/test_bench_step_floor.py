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

# the read kernels run on the interpreter (CPU tensors) or compiled on a GPU; plain CPU tensors need the interpreter
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEV = "cpu" if INTERPRET else "cuda" if torch.cuda.is_available() else None
needs_triton = pytest.mark.skipif(DEV is None, reason="needs the Triton interpreter (TRITON_INTERPRET=1) or a CUDA GPU")


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


@needs_triton
@pytest.mark.parametrize("n_vec,sms,wait", [(3000, 3, 1), (1, 1, 1), (4097, 2, 2)],
                         ids=["3000v-3sm", "1v", "4097v-2sm-preload"])
def test_read_kernel_reads_every_vector_once(n_vec, sms, wait):
    rng = np.random.default_rng(n_vec)
    words = rng.integers(0, 1 << 20, size=2 * n_vec + 6, dtype=np.int64)            # + a tail it must not read
    per, grid = step_floor.read_plan(n_vec, sms)
    out = torch.full((grid[0] + 1,), float("nan"), device=DEV)
    out[: grid[0]] = 0.0
    step_floor.read_kernel[grid](torch.from_numpy(words).to(DEV), out, n_vec, per, BLOCK=step_floor.BLOCK,
                                 UNROLL=step_floor.UNROLL, PDL=0, LATE=1, WAIT=wait)
    out = out.cpu()
    vec = words[: 2 * n_vec].reshape(n_vec, 2)
    for p in range(grid[0]):
        part = np.zeros((per, 2), np.int64)
        mine = vec[p * per: (p + 1) * per]
        part[: len(mine)] = mine
        want = np.bitwise_xor.reduce(part.reshape(-1, step_floor.BLOCK, 2), axis=0).sum()
        assert out[p].item() == np.float32(want), p
    assert torch.isnan(out[grid[0]])


@needs_triton
@pytest.mark.parametrize("n,k,bn,split,unroll", [(256, 640, 64, 2, 2), (384, 512, 128, 1, 1), (128, 1152, 32, 4, 2)],
                         ids=["256x640-n64-s2-u2", "384x512-n128-u1", "128x1152-n32-s4-u2"])
def test_read_pattern_walks_the_same_words_in_both_layouts(n, k, bn, split, unroll, monkeypatch):
    """bench/read_pattern.py: each CTA reads its rows' chunks once, whether the planes are chunk-major or
    row-blocked (the same logical words, laid out two ways)."""
    import read_pattern as rp
    C, rb = k // 128, min(rp.RB, n)
    rng = np.random.default_rng(n + k)
    codes = rng.integers(0, 1 << 20, size=(n, C, 8), dtype=np.int64)          # logical [row, chunk, word]
    scales = rng.integers(0, 256, size=(n, C, 8), dtype=np.uint8)
    lay = {"chunk": lambda a: a.transpose(1, 0, 2),
           "blocked": lambda a: a.reshape(n // rb, rb, C, 8).transpose(0, 2, 1, 3)}
    c_per = -(-C // split)
    nb, ns = -(-n // bn), -(-C // c_per)
    want = np.zeros(nb * ns, np.float32)
    for b in range(nb):
        for s in range(ns):
            part = codes[b * bn:(b + 1) * bn, s * c_per:(s + 1) * c_per] ^ scales[b * bn:(b + 1) * bn,
                                                                                 s * c_per:(s + 1) * c_per]
            want[b * ns + s] = np.float32(np.bitwise_xor.reduce(part, axis=1).sum())
    monkeypatch.setattr(rp, "RB", rb)
    for layout, f in lay.items():
        out = torch.zeros(nb * ns + 1, device=DEV)
        out[-1] = float("nan")
        c_t = torch.from_numpy(np.ascontiguousarray(f(codes)).reshape(-1)).to(DEV)
        s_t = torch.from_numpy(np.ascontiguousarray(f(scales)).reshape(-1)).to(DEV)
        rp.walk_launcher(c_t, s_t, out, n, k, layout, bn, split, unroll)()
        out = out.cpu()
        assert np.array_equal(out[:-1].numpy(), want), layout
        assert torch.isnan(out[-1])
