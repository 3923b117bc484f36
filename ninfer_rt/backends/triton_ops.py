"""`TritonOps`: the GPU backend — Triton kernels from `ninfer_kernels` for every op.

- linear: `ninfer_kernels.dispatch.linear` (every stored weight format) when that module is present,
  otherwise the torch reference's dequantize-and-matmul (see `LINEAR_BACKEND`).
- attention: the paged split-KV kernel for decode / verify / short chunks; long prefill chunks go to torch's
  scaled_dot_product_attention (`prefill_attn.py`, NINFER_PREFILL_ATTN=paged turns that off).
- gdn_chunk (prefill): flash-linear-attention's `chunk_gated_delta_rule` on CUDA when `fla` imports and the
  activations are fp16/bf16 (`fla_gdn.py`); otherwise our token-by-token kernel over the chunk (same math,
  one program per (sequence, value head, dv tile) walking the tokens).
- embedding of a quantized table: the torch reference (dequantizes only the batch's rows).

Kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1 set before
this module is imported), which is how the CPU tests exercise them.
"""
from __future__ import annotations

import importlib
import sys

import torch

from ninfer_formats.errors import LoadError
from ninfer_kernels import (attention_decode, gated_rmsnorm, gdn_conv, gdn_gates, gdn_recurrent, kv_write,
                            rmsnorm, rope, sampling, silu_mul)
from ninfer_kernels.ops_common import interpreting

from ..ops import AttnMeta, GdnMeta, Ops
from ..weights import QWeight
from . import fla_gdn, prefill_attn
from .torch_ops import TorchOps


def _dispatch_linear():
    try:
        return importlib.import_module("ninfer_kernels.dispatch").linear
    except ModuleNotFoundError as e:
        if e.name != "ninfer_kernels.dispatch":
            raise
        return None


_LINEAR = _dispatch_linear()
LINEAR_BACKEND = "ninfer_kernels.dispatch" if _LINEAR is not None else "torch-reference"


class TritonOps(Ops):
    name = "triton"

    def __init__(self):
        if not torch.cuda.is_available():
            from triton.runtime.interpreter import InterpretedFunction
            if not (interpreting() and isinstance(rmsnorm.rmsnorm_kernel, InterpretedFunction)):
                raise LoadError("--backend triton: needs a CUDA device, or TRITON_INTERPRET=1 set before "
                                "ninfer_kernels is first imported (CPU interpreter)")
        self._ref = TorchOps()
        self._fla = None
        self._fla_checked = False

    # ---- dense ----
    def linear(self, x, w):
        if _LINEAR is None:
            return self._ref.linear(x, w)
        return _LINEAR(x, w)

    def embedding(self, ids, table, dtype):
        if isinstance(table, QWeight):
            if table.quantized:
                return self._ref.embedding(ids, table, dtype)
            table = table.data["w"]
        return table.index_select(0, ids).to(dtype)

    def rmsnorm(self, x, w, eps, plus_one):
        return rmsnorm.rmsnorm(x, w, eps, plus_one)

    def add_rmsnorm(self, x, residual, w, eps, plus_one=True):
        return rmsnorm.add_rmsnorm(x, residual, w, eps, plus_one)

    def gated_rmsnorm(self, o, z, w, eps):
        return gated_rmsnorm.gated_rmsnorm(o, z, w, eps)

    def silu_mul(self, gate_up):
        return silu_mul.silu_mul(gate_up)

    def sigmoid_gate(self, o, gate):
        return silu_mul.sigmoid_mul(o, gate)

    # ---- attention ----
    def rope(self, q, k, positions, rotary_dim, theta, mrope_section=None):
        return rope.rope(q, k, positions, rotary_dim, theta, mrope_section)

    def kv_write(self, k_cache, v_cache, k, v, slot_mapping):
        kv_write.kv_write(k_cache, v_cache, k, v, slot_mapping)

    def attention(self, q, k_cache, v_cache, meta: AttnMeta, scale):
        if prefill_attn.wants_sdpa(q, meta):
            out = prefill_attn.try_prefill_attention(q, k_cache, v_cache, meta, scale)
            if out is not None:
                return out
        return attention_decode.paged_attention(q, k_cache, v_cache, meta.cu_seqlens, meta.kv_lens_t,
                                                meta.block_tables, meta.page_size, scale, meta.max_q_len,
                                                meta.max_kv_len)

    # ---- gated deltanet ----
    def causal_conv(self, x, w, conv_pool, meta: GdnMeta, snapshots=None):
        return gdn_conv.causal_conv(x, w, conv_pool, meta.cu_seqlens, meta.slots, meta.snap_index,
                                    max(meta.seq_lens), snapshots)

    def gdn_gates(self, a, b, A_log, dt_bias):
        return gdn_gates.gdn_gates(a, b, A_log, dt_bias)

    def gdn_recurrent(self, q, k, v, g, beta, state_pool, meta: GdnMeta, snapshots=None):
        return gdn_recurrent.gdn_recurrent(q, k, v, g, beta, state_pool, meta.cu_seqlens, meta.slots,
                                           meta.snap_index, snapshots)

    def gdn_chunk(self, q, k, v, g, beta, state_pool, meta: GdnMeta):
        if any(i >= 0 for i in meta.snap_index_host):
            raise ValueError("gdn_chunk: snapshots are only produced by gdn_recurrent")
        fla = self._fla_fn() if v.is_cuda and v.dtype in (torch.float16, torch.bfloat16) else None
        if fla is None:
            return self.gdn_recurrent(q, k, v, g, beta, state_pool, meta)
        return fla(q, k, v, g, beta, state_pool, meta)

    def _fla_fn(self):
        if not self._fla_checked:         # only ever imported for CUDA inputs (see fla_gdn.py)
            self._fla, self._fla_checked = fla_gdn.load(), True
            if self._fla is None:         # the fallback is correct but ~15x slower on long prompts: say so once
                print("ninfer-rt: flash-linear-attention (fla) is not importable; GDN prefill uses the "
                      "token-by-token kernel (slow for long prompts: pip install flash-linear-attention)",
                      file=sys.stderr)
        return self._fla

    def gdn_prefill_impl(self) -> str | None:
        """'fla' or 'recurrent' once a CUDA prefill has chosen, else None (benchmarks record it)."""
        return None if not self._fla_checked else ("fla" if self._fla is not None else "recurrent")

    # ---- extras (not in the Ops interface) ----
    def argmax_partial(self, logits: torch.Tensor, vocab_offset: int = 0):
        """(max, global index, all-reduce-MAX key) per row of this rank's vocab shard; see ninfer_kernels.sampling."""
        return sampling.argmax_partial(logits, vocab_offset)
