"""The SwiGLU epilogue of a fused gate/up GEMV: y = silu(gate) * up, and y's prepared form, written by the GEMV
itself instead of by a `silu_mul` kernel behind it (one launch fewer per MLP).

The weight is [N = 2I, K], gate rows first. A CTA owns BLOCK_N rows: all gate rows or all up rows of one 128-column
chunk of y (BLOCK_N divides 128), or of BLOCK_N / 128 whole chunks (BLOCK_N a multiple of 128 that divides I;
`fits`). It stores its rows of gate_up as the plain GEMV does, then arrives at a counter per chunk it touched;
the arrival that completes a chunk (the chunk's gate and up rows are all stored) reads them back from L2, writes
y = silu(gate) * up rounded to the output dtype and, with the prepared form asked for, y's `x16_layout` words, and
resets the counter. Same math and roundings as `silu_mul.silu_mul_kernel`: bit-identical to the unfused pair.
The ordering: a CTA barrier, then an acq_rel atomic at GPU scope (split-K's arrival, `gemv_split.split_arrive`,
is release-only by default since §27 of bench/NOTES.md; this epilogue's was not measured that way and keeps acq_rel).

Outputs (`swiglu_out`): one allocation holding y [T, I] and then, when asked, the prepared rows int32
[T, I/2 + I/128]; the kernel gets y's pointer in the launch's residual slot (the epilogue mode `EPI` says what
that slot holds) and finds the prepared rows behind y's T rows. Counters: the split-K counter buffer, after the
split-K counters of the launch (`counters`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .x16_layout import _CHUNK, CHUNK, row_stride, row_stride_words, store_prepared, words_per_row

EPI_PLAIN, EPI_RES, EPI_GLU, EPI_GLU_XP = 0, 1, 2, 3   # the GEMV kernels' EPI constexpr: what the res slot holds
_EPI_RES, _EPI_GLU_XP = tl.constexpr(EPI_RES), tl.constexpr(EPI_GLU_XP)


@dataclass(frozen=True)
class SwiGLUOut:
    """Where a fused gate/up GEMV puts silu(gate) * up: y [T, I] contiguous, and xp (int32 [T, I/2 + I/128], the
    `x16_layout` rows of y, `row_stride(I)` words apart) directly behind y's rows in the same allocation, or None."""
    y: torch.Tensor
    xp: torch.Tensor | None

    @property
    def epi(self) -> int:
        return EPI_GLU_XP if self.xp is not None else EPI_GLU


def swiglu_out(T: int, I: int, dtype, device, prepared: bool) -> SwiGLUOut:
    """Allocate the outputs of a fused gate/up GEMV at T rows (I a multiple of 128 when `prepared`)."""
    size = torch.empty((), dtype=dtype).element_size()
    extra = T * row_stride(I) * 4 // size if prepared else 0      # int32 words in elements of `dtype`
    buf = torch.empty(T * I + extra, dtype=dtype, device=device)
    y = buf[:T * I].view(T, I)
    xp = buf[T * I:].view(torch.int32).view(T, row_stride(I))[:, :words_per_row(I)] if prepared else None
    return SwiGLUOut(y, xp)


def epi_of(residual) -> int:
    """The EPI constexpr for a launch's residual argument (None, a tensor to add, or a SwiGLUOut)."""
    if residual is None:
        return EPI_PLAIN
    return residual.epi if isinstance(residual, SwiGLUOut) else EPI_RES


def check_glu(glu: SwiGLUOut, T: int, N: int, dtype, device) -> str | None:
    """None when `glu` can take the SwiGLU of a [T, N] gate/up output in `dtype`, else what is wrong."""
    I = N // 2
    y = glu.y
    if N % 2 or I % CHUNK:
        return f"the gate/up rows N={N} must be 2 * a multiple of {CHUNK}"
    if tuple(y.shape) != (T, I) or not y.is_contiguous() or y.dtype != dtype or y.device != device:
        return f"y must be a contiguous [{T}, {I}] {dtype} tensor on {device}"
    xp = glu.xp
    if xp is not None and (xp.dtype != torch.int32 or tuple(xp.shape) != (T, words_per_row(I))
                           or xp.stride(1) != 1 or not xp_follows_y(glu)):
        return "the prepared rows must directly follow y's rows, row_stride(I) words apart (allocate with swiglu_out)"
    return None


def xp_follows_y(glu: SwiGLUOut) -> bool:
    """Whether the prepared rows (if any) start right behind y's rows and lie `row_stride` words apart: where the
    kernel looks for them."""
    xp = glu.xp
    return xp is None or (xp.data_ptr() == glu.y.data_ptr() + glu.y.numel() * glu.y.element_size()
                          and xp.stride(0) == row_stride(glu.y.shape[-1]))


def fits(block_n: int, N: int) -> bool:
    """Whether a config's row block serves the epilogue: it holds gate rows only or up rows only, of one chunk or
    of whole chunks."""
    I = N // 2
    return I % CHUNK == 0 and (CHUNK % block_n == 0 if block_n <= CHUNK else I % block_n == 0)


def counters(grid_n: int, grid_t: int, N: int) -> int:
    """int32 counters a launch needs: split-K's (one per row block and T tile), then one per (T tile, chunk)."""
    return grid_n * grid_t + grid_t * (N // 2 // CHUNK)


@triton.jit
def _chunk(out_ptr, stride_ot, y_ptr, e0, I, T, T_TILE: tl.constexpr, EPI: tl.constexpr):
    """y (and its prepared words) of columns e0 .. e0 + CHUNK - 1 for the CTA's T tile, from the stored gate/up
    rows."""
    c = e0 + tl.arange(0, _CHUNK)
    t0 = tl.program_id(2) * T_TILE
    for i in tl.static_range(T_TILE):
        t = t0 + i
        if t < T:
            row = out_ptr + t.to(tl.int64) * stride_ot
            g = tl.load(row + c, cache_modifier=".cg").to(tl.float32)      # L2: other CTAs stored them
            u = tl.load(row + I + c, cache_modifier=".cg").to(tl.float32)
            y = (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + t.to(tl.int64) * I + c, y)
            if EPI == _EPI_GLU_XP:
                xp = (y_ptr + T * I).to(tl.pointer_type(tl.int32)) + t.to(tl.int64) * row_stride_words(I)
                store_prepared(y.to(tl.float32), xp, e0, _CHUNK, I)


@triton.jit
def glu_arrive(out_ptr, stride_ot, y_ptr, cnt_ptr, N, T, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
               EPI: tl.constexpr):
    """After the CTA stored its gate/up rows: arrive at each chunk it touched; finish the chunks it completes."""
    CPB: tl.constexpr = (BLOCK_N + _CHUNK - 1) // _CHUNK            # chunks per row block
    ARR: tl.constexpr = 2 * ((_CHUNK + BLOCK_N - 1) // BLOCK_N)     # arrivals that complete a chunk
    I = N // 2
    c0 = (tl.program_id(0) * BLOCK_N) % I // _CHUNK                # up rows map onto the chunks of their gate rows
    base = cnt_ptr + tl.num_programs(0) * tl.num_programs(2) + tl.program_id(2) * (I // _CHUNK)
    tl.debug_barrier()   # every thread's gate/up store is issued before the arrival
    for j in tl.static_range(CPB):
        if tl.atomic_add(base + c0 + j, 1, sem="acq_rel", scope="gpu") == ARR - 1:
            _chunk(out_ptr, stride_ot, y_ptr, (c0 + j) * _CHUNK, I, T, T_TILE, EPI)
            tl.atomic_xchg(base + c0 + j, 0, sem="relaxed", scope="gpu")   # reusable, graph-safe
