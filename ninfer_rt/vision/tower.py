"""Qwen3.8 vision tower (reference §14) over an artifact's `visual.*` tensors.

    tower = VisionTower(cfg.vision, weights, ops)
    embeds = tower(pixel_values, grid_thw)      # list of [t*h*w / merge^2, out_hidden] per image

Patch rows arrive in spatial-merge-block order (preprocess.patchify), so the 2x2 merge is a reshape of 4
consecutive rows. Stem: the Conv3d has kernel == stride, i.e. a linear map of the flattened patch vector
(stored [hidden, C*tp*p*p]; HF's 5-D layout is flattened on load). Learned positions: a square table
resampled bilinearly (align_corners=True) to each image's grid. Blocks: pre-LN, fused qkv, 2-D RoPE over
the full head dim (head_dim/4 frequencies for rows, the same ones for columns), non-causal attention within
each image frame, tanh-GELU MLP. Merger: LN -> 2x2 merge -> fc1 -> exact GELU -> fc2.

Matrices go through `ops.linear` (plain or quantized QWeight); biases, LayerNorms, RoPE angles and softmax
are computed in fp32. The tower is replicated on every TP rank (the packer does not split it).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ninfer_formats.errors import LoadError
from ninfer_formats.model_config import VisionConfig

from ..weights import QWeight, as_qweight
from .errors import VisionError

ROPE_THETA = 10000.0     # HF Qwen3_5VisionConfig default ("axial" rope), used while VisionConfig has no rope_theta
LN_EPS = 1e-6
_ACTS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
         "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "quick_gelu":
         lambda x: x * torch.sigmoid(1.702 * x)}


def _shape(w) -> tuple[int, ...]:
    return tuple(w.shape)


class _Weights:
    """Typed access to `visual.*` with shape checks (LoadError naming the tensor)."""

    def __init__(self, weights: dict):
        self.w = weights

    def get(self, name: str, shape: tuple[int, ...]):
        full = f"visual.{name}"
        if full not in self.w:
            raise LoadError(f"tensor {full}: missing (needed by the vision tower)")
        t = self.w[full]
        got = _shape(t)
        if full == "visual.patch_embed.proj.weight" and len(got) == 5 and isinstance(t, torch.Tensor):
            t, got = t.reshape(got[0], -1), (got[0], math.prod(got[1:]))
        if got != shape:
            raise LoadError(f"tensor {full}: shape {list(got)}, expected {list(shape)}")
        return t

    def linear(self, name: str, n: int, k: int) -> tuple[QWeight, torch.Tensor]:
        w = as_qweight(self.get(f"{name}.weight", (n, k)), f"visual.{name}.weight")
        return w, self.vec(f"{name}.bias", n)

    def vec(self, name: str, n: int) -> torch.Tensor:
        t = self.get(name, (n,))
        if isinstance(t, QWeight):
            raise LoadError(f"tensor visual.{name}: stored as {t.fmt}; only plain formats are supported here")
        return t.float()

    def norm(self, name: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.vec(f"{name}.weight", n), self.vec(f"{name}.bias", n)


class _Block:
    def __init__(self, w: _Weights, j: int, v: VisionConfig):
        h, i, p = v.hidden_size, v.intermediate_size, f"blocks.{j}."
        self.norm1, self.norm2 = w.norm(p + "norm1", h), w.norm(p + "norm2", h)
        self.qkv = w.linear(p + "attn.qkv", 3 * h, h)
        self.proj = w.linear(p + "attn.proj", h, h)
        self.fc1 = w.linear(p + "mlp.linear_fc1", i, h)
        self.fc2 = w.linear(p + "mlp.linear_fc2", h, i)


class VisionTower:
    def __init__(self, vcfg: VisionConfig, weights: dict, ops, *, dtype: torch.dtype | None = None):
        if vcfg.hidden_act not in _ACTS:
            raise LoadError(f"vision_config.hidden_act: {vcfg.hidden_act!r} is not supported")
        side = math.isqrt(vcfg.num_position_embeddings)
        if side * side != vcfg.num_position_embeddings:
            raise LoadError(f"vision_config.num_position_embeddings: {vcfg.num_position_embeddings} is not a square")
        self.cfg, self.ops, self.side = vcfg, ops, side
        self.theta = float(getattr(vcfg, "rope_theta", ROPE_THETA))
        self.heads, self.head_dim = vcfg.num_heads, vcfg.hidden_size // vcfg.num_heads
        if self.head_dim % 4:
            raise LoadError(f"vision_config: head dim {self.head_dim} is not a multiple of 4 (2-D RoPE)")
        w = _Weights(weights)
        h, m2 = vcfg.hidden_size, vcfg.hidden_size * vcfg.spatial_merge_size ** 2
        self.patch_dim = vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size ** 2
        self.patch = w.linear("patch_embed.proj", h, self.patch_dim)
        self.pos_table = w.get("pos_embed.weight", (vcfg.num_position_embeddings, h))
        self.blocks = [_Block(w, j, vcfg) for j in range(vcfg.depth)]
        self.merge_norm = w.norm("merger.norm", h)
        self.merge_fc1 = w.linear("merger.linear_fc1", m2, m2)
        self.merge_fc2 = w.linear("merger.linear_fc2", vcfg.out_hidden_size, m2)
        first = self.patch[0]
        self.device = first.device
        self.dtype = dtype or (first.data["w"].dtype if not first.quantized else torch.float32)
        self.act = _ACTS[vcfg.hidden_act]

    # ---- public ----
    def tokens_per_image(self, grid_thw: torch.Tensor) -> list[int]:
        m = self.cfg.spatial_merge_size
        return [int(t * h * w) // (m * m) for t, h, w in grid_thw.tolist()]

    @torch.no_grad()
    def __call__(self, pixel_values: torch.Tensor, grid_thw) -> list[torch.Tensor]:
        """pixel_values [N, C*tp*p*p] (patch rows of all images, in order), grid_thw [n, 3] ->
        per image [t*h*w / merge^2, out_hidden] in the tower's dtype."""
        grid = self._check(pixel_values, grid_thw)
        return list(torch.split(self.forward_packed(pixel_values, grid), self.tokens_per_image(grid)))

    @torch.no_grad()
    def forward_packed(self, pixel_values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """All images' merged tokens concatenated [sum tokens, out_hidden]; `grid` as checked by `__call__`."""
        x = self._lin(pixel_values.to(self.device, self.dtype), self.patch)
        x = (x.float() + self._pos_embed(grid)).to(self.dtype)
        cos, sin = self._rope(grid)
        segments = [int(h * w) for t, h, w in grid.tolist() for _ in range(int(t))]
        for blk in self.blocks:
            x = x + self._attn(self._ln(x, blk.norm1), blk, cos, sin, segments)
            x = x + self._lin(self._act(self._lin(self._ln(x, blk.norm2), blk.fc1)), blk.fc2)
        x = self._ln(x, self.merge_norm).reshape(-1, self.merge_fc1[0].shape[1])
        x = self._lin(F.gelu(self._lin(x, self.merge_fc1).float()).to(self.dtype), self.merge_fc2)
        return x

    # ---- pieces ----
    def _check(self, pixel_values: torch.Tensor, grid_thw) -> torch.Tensor:
        grid = torch.as_tensor(grid_thw, dtype=torch.long).reshape(-1, 3).cpu()
        m = self.cfg.spatial_merge_size
        if pixel_values.dim() != 2 or pixel_values.shape[1] != self.patch_dim:
            raise VisionError(f"pixel_values: shape {list(pixel_values.shape)}, expected [N, {self.patch_dim}]")
        if grid.numel() == 0 or (grid <= 0).any():
            raise VisionError(f"grid_thw: expected positive (t, h, w) rows, got {grid.tolist()}")
        if ((grid[:, 1:] % m) != 0).any():
            raise VisionError(f"grid_thw: h and w must be multiples of the merge size {m}, got {grid.tolist()}")
        if int(grid.prod(-1).sum()) != pixel_values.shape[0]:
            raise VisionError(f"pixel_values: {pixel_values.shape[0]} patches, grid_thw {grid.tolist()} "
                              f"needs {int(grid.prod(-1).sum())}")
        return grid

    def _lin(self, x: torch.Tensor, wb) -> torch.Tensor:
        w, b = wb
        return (self.ops.linear(x, w).float() + b).to(self.dtype)

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x.float()).to(self.dtype)

    def _ln(self, x: torch.Tensor, wb) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), wb[0], wb[1], LN_EPS).to(self.dtype)

    def _block_order(self, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, col) of every patch row, in merge-block order, frames repeated."""
        m, rows, cols = self.cfg.spatial_merge_size, [], []
        for t, h, w in grid.tolist():
            r = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
            c = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
            rows.append(r.transpose(1, 2).flatten().repeat(t))
            cols.append(c.transpose(1, 2).flatten().repeat(t))
        return torch.cat(rows).to(self.device), torch.cat(cols).to(self.device)

    def _taps(self, idx: torch.Tensor, size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bilinear (align_corners=True) taps [P, 2] into a side-long axis and their weights."""
        src = idx.float() * (self.side - 1) / torch.clamp(size - 1, min=1).float()
        lo = torch.floor(src)
        taps = torch.stack([lo, lo + 1], -1)
        weights = (1 - (src[:, None] - taps).abs()).clamp(min=0)
        return taps.long().clamp(0, self.side - 1), weights

    def _pos_embed(self, grid: torch.Tensor) -> torch.Tensor:
        rows, cols = self._block_order(grid)
        counts = grid.prod(-1).to(self.device)
        hr, wr = self._taps(rows, grid[:, 1].to(self.device).repeat_interleave(counts))
        hc, wc = self._taps(cols, grid[:, 2].to(self.device).repeat_interleave(counts))
        idx = (hr[:, :, None] * self.side + hc[:, None, :]).reshape(-1)
        wts = (wr[:, :, None] * wc[:, None, :]).reshape(-1, 4, 1)
        table = self.ops.embedding(idx, self.pos_table, torch.float32).view(-1, 4, self.cfg.hidden_size)
        return (table * wts).sum(1)

    def _rope(self, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = self._block_order(grid)
        half = self.head_dim // 2
        inv = 1.0 / (self.theta ** (torch.arange(0, half, 2, dtype=torch.float, device=self.device) / half))
        ang = torch.cat([rows.float()[:, None] * inv, cols.float()[:, None] * inv], -1)   # [N, D/2]
        ang = torch.cat([ang, ang], -1)[:, None]                                          # [N, 1, D]
        return ang.cos(), ang.sin()

    def _attn(self, x: torch.Tensor, blk: _Block, cos, sin, segments: list[int]) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        q, k, v = self._lin(x, blk.qkv).view(n, 3, self.heads, d).unbind(1)
        q, k = (_rotate(q, cos, sin).to(self.dtype), _rotate(k, cos, sin).to(self.dtype))
        out, start = [], 0
        for s in segments:      # attention never crosses an image / frame boundary
            # 4-D [1, heads, s, d]: the layout CUDA's flash / memory-efficient SDPA kernels take
            qs, ks, vs = (t[start:start + s].transpose(0, 1)[None] for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=d ** -0.5)
            out.append(o[0].transpose(0, 1).reshape(s, self.heads * d))
            start += s
        return self._lin(torch.cat(out), blk.proj)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half over the whole head dim, in fp32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return xf * cos + torch.cat([-x2, x1], -1) * sin
