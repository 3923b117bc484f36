"""L2 prefetch of a T = 1 NVFP4 GEMV's first weight chunks while it waits for the kernel in front (PDL, sm_90+).

Why: with programmatic dependent launch (`ninfer_kernels.pdl`) a GEMV's CTAs are placed during the tail of the
GEMV before it and the short kernels in between (a norm, the conv and recurrence, the attention), then sit in
`griddepcontrol.wait`; the memory system is nearly idle all that time (Nsight Compute: the SMs without a CTA for
18-20 % of each T = 1 GEMV). The weights do not depend on the kernel in front, so a CTA may ask for its first
chunks before the wait. Loading them into registers cost the loop a CTA per SM and decode 17 % (bench/NOTES.md
§16); a bulk L2 prefetch (`cp.async.bulk.prefetch.L2`, one instruction per contiguous range, no register kept)
costs nothing in the loop, which then finds those lines in L2.

`NINFER_GEMV_L2PF` = the number of 128-weight chunks a CTA prefetches from the start of its K range (0 = off,
the default until measured; at most `MAX_CHUNKS`). A chunk of a CTA is two contiguous ranges of the chunk-major
planes (`gemv_nvfp4.repack_nvfp4`): its rows' 64-byte code blocks and their 8-byte scale blocks; the scale range
is trimmed to 16-byte alignment (the instruction's rule), so at most 15 bytes at each end are left to the loop.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

L2PF_ENV = "NINFER_GEMV_L2PF"
SLOTS = 256                       # prefetch slots per CTA: >= the threads of any tile (8 warps), none doubled
MAX_CHUNKS = SLOTS // 2           # two ranges (codes, scales) per chunk
_SLOTS = tl.constexpr(SLOTS)
_CODE_BYTES = tl.constexpr(64)    # one row's codes in one chunk: 8 int64 words
_SCALE_BYTES = tl.constexpr(8)    # and its 8 E4M3 scale bytes


def l2pf_chunks() -> int:
    """NINFER_GEMV_L2PF as an int in [0, MAX_CHUNKS]; anything else is a one-line error naming the variable."""
    v = os.environ.get(L2PF_ENV, "0")
    if not v.isdigit() or int(v) > MAX_CHUNKS:
        from .ops_common import KernelInputError
        raise KernelInputError(f"{L2PF_ENV}={v!r}: expected a chunk count from 0 to {MAX_CHUNKS}")
    return int(v)


@triton.jit
def cm_ranges(N, G, split, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, L2PF: tl.constexpr):
    """(start, nbytes, plane) [SLOTS] int64 / int32 / int32 of this CTA's prefetch: slot 2i (2i + 1) is chunk i of
    the CTA's K range in the code (scale) plane, plane 0 (1); nbytes 0 for an unused slot. The CTA's rows and
    K range are `h2_body`'s; only the first T tile's CTA prefetches (the others read the same weights)."""
    i = tl.arange(0, _SLOTS)
    n0 = tl.program_id(0) * BLOCK_N
    n1 = tl.minimum(n0 + BLOCK_N, N)
    g_per = tl.cdiv(tl.cdiv(G, split), BLOCK_G) * BLOCK_G
    g_lo = tl.program_id(1) * g_per
    c_lo = g_lo // 8
    c_hi = (tl.minimum(G, g_lo + g_per) + 7) // 8
    c = c_lo + i // 2
    plane = i % 2
    row0 = c.to(tl.int64) * N + n0
    nrows = n1 - n0
    code_lo = row0 * _CODE_BYTES
    sc_lo = (row0 * _SCALE_BYTES + 15) // 16 * 16
    sc_hi = (row0 + nrows) * _SCALE_BYTES // 16 * 16
    start = tl.where(plane == 0, code_lo, sc_lo)
    nbytes = tl.where(plane == 0, nrows * _CODE_BYTES, tl.maximum(sc_hi - sc_lo, 0).to(tl.int32))
    use = (c < c_hi) & (i // 2 < L2PF) & (tl.program_id(2) == 0)
    return start, tl.where(use, nbytes, 0), plane


@triton.jit
def _bulk_prefetch(addr, nbytes):
    # no result is used: is_pure=False keeps the instruction
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r", [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_nvfp4(codes, scales, N, G, split, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                   L2PF: tl.constexpr, PDL: tl.constexpr):
    """Before `griddepcontrol.wait`: the CTA's first L2PF chunks of both planes into L2 (sm_90 with PDL only;
    without PDL there is nothing to wait for and nothing compiles in)."""
    if PDL:
        if L2PF > 0:
            start, nbytes, plane = cm_ranges(N, G, split, BLOCK_N, BLOCK_G, L2PF)
            base = tl.where(plane == 0, codes.to(tl.pointer_type(tl.int8)), scales.to(tl.pointer_type(tl.int8)))
            _bulk_prefetch(base + start, nbytes)


def ptx_prefetch_ok(ptx: str, l2pf: int, pdl: int) -> bool | None:
    """For a compile check: None when nothing is prefetched (no PDL or L2PF 0); else whether the PTX has a bulk
    L2 prefetch and every one comes before `griddepcontrol.wait`."""
    if not (pdl and l2pf):
        return None
    wait, last = ptx.find("griddepcontrol.wait"), ptx.rfind("cp.async.bulk.prefetch.L2")
    return 0 <= last < wait
