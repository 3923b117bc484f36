"""The prepared-activation layout (`ninfer_kernels.x16`), its allocator and the store every producer of it
shares: constants, `empty_prepared` and @triton.jit helpers, with no kernel-module imports, so that any kernel
(the GEMV epilogues too) can write prepared rows.

Layout (int32 [T, K/2 + K/128] per activation row, K a multiple of 128; rows `row_stride(K)` words apart):
  words 0 .. K/2-1     f16x2 pairs, word 4o + j (o = 0 .. K/8-1, j = 0..3) = (x'[8o + j] low, x'[8o + j + 4]
                       high): the (j, j+4) pair order of `gemv_h2_common.x_pairs` and `gemv_mma_body._x_pairs`
  words K/2 + c        fp32 bits of back_c = 1 / up_c for chunk c (activations 128c .. 128c + 127)
with x' = x * up_c rounded to nearest-even f16, up_c = 2**(140 - E) from E, the fp32 exponent field of the
chunk's largest |x| clamped to [14, 253]: |x'| < 2**14 (the packed-half2 NVFP4 block sums stay below 96) and
both factors are finite normals (an all-zero chunk gets up = 2**126, x' = 0).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .env_switch import switch_error, switch_value

CHUNK = 128                          # activations per back factor (the MMA variant's K chunk)
UP_FIELD = 267                       # fp32 exponent field of up = UP_FIELD - E: up = 2**(140 - E), |x'| < 2**14
E_MIN, E_MAX = 14, 253               # E's clamp: up and back = 1 / up stay finite normals
# Row strides are padded to ROW_ALIGN words: Triton specializes an integer argument divisible by 16, and with such
# a stride a GEMV lane's activation words are provably 16-byte aligned and load as vectors. K/2 + K/128 alone is
# not, for K = 5120 / 17408 / 3072 / 8704, and the warp-MMA tiles then took 114-194 registers instead of 72-128
# (4 CTAs per SM instead of 7; bench/NOTES.md §22). NINFER_X16_ALIGN=1 keeps the unpadded rows (comparison runs);
# read once, here, and checked where the runtime starts (`align_env_error`).
ALIGN_ENV = "NINFER_X16_ALIGN"
_ALIGNS = ("16", "1")
ROW_ALIGN = int(switch_value(ALIGN_ENV, _ALIGNS))
_CHUNK, _UP, _EMIN, _EMAX, _ALIGN = (tl.constexpr(v) for v in (CHUNK, UP_FIELD, E_MIN, E_MAX, ROW_ALIGN))


def align_env_error() -> str | None:
    """None, or a one-line message when NINFER_X16_ALIGN holds anything but 16 or 1."""
    return switch_error(ALIGN_ENV, _ALIGNS)


def words_per_row(K: int) -> int:
    """Words of one prepared row of K activations (the layout above)."""
    return K // 2 + K // CHUNK


def row_stride(K: int) -> int:
    """Words from one prepared row to the next in buffers this package allocates (`empty_prepared`)."""
    return -(-words_per_row(K) // ROW_ALIGN) * ROW_ALIGN


def empty_prepared(rows: int, K: int, device) -> torch.Tensor:
    """An uninitialised int32 [rows, words_per_row(K)] buffer whose rows are `row_stride(K)` words apart."""
    return torch.empty((rows, row_stride(K)), dtype=torch.int32, device=device)[:, :words_per_row(K)]


@triton.jit
def row_stride_words(K):
    """`row_stride` inside a kernel."""
    return (K // 2 + K // _CHUNK + _ALIGN - 1) // _ALIGN * _ALIGN


@triton.jit
def store_prepared(v, row_ptr, e0, n_elems, K):
    """Store activations e0, e0 + 1, .. (e0 a multiple of 128) of one prepared row (`row_ptr`: int32 pointer to
    its word 0) from v, fp32 [a multiple of 128] holding them as the producer's output dtype rounds them; chunks
    past the first `n_elems` activations are not written (a producer's tail block or padding). Shared by the
    prep kernel and the producers that write the prepared copy beside their output (rmsnorm, silu_mul,
    sigmoid_mul, gated_rmsnorm). The back factor's fp32 exponent field is E - 13: back = 2**(E - 140)."""
    NCH: tl.constexpr = v.shape[0] // _CHUNK
    v2 = tl.reshape(v, [NCH, _CHUNK])
    e = (tl.max(tl.abs(v2), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.minimum(tl.maximum(e, _EMIN.value), _EMAX.value)
    up = ((_UP.value - e) << 23).to(tl.float32, bitcast=True)
    h = (v2 * up[:, None]).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    lo, hi = tl.split(tl.permute(tl.reshape(h, [NCH * (_CHUNK // 8), 2, 4]), (0, 2, 1)))
    words = tl.reshape(lo | (hi << 16), [NCH * (_CHUNK // 2)])
    w = tl.arange(0, NCH * (_CHUNK // 2))
    tl.store(row_ptr + e0 // 2 + w, words, mask=w < n_elems // 2)
    c = tl.arange(0, NCH)
    tl.store(row_ptr + K // 2 + e0 // _CHUNK + c, (e + (254 - _UP.value)) << 23, mask=c < n_elems // _CHUNK)
