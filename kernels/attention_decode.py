"""Paged causal GQA attention over the KV pool (decode, MTP verify, and long prefill too).

Work split: one program per (sequence, KV head, block of BLOCK_M query rows, KV split). The rows of a
(sequence, KV head) are the G = Hq / Hk query heads of that group times the T new columns, row r = t * G + g,
so every K/V tile loaded from the pool is shared by the whole GQA group (decode T = 1 still fills G rows).
Keys are gathered page by page through the block table; column t of a sequence with L cached tokens sits
at position L - T + t and sees keys 0..L - T + t. Softmax is online, fp32, in base 2.

Split-KV (flash-decoding): with few programs and long contexts the key range is cut into up to `num_splits`
pieces; each writes its normalised partial output and log-sum-exp, and `attn_combine_kernel` merges them.
The host fixes the number of splits (from the largest context it serves: a CUDA graph's KV bucket); each
program sizes its piece from the sequence's actual length on the device (at least `min_split` keys), so a 1K
context in a graph captured for 32K still spreads over the splits instead of leaving most of them idle. Splits
past the keys write only a log-sum-exp of -inf, which the combine skips.

Output gate (`gated_attention`): where the output is stored (the combine, or the single-split store) it is
multiplied by sigmoid(gate) after rounding to the activation dtype, exactly as `sigmoid_mul` of the stored
attention output would; the combine also writes the gated rows' prepared form (`ninfer_kernels.x16`) for the
o_proj GEMV when D is a multiple of 128. One launch (sigmoid_mul's) fewer per attention layer.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .ops_common import KernelInputError, dot_precision, num_sms, pow2
from .pdl import pdl_enter, pdl_kw, pdl_trigger, pdl_wait
from .x16 import CHUNK, check_prepared_out, prepared_out_args, store_prepared

BLOCK_N = 32              # keys per inner step (tensor-core tiles; split lengths are multiples of it)
MAX_BLOCK_M = 64          # query rows per program (tensor-core tiles)
MIN_SPLIT_KEYS = 64       # never cut a sequence's key range finer than this (two BLOCK_N steps)
MIN_SPLIT_ENV = "NINFER_ATTN_MIN_SPLIT"     # overrides MIN_SPLIT_KEYS (a comparison switch for benchmarks)
LOG2E = 1.4426950408889634


@triton.jit
def attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, po_ptr, plse_ptr, cu_ptr, kvlen_ptr, bt_ptr, g_ptr,
                    sq_t, sq_h, so_t, so_h, sk_s, sk_h, sv_s, sv_h, bt_stride, sg_t, sg_h, total_rows,
                    Hk, G, n_mblocks, min_split, scale_log2, D,
                    PAGE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr, GATE: tl.constexpr = 0,
                    PDL: tl.constexpr = 0, D_CHUNK: tl.constexpr = 0):
    # D_CHUNK (0 = BLOCK_D): head-dim columns per tl.dot (`d_chunk`: narrower where tl.dot runs on FMAs)
    pdl_enter(PDL)   # ninfer_kernels.pdl: before any load or store
    pid = tl.program_id(0)
    split = tl.program_id(1)
    mb = pid % n_mblocks
    kvh = (pid // n_mblocks) % Hk
    b = pid // (n_mblocks * Hk)
    q0 = tl.load(cu_ptr + b)
    T = tl.load(cu_ptr + b + 1) - q0
    L = tl.load(kvlen_ptr + b)
    if mb * BLOCK_M < G * T:
        rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        t = rows // G
        head = kvh * G + rows % G
        row_ok = t < T
        qpos = L - T + t
        DC: tl.constexpr = D_CHUNK if D_CHUNK else BLOCK_D
        NC: tl.constexpr = BLOCK_D // DC
        tl.static_assert(NC * DC == BLOCK_D)
        d = tl.arange(0, DC)
        tok = (q0 + t).to(tl.int64)
        qs = ()
        for c in tl.static_range(NC):
            qs = qs + (tl.load(q_ptr + (tok * sq_t + head * sq_h)[:, None] + (c * DC + d)[None, :],
                               mask=row_ok[:, None] & (c * DC + d < D)[None, :], other=0.0),)
        t_last = tl.minimum(T - 1, (mb * BLOCK_M + BLOCK_M - 1) // G)
        keys = L - T + t_last + 1                 # keys the block's last row sees (>= 1)
        if SPLIT:
            n_act = tl.minimum(tl.num_programs(1), tl.cdiv(keys, min_split))
            split_len = tl.cdiv(tl.cdiv(keys, n_act), BLOCK_N) * BLOCK_N
            lo = split * split_len
            hi = tl.minimum(lo + split_len, keys)
        else:
            lo = 0
            hi = keys
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        accs = ()
        for c in tl.static_range(NC):
            accs = accs + (tl.zeros([BLOCK_M, DC], tl.float32),)
        bt_row = bt_ptr + b.to(tl.int64) * bt_stride
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            page = tl.load(bt_row + n // PAGE, mask=n_ok, other=0).to(tl.int64)
            slot = page * PAGE + n % PAGE
            for c in tl.static_range(NC):
                k = tl.load(k_ptr + (slot * sk_s + kvh * sk_h)[:, None] + (c * DC + d)[None, :],
                            mask=n_ok[:, None] & (c * DC + d < D)[None, :], other=0.0)
                if c == 0:
                    s = tl.dot(qs[0], tl.trans(k), input_precision=PREC)
                else:
                    s += tl.dot(qs[c], tl.trans(k), input_precision=PREC)
            s = s * scale_log2
            s = tl.where((n[None, :] <= qpos[:, None]) & n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)     # rows with no visible key yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            new = ()
            for c in tl.static_range(NC):
                v = tl.load(v_ptr + (slot * sv_s + kvh * sv_h)[:, None] + (c * DC + d)[None, :],
                            mask=n_ok[:, None] & (c * DC + d < D)[None, :], other=0.0)
                new = new + (accs[c] * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC),)
            accs = new
            m_i = m_new
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        if SPLIT:
            # partials: po [splits, total_rows, Hq, D] fp32, plse [splits, total_rows, Hq] (log2 units); a split
            # past the keys stores only its -inf
            prow = (split * total_rows + tok) * (G * Hk) + head
            if lo < hi:
                for c in tl.static_range(NC):
                    tl.store(po_ptr + (prow * D)[:, None] + (c * DC + d)[None, :], accs[c] / l_safe[:, None],
                             mask=row_ok[:, None] & (c * DC + d < D)[None, :])
            tl.store(plse_ptr + prow, tl.where(empty, float("-inf"), m_i + tl.log2(l_safe)), mask=row_ok)
        else:
            for c in tl.static_range(NC):
                omask = row_ok[:, None] & (c * DC + d < D)[None, :]
                y = (accs[c] / l_safe[:, None]).to(o_ptr.dtype.element_ty)
                if GATE:
                    y = _gated(y, g_ptr + (tok * sg_t + head * sg_h)[:, None] + (c * DC + d)[None, :], omask)
                tl.store(o_ptr + (tok * so_t + head * so_h)[:, None] + (c * DC + d)[None, :], y, mask=omask)


@triton.jit
def _gated(y, g_ptrs, mask):
    """y * sigmoid(gate) in fp32, rounded to y's dtype (`silu_mul.sigmoid_mul` of the stored y)."""
    g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    return (y.to(tl.float32) * tl.sigmoid(g)).to(y.dtype)


@triton.jit
def attn_combine_kernel(po_ptr, plse_ptr, o_ptr, g_ptr, xp_ptr, so_t, so_h, sg_t, sg_h, s_xp, n_splits, total_rows,
                        Hq, D, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, GATE: tl.constexpr = 0,
                        XP: tl.constexpr = 0, PDL: tl.constexpr = 0, LATE: tl.constexpr = 0):
    """Merge the splits of one (token, head), BLOCK_S splits per load: each chunk is one vector load of the
    log-sum-exps and one [BLOCK_S, BLOCK_D] load of the partials (a split-at-a-time loop waited on two dependent
    loads per split, ~8 us at 17 splits on the H200). The maximum pass stays: a one-pass online merge, which
    also loads the partials of splits without keys, measured the same at decode and +1 us per launch at verify
    K = 3 (bench/NOTES.md §25). LATE (NINFER_PDL_LATE, verify steps): the trigger follows the merge."""
    if not LATE:
        pdl_trigger(PDL)
    pdl_wait(PDL)   # ninfer_kernels.pdl: before any load or store
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    m = tl.load(plse_ptr + tok * Hq + h)        # split 0 always holds key 0, so m is finite
    for s0 in range(0, n_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        m = tl.maximum(m, tl.max(tl.load(plse_ptr + (s * total_rows + tok) * Hq + h, mask=s < n_splits,
                                         other=float("-inf")), axis=0))
    den = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        row = (s * total_rows + tok) * Hq + h
        lse = tl.load(plse_ptr + row, mask=s < n_splits, other=float("-inf"))
        w = tl.exp2(lse - m)
        den += w
        # a split without keys for this row wrote no partial output (stale memory): not even loaded
        live = (lse > float("-inf"))[:, None] & d_ok[None, :]
        acc += tl.sum(w[:, None] * tl.load(po_ptr + (row * D)[:, None] + d[None, :], mask=live, other=0.0), axis=0)
    y = (acc / tl.sum(den, axis=0)).to(o_ptr.dtype.element_ty)
    if GATE:
        y = _gated(y, g_ptr + tok * sg_t + h * sg_h + d, d_ok)
    if LATE:
        pdl_trigger(PDL)
    tl.store(o_ptr + tok * so_t + h * so_h + d, y, mask=d_ok)
    if XP:          # the token's row of the o_proj input is its Hq heads' D outputs; this program owns D of them
        store_prepared(y.to(tl.float32), xp_ptr + tok * s_xp, h * D, D, Hq * D)


COMBINE_SPLITS = 16       # splits per load in attn_combine_kernel


@dataclass(frozen=True)
class Tiles:
    """The forward kernel's tile sizes for one kind of GPU."""
    block_n: int       # keys per inner step (divides BLOCK_N: split lengths stay multiples of both)
    max_block_m: int   # query rows per program
    d_chunk: int       # head-dim columns per tl.dot (0: the whole head)
    warps: int         # 0: 4 or 8 by tile size

    def num_warps(self, block_m: int, block_d: int) -> int:
        return self.warps or (4 if block_m * block_d <= 8192 else 8)


TC_TILES = Tiles(BLOCK_N, MAX_BLOCK_M, 0, 0)
# sm_70 (V100): tl.dot runs on FMAs, each thread holding its rows' whole reduction dimension, and the tensor-core
# tiles at head dim 256 compiled to 32 registers and 4.5-9.8 KB of spills per thread (ptxas, Triton 3.6); these
# compile without spills (128 registers, bench/NOTES.md §19)
FMA_TILES = Tiles(16, 32, 64, 16)


def tiles_for(device) -> Tiles:
    """FMA_TILES on CUDA devices below compute capability 8.0 (no tensor-core tl.dot), else TC_TILES."""
    if getattr(device, "type", "cpu") == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return FMA_TILES
    return TC_TILES


def min_split_keys() -> int:
    """NINFER_ATTN_MIN_SPLIT (default MIN_SPLIT_KEYS): the fewest keys per split, a positive multiple of BLOCK_N;
    anything else is a one-line error naming the variable."""
    v = os.environ.get(MIN_SPLIT_ENV, str(MIN_SPLIT_KEYS))
    if not v.isdigit() or int(v) <= 0 or int(v) % BLOCK_N:
        raise KernelInputError(f"{MIN_SPLIT_ENV}={v!r}: expected a positive multiple of {BLOCK_N}")
    return int(v)


def plan(batch: int, hk: int, g: int, max_q: int, max_kv: int, device, num_splits: int | None = None,
         min_split: int = MIN_SPLIT_KEYS, tiles: Tiles = TC_TILES):
    """-> (BLOCK_M, m-blocks per (sequence, KV head), splits) for contexts up to max_kv: no more splits than
    whole BLOCK_N-aligned pieces of max_kv (the kernel sizes each sequence's pieces from its own length)."""
    block_m = min(tiles.max_block_m, pow2(g * max_q, 16))
    n_mblocks = triton.cdiv(g * max_q, block_m)
    programs = batch * hk * n_mblocks
    if num_splits is None:
        # enough programs to fill the GPU twice (at 32K, 66 splits ran 0.25 ms per step faster than 33 on the
        # H200), never splits shorter than min_split
        want = triton.cdiv(2 * num_sms(device), programs)
        num_splits = max(1, min(want, max_kv // min_split))
    num_splits = max(1, min(num_splits, triton.cdiv(max(max_kv, 1), tiles.block_n)))
    split_len = triton.cdiv(triton.cdiv(max(max_kv, 1), num_splits), tiles.block_n) * tiles.block_n
    return block_m, n_mblocks, triton.cdiv(max(max_kv, 1), split_len)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens: torch.Tensor,
                    kv_lens: torch.Tensor, block_tables: torch.Tensor, page_size: int, scale: float,
                    max_q_len: int, max_kv_len: int, num_splits: int | None = None,
                    min_split: int | None = None) -> torch.Tensor:
    """q [sumT, Hq, D]; k/v_cache [num_pages, page_size, Hk, D]; cu_seqlens int32 [B+1]; kv_lens int32 [B]
    (cached tokens including the new ones); block_tables int32 [B, max_pages]. Returns [sumT, Hq, D]."""
    return _run(q, k_cache, v_cache, cu_seqlens, kv_lens, block_tables, page_size, scale, max_q_len, max_kv_len,
                num_splits, min_split, None, None)[0]


def gated_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens: torch.Tensor,
                    kv_lens: torch.Tensor, block_tables: torch.Tensor, page_size: int, scale: float,
                    max_q_len: int, max_kv_len: int, gate: torch.Tensor, xp: torch.Tensor | None = None,
                    num_splits: int | None = None, min_split: int | None = None):
    """`paged_attention` times sigmoid(gate) (gate [sumT, Hq, D], any strides: the model passes the gate half of
    its per-head [q | gate] projection) -> (out [sumT, Hq, D], xp or None): the prepared form of out's rows [sumT, Hq * D] goes into xp (int32
    [sumT, words_per_row(Hq * D)]) when the combine runs and D is a multiple of 128; None says it was not
    written (the single-split path stores [rows of heads] without it)."""
    if gate.shape != q.shape:
        raise KernelInputError(f"attention: gate {tuple(gate.shape)} does not match q {tuple(q.shape)}")
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    return _run(q, k_cache, v_cache, cu_seqlens, kv_lens, block_tables, page_size, scale, max_q_len, max_kv_len,
                num_splits, min_split, gate, xp)


def _run(q, k_cache, v_cache, cu_seqlens, kv_lens, block_tables, page_size, scale, max_q_len, max_kv_len,
         num_splits, min_split, gate, xp):
    total, hq, d = q.shape
    hk = k_cache.shape[2]
    if hq % hk or k_cache.shape[1] != page_size or k_cache.shape[3] != d or v_cache.shape != k_cache.shape:
        raise KernelInputError(f"attention: q {tuple(q.shape)} vs cache {tuple(k_cache.shape)} / page {page_size}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise KernelInputError("attention: the KV caches must be contiguous [num_pages, page_size, Hk, D]")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    batch = cu_seqlens.numel() - 1
    if total == 0 or batch == 0:
        return out, None
    g = hq // hk
    min_split = min_split or min_split_keys()
    tiles = tiles_for(q.device)
    block_m, n_mblocks, splits = plan(batch, hk, g, max_q_len, max_kv_len, q.device, num_splits, min_split, tiles)
    if splits > 1:
        po = torch.empty(splits, total, hq, d, dtype=torch.float32, device=q.device)
        plse = torch.empty(splits, total, hq, dtype=torch.float32, device=q.device)
    else:
        po = plse = out
    block_d = pow2(d, 16)
    gt, sg = (gate, gate.stride()[:2]) if gate is not None else (out, (0, 0))
    attn_fwd_kernel[(batch * hk * n_mblocks, splits)](
        q, k_cache, v_cache, out, po, plse, cu_seqlens, kv_lens, block_tables, gt,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), sg[0], sg[1], total, hk, g, n_mblocks,
        min_split, float(scale) * LOG2E, d, PAGE=page_size, BLOCK_D=block_d, BLOCK_M=block_m,
        BLOCK_N=tiles.block_n, SPLIT=splits > 1, PREC=dot_precision(q.dtype), GATE=gate is not None,
        D_CHUNK=min(tiles.d_chunk, block_d), num_warps=tiles.num_warps(block_m, block_d), **pdl_kw(q.device))
    if splits == 1:
        return out, None
    xp = xp if d % CHUNK == 0 else None
    if xp is not None:
        check_prepared_out(xp, total, hq * d, q.device, "attention")
    xp_ptr, s_xp = prepared_out_args(xp, out)
    attn_combine_kernel[(total, hq)](po, plse, out, gt, xp_ptr, out.stride(0), out.stride(1), sg[0], sg[1], s_xp,
                                     splits, total, hq, d, BLOCK_D=block_d, BLOCK_S=COMBINE_SPLITS,
                                     GATE=gate is not None, XP=xp is not None,
                                     num_warps=max(1, min(4, block_d // 64)),
                                     **pdl_kw(out.device, late="combine" if max_q_len > 1 else ""))
    return out, xp


def compile_specs(act: str, cc: int = 90):
    fwd = {"q_ptr": f"*{act}", "k_ptr": f"*{act}", "v_ptr": f"*{act}", "o_ptr": f"*{act}", "po_ptr": "*fp32",
           "plse_ptr": "*fp32", "cu_ptr": "*i32", "kvlen_ptr": "*i32", "bt_ptr": "*i32", "g_ptr": f"*{act}",
           **{n: "i64" for n in ("sq_t", "sq_h", "so_t", "so_h", "sk_s", "sk_h", "sv_s", "sv_h", "bt_stride",
                                 "sg_t", "sg_h")},
           "total_rows": "i32", "Hk": "i32", "G": "i32", "n_mblocks": "i32", "min_split": "i32",
           "scale_log2": "fp32", "D": "i32"}
    comb = {"po_ptr": "*fp32", "plse_ptr": "*fp32", "o_ptr": f"*{act}", "g_ptr": f"*{act}", "xp_ptr": "*i32",
            "so_t": "i64", "so_h": "i64", "sg_t": "i64", "sg_h": "i64", "s_xp": "i64", "n_splits": "i32",
            "total_rows": "i32", "Hq": "i32", "D": "i32"}
    prec = "ieee" if act == "fp32" else "tf32"
    tiles = FMA_TILES if cc < 80 else TC_TILES
    return [(attn_fwd_kernel, fwd, {"PAGE": 16, "BLOCK_D": 256, "BLOCK_M": bm, "BLOCK_N": tiles.block_n,
                                    "SPLIT": sp, "PREC": prec, "GATE": gt, "D_CHUNK": tiles.d_chunk},
             tiles.num_warps(bm, 256))
            for bm, sp, gt in ((16, True, False), (tiles.max_block_m, False, False), (tiles.max_block_m, False, True))] + \
           [(attn_combine_kernel, comb, {"BLOCK_D": 256, "BLOCK_S": COMBINE_SPLITS, "GATE": gt, "XP": gt,
                                         "LATE": late})                # LATE: verify steps (NINFER_PDL_LATE)
            for gt, late in ((False, 0), (True, 0), (True, 1))]

