"""NVFP4 packed-half2 GEMV whose weight tiles arrive by TMA (the Hopper tensor-copy engine): sm_90+, T <= 8.

Why: the register-loaded T = 1 loop (`gemv_nvfp4_h2`) reads its tile into registers and decodes it there, so the
bytes a CTA has in flight are bounded by its registers; on the H200 it reached 62-71 % of copy bandwidth against
73-84 % for the same loads with two tiles in flight and no decode (bench/NOTES.md §5). Here a chunk of BLOCK_N rows
(BLOCK_N * 64 code bytes and BLOCK_N * 8 scale bytes, one contiguous run each in `repack_nvfp4`'s chunk-major
planes) is one bulk tensor copy into shared memory; Triton's pipeliner keeps STAGES - 1 chunks in flight per CTA
(mbarrier waits, no registers held), and the decode reads the landed chunk from shared memory.

Weights are `repack_nvfp4`'s planes seen as 3-D tensors: codes int64 [C, N, 8] (box [1, BLOCK_N, 8]) and the
scales as u8 [C, N/2, 16] (box [1, BLOCK_N/2, 16]: a TMA box row must be >= 16 bytes), so N must be even. Rows
past N in the last row tile are filled with zeros by the copy engine and never stored. The decode, the
activation handling (plain or prepared, `XPRE`) and the split-K epilogue are the packed-half2 kernel's
(`gemv_nvfp4_h2._tile`, `gemv_common._finish`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gemv_common import _finish, _zeros
from .gemv_h2_common import row_scale
from .gemv_nvfp4_h2 import _BACK_BIAS, _UP_BIAS, _tile


@triton.jit
def _tma_loop(x_ptr, wc, ws, n0, t0, c_lo, c_hi, G, T, stride_xt, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
              STAGES: tl.constexpr, H2_MODE: tl.constexpr, XPRE: tl.constexpr):
    ups, backs = (), ()
    for tt in tl.static_range(T_TILE):
        if XPRE:   # as gemv_h2_common._loop: the chunks' backs ride on the block scales
            w = tl.full([], (_UP_BIAS + _BACK_BIAS - 127) << 23, tl.int32).to(tl.float32, bitcast=True)
            ups, backs = ups + (w,), backs + (w,)
        else:
            up, back = row_scale(x_ptr, tl.minimum(t0 + tt, T - 1) * stride_xt, c_lo * 128, tl.minimum(c_hi * 128, G * 16),
                                 512, _UP_BIAS, _BACK_BIAS)
            ups, backs = ups + (up,), backs + (back,)
    accs = _zeros(T_TILE, BLOCK_N, 8)
    for c in tl.range(c_lo, c_hi, num_stages=STAGES):
        words = tl.reshape(wc.load([c, n0, 0]), [BLOCK_N, 8])
        sb = tl.reshape(ws.load([c, n0 // 2, 0]), [BLOCK_N, 8]).to(tl.int32)
        g = c * 8 + tl.arange(0, 8)
        st = (words.to(tl.int32), (words >> 32).to(tl.int32), sb)
        accs = _tile(accs, ups, st, g, g < G, t0, T, x_ptr, stride_xt, T_TILE, H2_MODE, XPRE, G)
    cols = tl.arange(0, T_TILE)
    acc = tl.zeros([BLOCK_N, T_TILE], tl.float32)
    for tt in tl.static_range(T_TILE):
        acc = tl.where(cols[None, :] == tt, tl.sum(accs[tt], axis=1)[:, None] * backs[tt], acc)
    return acc


@triton.jit
def nvfp4_tma_gemv_kernel(x_ptr, wc, ws, out_ptr, res_ptr, ws_ptr, cnt_ptr, fscale, T, N, G, split, stride_xt,
                          stride_ot, stride_rt, T_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                          USE_SPLIT: tl.constexpr, HAS_RES: tl.constexpr, STAGES: tl.constexpr,
                          H2_MODE: tl.constexpr, XPRE: tl.constexpr):
    """Grid (row tiles, K splits over 128-weight chunks, T tiles); wc / ws: the planes' tensor descriptors."""
    n0 = tl.program_id(0) * BLOCK_N
    t0 = tl.program_id(2) * T_TILE
    C = tl.cdiv(G, 8)
    c_per = tl.cdiv(C, split)
    c_lo = tl.program_id(1) * c_per
    c_hi = tl.minimum(C, c_lo + c_per)
    acc = _tma_loop(x_ptr, wc, ws, n0, t0, c_lo, c_hi, G, T, stride_xt, T_TILE, BLOCK_N, STAGES, H2_MODE, XPRE)
    _finish(acc * fscale, t0 + tl.arange(0, T_TILE), n0 + tl.arange(0, BLOCK_N), N, T, split, out_ptr, stride_ot,
            res_ptr, stride_rt, ws_ptr, cnt_ptr, HAS_RES, USE_SPLIT)


_TMA_BLOCK_N = (64, 128, 256)     # a TMA box dimension holds at most 256 elements


def tma_ok(device, N: int, K: int) -> bool:
    """Whether the TMA variant can run: sm_90+ (or the interpreter), an even N, K a multiple of 128 (whole
    chunks: the x loads are unmasked only then... and every real shape is)."""
    import torch
    from .gemv_launch import interpreting
    if N % 2 or K % 128:
        return False
    return interpreting() or (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0))


class TmaKernel:
    """The launcher object `gemv_launch` uses for GemvConfig.tma: takes the planes' tensors like the format's
    own kernel, hands the kernel tensor descriptors of them (cached per tensor and block size: a descriptor is a
    few Python objects, the TMA map itself is encoded by Triton's launcher at each launch) and drops the
    constexprs of the shared launcher that this kernel has no use for."""

    _UNUSED = ("BLOCK_G", "USE_DOT", "DOT_KIND", "EVEN_G", "FOLD")

    def __init__(self, name: str, mode: int):
        self.__name__, self.jit, self.mode, self.extra_consts = name, nvfp4_tma_gemv_kernel, mode, {"H2_MODE": mode}
        self._descs: dict = {}

    def descriptors(self, codes, scales, block_n: int) -> tuple:
        from triton.tools.tensor_descriptor import TensorDescriptor
        key = (codes.data_ptr(), scales.data_ptr(), tuple(codes.shape), block_n)
        d = self._descs.get(key)
        if d is None:
            C, n, _ = codes.shape
            sv = scales.view(C, n // 2, 16)
            d = (TensorDescriptor(codes, list(codes.shape), list(codes.stride()), [1, block_n, 8]),
                 TensorDescriptor(sv, list(sv.shape), list(sv.stride()), [1, block_n // 2, 16]))
            if len(self._descs) > 4096:
                self._descs.clear()
            self._descs[key] = d
        return d

    def _args(self, a, kw):
        wc, ws = self.descriptors(a[1], a[2], kw["BLOCK_N"])
        kw = {k: v for k, v in kw.items() if k not in self._UNUSED}
        return (a[0], wc, ws) + tuple(a[3:]), kw

    def __getitem__(self, grid):
        def run(*a, **kw):
            a, kw = self._args(a, kw)
            return self.jit[grid](*a, H2_MODE=self.mode, **kw)
        return run

    def warmup(self, *a, grid, **kw):
        a, kw = self._args(a, kw)
        return self.jit.warmup(*a, grid=grid, H2_MODE=self.mode, **kw)


_MADE: dict = {}


def tma_kernel(device) -> TmaKernel:
    from .gemv_h2_common import h2_mode
    mode = h2_mode(device)
    if mode not in _MADE:
        _MADE[mode] = TmaKernel("nvfp4_gemv_kernel", mode)
    return _MADE[mode]
