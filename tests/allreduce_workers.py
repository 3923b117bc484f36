"""Rank programs for the 2-GPU tests of tests/test_allreduce.py (spawned ranks import this small module)."""
from __future__ import annotations

import torch

from ninfer_rt.allreduce import choose

SIZES = (8, 5120, 3 * 5120, 12 * 5120 + 8, 64 * 1024, 200 * 1024)


def _partial(n: int, dtype, rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 31 + rank)
    return (torch.randn(n, generator=g) * (rank + 1)).to(dtype).cuda()


def compare_program(group, seed: int = 0) -> dict:
    """Every rank: peer-memory results vs NCCL on random messages, eagerly and from a CUDA graph."""
    out = {"p2p": group.p2p is not None, "eager_mismatch": [], "graph_mismatch": []}
    if group.p2p is None:
        return out
    for n in SIZES:
        for dt in (torch.bfloat16, torch.float32):
            x = _partial(n, dt, group.rank, seed + n)
            impl = choose(x.numel() * x.element_size(), group.p2p.rows, group.p2p.capacity)   # eager or not
            got = group.p2p.run(x, impl) if impl != "nccl" else group.nccl_all_reduce(x.clone())
            if not torch.equal(got, group.nccl_all_reduce(x.clone())):
                out["eager_mismatch"].append((n, str(dt), impl))
    x = _partial(5120 * 2, torch.bfloat16, group.rank, seed)

    def chain(v):               # a layer stack's worth of dependent all-reduces
        for _ in range(16):
            v = group.all_reduce(v * 0.5)
        return v
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = chain(x)
    for k in range(2):
        x.copy_(_partial(5120 * 2, torch.bfloat16, group.rank, seed + 100 + k))
        g.replay()
        want = x
        for _ in range(16):     # eager NCCL: the same single rounding per reduction
            want = group.nccl_all_reduce(want * 0.5)
        if not torch.equal(y, want):
            out["graph_mismatch"].append(k)
    torch.cuda.synchronize()
    return out
