"""The one ops interface the model calls; backends (torch reference, Triton) implement every method.

Conventions shared by all methods:
- Sequences are packed along the first axis: a batch of B sequences with T_b new tokens each gives
  activations [sumT, ...]; per-sequence metadata travels in `AttnMeta` / `GdnMeta` (built once per forward).
- Activations are in the activation dtype (fp32, bf16 or fp16) and outputs keep it; norms, softmax, the
  GDN gates / conv / recurrence are computed in fp32 inside. GDN states are fp32.
- `eps` is the RMSNorm epsilon; `plus_one=True` is the zero-centred `(1 + w)` gain, False the plain `w`.
- Ops never allocate pool memory; caches and state pools are passed in and updated in place.
- Activation inputs may be strided views (e.g. the q half of the per-head [q | gate] projection);
  a backend that needs contiguous memory makes it so itself.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from .weights import QWeight


@dataclass(frozen=True)
class AttnMeta:
    """Paged-KV layout of one forward. KV slot of token j of sequence b = page * page_size + offset."""

    seq_lens: tuple[int, ...]        # T_b, new tokens (host)
    kv_lens: tuple[int, ...]         # L_b + T_b: cached tokens including the new ones (host)
    cu_seqlens: torch.Tensor         # int32 [B+1], offsets of each sequence in the packed axis
    kv_lens_t: torch.Tensor          # int32 [B]
    block_tables: torch.Tensor       # int32 [B, max_pages]; page ids in position order (padding: 0)
    slot_mapping: torch.Tensor       # int64 [sumT], KV slot of every new token
    page_size: int

    @property
    def max_q_len(self) -> int:
        return max(self.seq_lens)

    @property
    def max_kv_len(self) -> int:
        return max(self.kv_lens)


@dataclass(frozen=True)
class GdnMeta:
    """Sequences of one GDN call. Each owns a state slot; snapshot mode is per sequence.

    snap_index[b] == -1: the state pool slot is read and updated in place.
    snap_index[b] >= 0:  the pool slot is only read; the state after the sequence's t-th new token
                         (t = 1..T_b) is written to snapshot row snap_index[b] + t - 1.
    """

    seq_lens: tuple[int, ...]
    cu_seqlens: torch.Tensor         # int32 [B+1]
    slots: torch.Tensor              # int64 [B], rows of the state pools
    snap_index: torch.Tensor         # int64 [B]
    snap_index_host: tuple[int, ...]
    rows: torch.Tensor | None = None  # int64 [sumT_sub]: rows of the full packed batch (None = all rows)


class Branch:
    """Work an op may have started beside the caller's (`Ops.gdn_ba_gates_branch`, `Ops.gdn_conv_recurrent`):
    `join()` returns its result once the caller's next ops may use it (here: at once)."""

    def __init__(self, value):
        self.value = value

    def join(self):
        return self.value


class Ops(ABC):
    """Backend interface. `name` identifies the backend in logs and caches."""

    name: str = "abstract"

    # ---- dense ----
    @abstractmethod
    def linear(self, x: torch.Tensor, w: QWeight) -> torch.Tensor:
        """x [T, K] @ w.T -> [T, N] for any stored format of `w` (no bias anywhere in this model)."""

    @abstractmethod
    def embedding(self, ids: torch.Tensor, table, dtype: torch.dtype) -> torch.Tensor:
        """ids int64 [T] -> rows [T, H] of `table` (a [V, H] tensor or a QWeight) in `dtype`."""

    @abstractmethod
    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor, eps: float, plus_one: bool) -> torch.Tensor:
        """Normalise over the last dim of x [..., D]: x * rsqrt(mean(x^2) + eps) * (1 + w | w)."""

    @abstractmethod
    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float,
                    plus_one: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """residual' = residual + x (rounded to the activation dtype); returns (rmsnorm(residual'), residual')."""

    @abstractmethod
    def gated_rmsnorm(self, o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """GDN output norm, per head over the last dim of o/z [T, Hv, dv]: w * rmsnorm(o) * silu(z)."""

    @abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] (gate rows first, then up) -> silu(gate) * up [T, I]."""

    def linear_swiglu(self, x: torch.Tensor, w) -> torch.Tensor:
        """silu(gate) * up of the fused gate/up weight w ([2I, K], gate rows first): `silu_mul(linear(x, w))`
        here; a backend may fuse it."""
        return self.silu_mul(self.linear(x, w))

    def repack_growth(self, weights: dict) -> int:
        """Device bytes this backend's load-time repacks (built at warm-up, after the KV pool is sized) add to
        the loaded `weights`; none here."""
        return 0

    @abstractmethod
    def sigmoid_gate(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Attention output gate: o * sigmoid(gate), both [T, W] or [T, H, D] (gate may be a strided view);
        returns o's shape."""

    # ---- attention ----
    @abstractmethod
    def rope(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float,
             mrope_section: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """NeoX rotary embedding on the first `rotary_dim` dims of every head of q [T, Hq, D], k [T, Hk, D].

        positions: int64 [T] (text), or [3, T] (T/H/W rows, interleaved MRoPE: frequency j takes row 1 if
        j % 3 == 1 and j < 3 * section[1], row 2 if j % 3 == 2 and j < 3 * section[2], else row 0).
        Angles in fp32; returns new tensors.
        """

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, eps: float,
                     positions: torch.Tensor, rotary_dim: int, theta: float,
                     mrope_section: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's per-head q/k RMSNorms ((1 + w) gains q_w, k_w [D]) followed by `rope`. Composed of
        `rmsnorm` and `rope` here; a backend may fuse it."""
        q, k = self.rmsnorm(q, q_w, eps, True), self.rmsnorm(k, k_w, eps, True)
        return self.rope(q, k, positions, rotary_dim, theta, mrope_section)

    @abstractmethod
    def kv_write(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store k, v [T, Hk, D] at flat slots of k_cache/v_cache [num_pages, page_size, Hk, D] (in place)."""

    def qk_norm_rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_w: torch.Tensor,
                           k_w: torch.Tensor, eps: float, positions: torch.Tensor, rotary_dim: int, theta: float,
                           mrope_section: tuple[int, ...] | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> torch.Tensor:
        """`qk_norm_rope`, then `kv_write` of the rotated k and of v; returns the rotated q. Composed here; a
        backend may fuse it (the attention layer's q/k preparation and cache store in one launch)."""
        q, k = self.qk_norm_rope(q, k, q_w, k_w, eps, positions, rotary_dim, theta, mrope_section)
        self.kv_write(k_cache, v_cache, k, v, slot_mapping)
        return q

    @abstractmethod
    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
                  scale: float) -> torch.Tensor:
        """Causal paged GQA attention for q [sumT, Hq, D] -> [sumT, Hq, D].

        Query i (0-based) of sequence b sits at position kv_lens[b] - seq_lens[b] + i and attends to cached
        positions 0..that position (the new tokens' K/V must already be written). Q head h reads KV head
        h // (Hq / Hk). Softmax in fp32.
        """

    def gated_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
                        scale: float, gate: torch.Tensor) -> torch.Tensor:
        """`attention`, then `sigmoid_gate` with gate [sumT, Hq, D] (a strided view): [sumT, Hq, D]. Composed
        here; a backend may apply the gate where the attention output is stored."""
        return self.sigmoid_gate(self.attention(q, k_cache, v_cache, meta, scale), gate)

    # ---- gated deltanet ----
    @abstractmethod
    def causal_conv(self, x: torch.Tensor, w: torch.Tensor, conv_pool: torch.Tensor, meta: GdnMeta,
                    snapshots: torch.Tensor | None = None) -> torch.Tensor:
        """Depthwise causal conv + SiLU over time, per sequence: x [sumT, C], w [C, ck] (tap ck-1 = current).

        conv_pool [S, ck-1, C] fp32 holds each slot's last ck-1 inputs (oldest first). In-place update for
        sequences with snap_index -1; otherwise the window after each token goes to snapshots [N, ck-1, C].
        """

    @abstractmethod
    def gdn_gates(self, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """a, b [T, Hv] -> (g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)), both fp32."""

    def gdn_ba_gates(self, x: torch.Tensor, w_ba: QWeight, A_log: torch.Tensor, dt_bias: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The GDN b/a projection and its gates: w_ba [2 Hv, K] holds the b rows, then the a rows ->
        gdn_gates(a, b) of x @ w_ba^T. Composed of `linear` and `gdn_gates` here; a backend may fuse it."""
        b, a = self.linear(x, w_ba).chunk(2, dim=-1)
        return self.gdn_gates(a, b, A_log, dt_bias)

    def norm_ba_gates(self, x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float,
                      w_ba: QWeight, A_log: torch.Tensor, dt_bias: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor | None, Branch]:
        """A GDN layer's input norm and its b/a gates: (y, residual', gates) with y, residual' = add_rmsnorm(x,
        residual, w, eps) (residual None: y = rmsnorm(x, w, eps, True), residual' None) and gates =
        gdn_ba_gates_branch(y, w_ba, A_log, dt_bias). Composed here; a backend may compute the gates with the norm."""
        if residual is None:
            y, s = self.rmsnorm(x, w, eps, True), None
        else:
            y, s = self.add_rmsnorm(x, residual, w, eps)
        return y, s, self.gdn_ba_gates_branch(y, w_ba, A_log, dt_bias)

    def gdn_ba_gates_branch(self, x: torch.Tensor, w_ba: QWeight, A_log: torch.Tensor, dt_bias: torch.Tensor
                            ) -> Branch:
        """`gdn_ba_gates` started so that a backend may overlap it with the caller's next ops (it reads only x);
        `.join()` gives (g, beta) once the caller may use them. Here: computed now."""
        return Branch(self.gdn_ba_gates(x, w_ba, A_log, dt_bias))

    @abstractmethod
    def gdn_recurrent(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, state_pool: torch.Tensor, meta: GdnMeta,
                      snapshots: torch.Tensor | None = None) -> torch.Tensor:
        """Token-by-token gated delta rule. q, k [sumT, Hk, dk] (raw: l2-normalised inside, q scaled by
        dk^-0.5), v [sumT, Hv, dv], g, beta fp32 [sumT, Hv]; value head h uses key head h // (Hv / Hk).
        state_pool fp32 [S, Hv, dk, dv]; per token: S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q.
        Returns o [sumT, Hv, dv] in v's dtype. Snapshot rows as in `GdnMeta`.
        """

    def gdn_conv_recurrent(self, qkv: torch.Tensor, conv_w: torch.Tensor, conv_pool: torch.Tensor, gates: Branch,
                           state_pool: torch.Tensor, meta: GdnMeta, conv_snapshots: torch.Tensor | None = None,
                           snapshots: torch.Tensor | None = None) -> tuple[torch.Tensor, Branch]:
        """`causal_conv` of the q | k | v columns qkv [sumT, C] (C = 2 Hk dk + Hv dv, with Hv, dk, dv from
        state_pool), then `gdn_recurrent` of its q, k, v with the gates g, beta = gates.join() (the branch
        `gdn_ba_gates_branch` returned, joined only where they are first read); both states and their snapshots as
        in those two ops. -> (o, done): a backend may finish part of the state updates in a branch; `done.join()`
        before anything reads the conv pool again (the caller joins at the end of its layer). Composed here (done
        at once)."""
        t, hv, dk, dv = qkv.shape[0], *state_pool.shape[1:]
        kd = (qkv.shape[1] - hv * dv) // 2
        q, k, v = self.causal_conv(qkv, conv_w, conv_pool, meta, conv_snapshots).split((kd, kd, hv * dv), dim=-1)
        g, beta = gates.join()
        o = self.gdn_recurrent(q.reshape(t, kd // dk, dk), k.reshape(t, kd // dk, dk), v.reshape(t, hv, dv),
                               g, beta, state_pool, meta, snapshots)
        return o, Branch(None)

    @abstractmethod
    def gdn_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, state_pool: torch.Tensor, meta: GdnMeta) -> torch.Tensor:
        """Same result as gdn_recurrent (up to rounding) in the chunked form for prefill; no snapshots
        (every snap_index must be -1), states updated in place."""
