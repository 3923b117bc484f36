"""`TritonOps`: the GPU backend — Triton kernels from `ninfer_kernels` for every op.

- linear: `ninfer_kernels.dispatch.linear` (every stored weight format) when that module is present,
  otherwise the torch reference's dequantize-and-matmul (see `LINEAR_BACKEND`).
- attention: the paged split-KV kernel for decode / verify / short chunks and inside CUDA-graph capture; long
  prefill chunks go to torch's scaled_dot_product_attention (`prefill_attn.py`, NINFER_PREFILL_ATTN=paged
  turns that off).
- gdn_chunk (prefill): flash-linear-attention's `chunk_gated_delta_rule` on CUDA when `fla` imports, the
  activations are fp16/bf16 and no CUDA graph is being captured (`fla_gdn.py`); otherwise our token-by-token
  kernel over the chunk (same math, one program per (sequence, value head, dv tile) walking the tokens).
- embedding of a quantized table: the torch reference (dequantizes only the batch's rows).

Kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1 set before
this module is imported), which is how the CPU tests exercise them.
"""
from __future__ import annotations

import importlib
import os

import torch

from ninfer_formats.errors import LoadError
from ninfer_kernels import (attention_decode, gated_rmsnorm, gdn_ba_gates, gdn_conv, gdn_conv_recurrent, gdn_gates,
                            gdn_recurrent, gemv_common, gemv_pins, gemv_split, kv_write, rmsnorm, rmsnorm_gates, rope,
                            sampling, silu_mul, x16)
from ninfer_kernels.ops_common import interpreting
from ninfer_kernels.pdl import pdl_kw

from ..ops import AttnMeta, Branch, GdnMeta, Ops
from ..weights import QWeight
from . import fla_gdn, prefill_attn, side_stream
from .prepared import PreparedMemo
from .torch_ops import TorchOps


def _dispatch():
    try:
        return importlib.import_module("ninfer_kernels.dispatch")
    except ModuleNotFoundError as e:
        if e.name != "ninfer_kernels.dispatch":
            raise
        return None


_DISPATCH = _dispatch()
_LINEAR = _DISPATCH.linear if _DISPATCH is not None else None
LINEAR_BACKEND = "ninfer_kernels.dispatch" if _LINEAR is not None else "torch-reference"


SWIGLU_ENV = "NINFER_SWIGLU_EPILOGUE"


def swiglu_epilogue_env() -> str:
    """NINFER_SWIGLU_EPILOGUE: 'auto' (the default: the GEMV's SwiGLU epilogue, `ninfer_kernels.gemv_glu`, on CUDA
    devices whose launches do not use PDL), '1' (always) or '0' (never: gate/up GEMV, then the silu_mul kernel).
    On the H200 with PDL the epilogue lost, decode +0.5 % and verify K=3 +3-5 % (its finishing CTAs add a
    dependent L2 round trip to the GEMV's tail, while the silu_mul launch it saves overlaps that tail anyway);
    without PDL it won, decode -0.3 % (bench/NOTES.md §21-§22). Anything else is a one-line error naming the
    variable."""
    v = os.environ.get(SWIGLU_ENV, "auto")
    if v not in ("auto", "0", "1"):
        raise LoadError(f"{SWIGLU_ENV}={v!r}: expected auto, 0 or 1")
    return v


def swiglu_epilogue_on(mode: str, device) -> bool:
    """Whether NINFER_SWIGLU_EPILOGUE's `mode` turns the epilogue on for linear layers on `device`."""
    if mode == "auto":
        return getattr(device, "type", None) == "cuda" and not pdl_kw(device)
    return mode == "1"


def _row_len(t: torch.Tensor) -> int:
    return t.numel() // t.shape[0] if t.shape[0] else 0


class TritonOps(Ops):
    name = "triton"

    def __init__(self, xpre: bool | None = None):
        """xpre: the norms and gates in front of linear layers also write their output's prepared form
        (`ninfer_kernels.x16`, `prepared.py`), which the f16 GEMV variants read; None = NINFER_XPRE (auto: on for
        CUDA devices of compute capability 8.0 or later, where it was measured faster)."""
        if not torch.cuda.is_available():
            from triton.runtime.interpreter import InterpretedFunction
            if not (interpreting() and isinstance(rmsnorm.rmsnorm_kernel, InterpretedFunction)):
                raise LoadError("--backend triton: needs a CUDA device, or TRITON_INTERPRET=1 set before "
                                "ninfer_kernels is first imported (CPU interpreter)")
        # the prefill switches are read per call; checking them here makes a bad value fail at startup
        prefill_attn.mode()
        side_stream.mode()
        side_stream.join_at()
        gdn_conv_recurrent.fused_on()
        attention_decode.min_split_keys()
        rmsnorm.norm_warps(1024)
        if _DISPATCH is not None:
            _DISPATCH.prefill_path_env()
            _DISPATCH.tune_mode()
        # "auto" | "1" | "0" (NINFER_XPRE's values); the GEMVs that read prepared input come with the dispatch
        self.xpre = ("1" if xpre else "0") if xpre is not None else x16.xpre_env() if _DISPATCH is not None else "0"
        for err in (x16.align_env_error(), gemv_split.split_unroll_env_error(), gemv_pins.pins_env_error(),
                    gemv_split.split_arrive_env_error(), gemv_common.weight_evict_env_error()):
            if err:
                raise LoadError(err)
        self._memo = PreparedMemo()
        self._ref = TorchOps()
        self.swiglu_epilogue = swiglu_epilogue_env() if _DISPATCH is not None else "0"   # a mode, as self.xpre
        self._swiglu_on: dict = {}     # device -> the mode's answer there (pdl_kw reads the environment)

    def _wants_prepared(self, rows: int, K: int, device) -> bool:
        """Whether a producer of [rows, K] should also write its prepared copy (a linear layer may read it)."""
        return PreparedMemo.wanted(rows, K) and x16.xpre_on(self.xpre, device)

    def _prepared_out(self, rows: int, K: int, device) -> torch.Tensor | None:
        """A buffer for a producer's prepared copy when a linear layer may read it, else None."""
        return PreparedMemo.buffer(rows, K, device) if self._wants_prepared(rows, K, device) else None

    def _produced(self, y, xp):
        if xp is not None:
            self._memo.remember(y, xp)
        return y

    # ---- dense ----
    def _prepared_in(self, x, w):
        """x's prepared form when a producer left one that the linear layer `w` can read, else None."""
        if self.xpre != "0" and isinstance(w, QWeight):
            xp = self._memo.find(x)
            if xp is not None and x16.prepared_ok(w, xp.shape[0], x.device):
                return xp
        return None

    def repack_growth(self, weights: dict) -> int:
        """The IQ3_S 4-bit code planes are 22 % larger than the blocks they replace (`dispatch.prepare_growth`)."""
        if _DISPATCH is None:
            return 0
        return sum(_DISPATCH.prepare_growth(w) for w in weights.values() if isinstance(w, QWeight))

    def linear(self, x, w):
        if _LINEAR is None:
            return self._ref.linear(x, w)
        xp = self._prepared_in(x, w)
        return _LINEAR(x, w) if xp is None else _LINEAR(x, w, xp=xp)

    def linear_swiglu(self, x, w):
        """The gate/up GEMV's SwiGLU epilogue (`ninfer_kernels.gemv_glu`: no silu_mul launch) where the GEMV
        serves the call (decode and verify rows) and NINFER_SWIGLU_EPILOGUE turns it on for x's device; else linear
        + silu_mul."""
        on = self._swiglu_on.get(x.device)
        if on is None:
            on = self._swiglu_on[x.device] = swiglu_epilogue_on(self.swiglu_epilogue, x.device)
        if not on or x.dim() != 2 or not isinstance(w, QWeight) or not _DISPATCH.swiglu_fusable(x.shape[0], w):
            return super().linear_swiglu(x, w)
        glu = _DISPATCH.linear_swiglu(x, w, xp=self._prepared_in(x, w),
                                      prepared=self._wants_prepared(x.shape[0], w.shape[0] // 2, x.device))
        return self._produced(glu.y, glu.xp)

    def embedding(self, ids, table, dtype):
        if isinstance(table, QWeight):
            if table.quantized:
                return self._ref.embedding(ids, table, dtype)
            table = table.data["w"]
        return table.index_select(0, ids).to(dtype)

    def rmsnorm(self, x, w, eps, plus_one):
        xp = self._prepared_out(x.numel() // max(x.shape[-1], 1), x.shape[-1], x.device)
        return self._produced(rmsnorm.rmsnorm(x, w, eps, plus_one, xp=xp), xp)

    def add_rmsnorm(self, x, residual, w, eps, plus_one=True):
        xp = self._prepared_out(x.numel() // max(x.shape[-1], 1), x.shape[-1], x.device)
        y, s = rmsnorm.add_rmsnorm(x, residual, w, eps, plus_one, xp=xp)
        return self._produced(y, xp), s

    def gated_rmsnorm(self, o, z, w, eps):
        # [T, Hv, dv]: the linear reads a token's Hv * dv outputs as one row; a program owns whole chunks of it
        ok = o.dim() == 3 and o.shape[-1] % x16.CHUNK == 0
        xp = self._prepared_out(o.shape[0], _row_len(o), o.device) if ok else None
        return self._produced(gated_rmsnorm.gated_rmsnorm(o, z, w, eps, xp=xp), xp)

    def silu_mul(self, gate_up):
        xp = self._prepared_out(gate_up.shape[0], gate_up.shape[-1] // 2, gate_up.device)
        return self._produced(silu_mul.silu_mul(gate_up, xp=xp), xp)

    def sigmoid_gate(self, o, gate):
        xp = self._prepared_out(o.shape[0], _row_len(o), o.device) if o.dim() in (2, 3) else None
        return self._produced(silu_mul.sigmoid_mul(o, gate, xp=xp), xp)

    # ---- attention ----
    def rope(self, q, k, positions, rotary_dim, theta, mrope_section=None):
        return rope.rope(q, k, positions, rotary_dim, theta, mrope_section)

    def qk_norm_rope(self, q, k, q_w, k_w, eps, positions, rotary_dim, theta, mrope_section=None):
        return rope.rope(q, k, positions, rotary_dim, theta, mrope_section, norm=(q_w, k_w, eps))

    def kv_write(self, k_cache, v_cache, k, v, slot_mapping):
        kv_write.kv_write(k_cache, v_cache, k, v, slot_mapping)

    def qk_norm_rope_store(self, q, k, v, q_w, k_w, eps, positions, rotary_dim, theta, mrope_section, k_cache,
                           v_cache, slot_mapping):
        return rope.qk_norm_rope_store(q, k, v, positions, rotary_dim, theta, mrope_section, (q_w, k_w, eps),
                                       k_cache, v_cache, slot_mapping)

    def attention(self, q, k_cache, v_cache, meta: AttnMeta, scale):
        if prefill_attn.wants_sdpa(q.device, q.dtype, meta):
            out = prefill_attn.try_prefill_attention(q, k_cache, v_cache, meta, scale)
            if out is not None:
                return out
        return attention_decode.paged_attention(q, k_cache, v_cache, meta.cu_seqlens, meta.kv_lens_t,
                                                meta.block_tables, meta.page_size, scale, meta.max_q_len,
                                                meta.max_kv_len)

    def gated_attention(self, q, k_cache, v_cache, meta: AttnMeta, scale, gate):
        if prefill_attn.wants_sdpa(q.device, q.dtype, meta):
            return super().gated_attention(q, k_cache, v_cache, meta, scale, gate)
        xp = self._prepared_out(q.shape[0], q.shape[1] * q.shape[2], q.device)
        out, xp = attention_decode.gated_attention(q, k_cache, v_cache, meta.cu_seqlens, meta.kv_lens_t,
                                                   meta.block_tables, meta.page_size, scale, meta.max_q_len,
                                                   meta.max_kv_len, gate, xp)
        return self._produced(out, xp)

    # ---- gated deltanet ----
    def causal_conv(self, x, w, conv_pool, meta: GdnMeta, snapshots=None):
        return gdn_conv.causal_conv(x, w, conv_pool, meta.cu_seqlens, meta.slots, meta.snap_index,
                                    max(meta.seq_lens), snapshots)

    def gdn_gates(self, a, b, A_log, dt_bias):
        return gdn_gates.gdn_gates(a, b, A_log, dt_bias)

    def gdn_ba_gates(self, x, w_ba, A_log, dt_bias):
        w = None if w_ba.quantized else w_ba.data["w"]
        if w is not None and gdn_ba_gates.supported(x, w):       # decode / verify with a plain b/a weight
            return gdn_ba_gates.gdn_ba_gates(x, w, A_log, dt_bias)
        return super().gdn_ba_gates(x, w_ba, A_log, dt_bias)

    def norm_ba_gates(self, x, residual, w, eps, w_ba, A_log, dt_bias):
        wt = None if w_ba.quantized else w_ba.data["w"]
        fused = (side_stream.join_at() == "norm" and wt is not None and x.shape[0] <= rmsnorm_gates.BACKEND_MAX_T
                 and rmsnorm_gates.supported(x, wt, residual))
        if not fused:
            return super().norm_ba_gates(x, residual, w, eps, w_ba, A_log, dt_bias)
        xp = self._prepared_out(x.shape[0], x.shape[1], x.device)
        y, s, g, beta = rmsnorm_gates.add_rmsnorm_gates(x, residual, w, eps, wt, A_log, dt_bias, xp=xp)
        return self._produced(y, xp), s, Branch((g, beta))

    def gdn_ba_gates_branch(self, x, w_ba, A_log, dt_bias):
        w = None if w_ba.quantized else w_ba.data["w"]
        if w is None or not gdn_ba_gates.supported(x, w):
            # the composed path runs a GEMV, whose split-K workspace is one per device: never beside another
            return Branch(self.gdn_ba_gates(x, w_ba, A_log, dt_bias))
        return side_stream.branch(lambda: gdn_ba_gates.gdn_ba_gates(x, w, A_log, dt_bias))

    def gdn_recurrent(self, q, k, v, g, beta, state_pool, meta: GdnMeta, snapshots=None):
        return gdn_recurrent.gdn_recurrent(q, k, v, g, beta, state_pool, meta.cu_seqlens, meta.slots,
                                           meta.snap_index, snapshots, max(meta.seq_lens, default=1))

    def gdn_conv_recurrent(self, qkv, conv_w, conv_pool, gates: Branch, state_pool, meta: GdnMeta,
                           conv_snapshots=None, snapshots=None):
        if not gdn_conv_recurrent.fused_on():
            if side_stream.join_at() == "conv":     # the comparison order (NINFER_GATES_JOIN): join, then the conv
                gates = Branch(gates.join())
            return super().gdn_conv_recurrent(qkv, conv_w, conv_pool, gates, state_pool, meta, conv_snapshots,
                                              snapshots)
        g, beta = gates.join()
        o = gdn_conv_recurrent.conv_recurrent(qkv, conv_w, conv_pool, g, beta, state_pool, meta.cu_seqlens,
                                              meta.slots, meta.snap_index, conv_snapshots, snapshots)
        # the q / k conv windows, which every program of a key head read: after the fused kernel, beside the
        # layer's next kernels in a captured step
        done = side_stream.branch(lambda: gdn_conv_recurrent.advance_qk_windows(
            qkv, conv_pool, state_pool, meta.cu_seqlens, meta.slots, meta.snap_index, conv_snapshots,
            max(meta.seq_lens, default=1)))
        return o, done

    def gdn_chunk(self, q, k, v, g, beta, state_pool, meta: GdnMeta):
        if any(i >= 0 for i in meta.snap_index_host):
            raise ValueError("gdn_chunk: snapshots are only produced by gdn_recurrent")
        fla = fla_gdn.load() if fla_gdn.wanted(v.device, v.dtype) else None
        if fla is None:
            return self.gdn_recurrent(q, k, v, g, beta, state_pool, meta)
        return fla(q, k, v, g, beta, state_pool, meta)

    def gdn_prefill_impl(self) -> str | None:
        """'fla' or 'recurrent' once a CUDA prefill in this process has chosen, else None (benchmarks record it)."""
        return fla_gdn.decided()

    # ---- extras (not in the Ops interface) ----
    def argmax_partial(self, logits: torch.Tensor, vocab_offset: int = 0):
        """(max, global index, all-reduce-MAX key) per row of this rank's vocab shard; see ninfer_kernels.sampling."""
        return sampling.argmax_partial(logits, vocab_offset)
