"""The NVFP4 GEMVs' L2 prefetch before the PDL wait (kernels/l2_prefetch.py): which byte ranges a CTA asks for,
and who gets the constexpr.

The prefetch instruction itself is sm_90 PTX (the interpreter cannot run it); the compile tests check it is
there and before the wait (test_kernels_compile). Here the ranges are computed in the interpreter, one program
per CTA of real launch grids, and compared with the bytes the CTA's K loop reads from the chunk-major planes.
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from ninfer_kernels import l2_prefetch
from ninfer_kernels.ops_common import KernelInputError



@triton.jit
def _ranges_kernel(start_ptr, n_ptr, plane_ptr, N, G, split, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                   L2PF: tl.constexpr):
    start, nbytes, plane = l2_prefetch.cm_ranges(N, G, split, BLOCK_N, BLOCK_G, L2PF)
    cta = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0)
    i = cta * l2_prefetch.SLOTS + tl.arange(0, l2_prefetch.SLOTS)
    tl.store(start_ptr + i, start)
    tl.store(n_ptr + i, nbytes)
    tl.store(plane_ptr + i, plane)


def _ranges(N, K, split, block_n, block_g, l2pf, t_tiles=1):
    G = K // 16
    grid = (triton.cdiv(N, block_n), split, t_tiles)
    size = grid[0] * grid[1] * grid[2] * l2_prefetch.SLOTS
    start = torch.full((size,), -1, dtype=torch.int64)
    nbytes = torch.full((size,), -1, dtype=torch.int32)
    plane = torch.full((size,), -1, dtype=torch.int32)
    _ranges_kernel[grid](start, nbytes, plane, N, G, split, BLOCK_N=block_n, BLOCK_G=block_g, L2PF=l2pf)
    shape = (grid[2], grid[1], grid[0], l2_prefetch.SLOTS)
    return start.view(shape).numpy(), nbytes.view(shape).numpy(), plane.view(shape).numpy()


def _wanted(N, K, split, block_n, block_g, l2pf, pid0, pid1):
    """{plane: set of bytes} the CTA's first l2pf chunks occupy: 64 code bytes and 8 scale bytes per row per chunk,
    the scale ranges trimmed to 16-byte boundaries."""
    G, C = K // 16, -(-K // 128)
    g_per = -(-(-(-G // split)) // block_g) * block_g
    g_lo, g_hi = pid1 * g_per, min(G, pid1 * g_per + g_per)
    n0, n1 = pid0 * block_n, min(N, pid0 * block_n + block_n)
    out = {0: set(), 1: set()}
    for c in range(g_lo // 8, min(-(-g_hi // 8), g_lo // 8 + l2pf) if g_lo < g_hi else g_lo // 8):
        assert c < C
        out[0] |= set(range((c * N + n0) * 64, (c * N + n1) * 64))
        lo, hi = -(-(c * N + n0) * 8 // 16) * 16, (c * N + n1) * 8 // 16 * 16
        out[1] |= set(range(lo, hi))
    return out


CASES = [  # (N, K, split, block_n, block_g, l2pf): odd row counts, ragged splits, more chunks than asked
    pytest.param(77, 640, 1, 32, 16, 4, id="n77-k640-all"),
    pytest.param(77, 640, 1, 32, 16, 2, id="n77-k640-first2"),
    pytest.param(130, 1536, 3, 64, 16, 3, id="n130-split3"),
    pytest.param(96, 1024, 5, 16, 8, 128, id="n96-split5-ragged"),
    pytest.param(33, 384, 4, 16, 16, 1, id="n33-split4-empty-tail"),
]


@pytest.mark.parametrize("N,K,split,block_n,block_g,l2pf", CASES)
def test_ranges_are_the_ctas_first_chunks(N, K, split, block_n, block_g, l2pf):
    start, nbytes, plane = _ranges(N, K, split, block_n, block_g, l2pf, t_tiles=2)
    C = -(-K // 128)
    size = {0: C * N * 64, 1: C * N * 8}
    for pid1 in range(split):
        for pid0 in range(start.shape[2]):
            got = {0: set(), 1: set()}
            for s, n, p in zip(start[0, pid1, pid0], nbytes[0, pid1, pid0], plane[0, pid1, pid0]):
                if n > 0:
                    assert s % 16 == 0 and n % 16 == 0 and 0 <= s and s + n <= size[p], (s, n, p)
                    assert not (got[p] & set(range(s, s + n))), "a range asked for twice"
                    got[p] |= set(range(s, s + n))
            assert got == _wanted(N, K, split, block_n, block_g, l2pf, pid0, pid1), (pid0, pid1)
    assert (nbytes[1] == 0).all()          # the second T tile's CTAs read the same weights: no prefetch


def test_chunk_count_switch(monkeypatch):
    monkeypatch.delenv(l2_prefetch.L2PF_ENV, raising=False)
    assert l2_prefetch.l2pf_chunks() == 0
    monkeypatch.setenv(l2_prefetch.L2PF_ENV, "6")
    assert l2_prefetch.l2pf_chunks() == 6
    for bad in ("-1", "x", str(l2_prefetch.MAX_CHUNKS + 1)):
        monkeypatch.setenv(l2_prefetch.L2PF_ENV, bad)
        with pytest.raises(KernelInputError, match=f"NINFER_GEMV_L2PF='{bad}'"):
            l2_prefetch.l2pf_chunks()


def test_launcher_prefetches_only_with_pdl(monkeypatch):
    """The launcher gives L2PF = NINFER_GEMV_L2PF to the kernels that have it only where PDL is on: without the
    wait there is no idle time to prefetch in (and the instruction is sm_90)."""
    from ninfer_kernels import gemv_launch
    from ninfer_kernels.gemv_launch import GemvConfig
    seen = {}

    class Fake:
        __name__, arg_names = "nvfp4_gemv_kernel", ("x_ptr", "PDL", "L2PF")

        def __getitem__(self, grid):
            return lambda *a, **kw: seen.update(kw)

    monkeypatch.setattr(gemv_launch, "variant", lambda kernel, kind, device: kernel)
    monkeypatch.setenv(l2_prefetch.L2PF_ENV, "5")
    x, out = torch.zeros(1, 256), torch.zeros(1, 8)
    cfg = GemvConfig(block_n=8, block_g=16, h2=True)
    for pdl_on, want in ((False, 0), (True, 5)):
        monkeypatch.setattr(gemv_launch, "pdl_kw", lambda dev: {"PDL": 1, "launch_pdl": True} if pdl_on else {})
        gemv_launch._launch(Fake(), (), x, 8, 16, 1.0, out, None, cfg)
        assert seen["L2PF"] == want and seen["PDL"] == int(pdl_on)


GPU_CASES = {   # T, GemvConfig: the decode loop (h2, T = 1) and the verify loop (warp-MMA, T = 4), ragged splits
    "h2-T1-split3": (1, dict(block_n=128, block_g=16, num_stages=1, split=3, h2=True)),
    "h2-T1": (1, dict(block_n=128, block_g=16, num_stages=1, h2=True)),
    "mma-T4-split3": (4, dict(block_n=128, block_g=8, num_stages=2, split=3, mma=True)),
}


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="bulk L2 prefetch and PDL are sm_90")
@pytest.mark.parametrize("case", GPU_CASES)
def test_prefetch_leaves_the_result_bit_identical_gpu(case, monkeypatch):
    """A prefetch only warms L2: with any chunk count the GEMV's output is the same bits as without."""
    from gemv_inputs import nvfp4_weights
    from ninfer_kernels.gemv_launch import GemvConfig
    from ninfer_kernels.gemv_nvfp4 import gemv_nvfp4, repack_nvfp4
    monkeypatch.delenv("NINFER_PDL", raising=False)
    T, cfg = GPU_CASES[case]
    N, K = 1000, 3072
    codes, scales, gs = nvfp4_weights(N, K, 7, "cuda")
    x = torch.randn(T, K, device="cuda").to(torch.bfloat16)
    outs = []
    for chunks in (0, 1, 5, l2_prefetch.MAX_CHUNKS):
        monkeypatch.setenv(l2_prefetch.L2PF_ENV, str(chunks))
        out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device="cuda")
        outs.append(gemv_nvfp4(x, repack_nvfp4(codes, scales), gs, out, config=GemvConfig(**cfg)))
    assert torch.isfinite(outs[0]).all()
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
