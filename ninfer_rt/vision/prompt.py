"""Image+text prompts for the decoder: placeholder expansion, the tower, MRoPE positions, and the per-forward
arguments the model takes (`SeqInput.positions` / `SeqInput.inputs_embeds`).

Two phases, so the server can check the prompt length before anything touches the GPU:

    vis = VisionRuntime.from_loaded(loaded, ops)                 # once, when serving with --vision
    # request thread (CPU; VisionError -> HTTP 400). Template ids hold one <|image_pad|> per image:
    vr = vis.preprocess_request(prompt_ids, vis.load_images(urls, names))   # len(vr) = expanded prompt length
    # engine thread (GPU):
    vp = vis.encode_request(vr)                                  # or vis.prepare(prompt_ids, images): both
    # every forward of that sequence (prefill chunks, decode, verify), rows start .. start + len(ids) - 1:
    model.forward([SeqInput(ids, st, **vp.seq_kwargs(model, st.length, ids))])
    # MTP row p pairs target row p, so it takes the same position:
    MtpInput(next_ids, hidden, st.mtp, positions=vp.positions_for(st.mtp.length, len(next_ids)))

`vp.token_ids` is the prompt to prefill (each placeholder expanded to its image's token count). Rows past
the prompt (decode, recompute after preemption) sit at row + rope_delta on all three axes. With TP, rank 0
sends `vp.meta()` (small, picklable) and broadcasts `vp.image_embeds`; the other ranks rebuild it with
`VisionPrompt.from_meta(meta, embeds)`, so every rank splices identical embeddings.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ninfer_formats.errors import LoadError
from ninfer_formats.model_config import ModelConfig

from .errors import VisionError
from .image_io import ImageLimits, load_images
from .positions import decode_positions, mrope_positions, placeholder_runs
from .preprocess import PreprocessConfig, num_image_tokens, preprocess_images
from .tower import VisionTower


@dataclass
class VisionPrompt:
    token_ids: torch.Tensor       # int64 [T], placeholders expanded
    positions: torch.Tensor       # int64 [3, T]
    rope_delta: int
    image_rows: torch.Tensor      # int64 [n] ascending rows of token_ids that hold image tokens
    image_embeds: torch.Tensor    # [n, H] merged vision tokens, in row order
    grid_thw: torch.Tensor        # int64 [images, 3]

    def __len__(self) -> int:
        return int(self.token_ids.numel())

    def positions_for(self, start: int, n: int) -> torch.Tensor:
        """Positions of rows start .. start+n-1: [3, n] if any row is in the prompt, else [n]."""
        t = len(self)
        if start >= t:
            return decode_positions(start, n, self.rope_delta)
        head = self.positions[:, start:min(start + n, t)]
        if start + n <= t:
            return head
        return torch.cat([head, decode_positions(t, start + n - t, self.rope_delta).expand(3, -1)], dim=1)

    def embeds_for(self, model, start: int, ids: torch.Tensor) -> torch.Tensor | None:
        """[n, H] token embeddings with the image rows replaced, or None when no image row is in the chunk.
        `model` provides `ops`, `embed` (the table) and `dtype` (a `ninfer_rt.model.Model` does)."""
        n = int(ids.numel())
        lo = int(torch.searchsorted(self.image_rows, start))
        hi = int(torch.searchsorted(self.image_rows, start + n))
        if lo == hi:
            return None
        rows = self.image_rows[lo:hi] - start
        ids = ids.to(model.embed.device)
        if not bool((ids[rows.to(ids.device)] == self.token_ids[self.image_rows[lo:hi]].to(ids.device)).all()):
            raise RuntimeError(f"vision prompt: ids at image rows {start}..{start + n} are not the prompt's")
        h = model.ops.embedding(ids, model.embed, model.dtype).clone()
        h[rows.to(h.device)] = self.image_embeds[lo:hi].to(h.device, h.dtype)
        return h

    def seq_kwargs(self, model, start: int, ids: torch.Tensor) -> dict:
        """`SeqInput` keyword arguments for the rows start .. start+len(ids)-1 of this sequence."""
        return {"positions": self.positions_for(start, int(ids.numel())),
                "inputs_embeds": self.embeds_for(model, start, ids)}


    def meta(self) -> dict:
        """Everything but the embeddings, for `broadcast_object` to the other TP ranks."""
        return {"token_ids": self.token_ids, "positions": self.positions, "rope_delta": self.rope_delta,
                "image_rows": self.image_rows, "grid_thw": self.grid_thw,
                "embeds_shape": tuple(self.image_embeds.shape), "embeds_dtype": self.image_embeds.dtype}

    @classmethod
    def from_meta(cls, meta: dict, image_embeds: torch.Tensor) -> "VisionPrompt":
        """Rank r > 0: `image_embeds` = the tensor broadcast from rank 0 (allocate it with
        `torch.empty(meta["embeds_shape"], dtype=meta["embeds_dtype"], device=...)`)."""
        kw = {k: v for k, v in meta.items() if k not in ("embeds_shape", "embeds_dtype")}
        return cls(image_embeds=image_embeds, **kw)


@dataclass
class VisionRequest:
    """The CPU half of a vision prompt: expanded ids and the preprocessed pixels (no tower run yet)."""

    token_ids: list[int]          # placeholders expanded
    pixel_values: torch.Tensor    # float32 [patches, C*tp*p*p]
    grid_thw: torch.Tensor        # int64 [images, 3]

    def __len__(self) -> int:
        return len(self.token_ids)


class VisionRuntime:
    """The vision side of a loaded artifact: limits, preprocessing, the tower, prompt preparation."""

    def __init__(self, config: ModelConfig, weights: dict, resources: dict, ops, *,
                 dtype: torch.dtype | None = None, limits: ImageLimits = ImageLimits(),
                 preprocess: PreprocessConfig | None = None, max_pixels: int | None = None):
        """`max_pixels` lowers the resize target of the artifact's preprocessor config (fewer tokens per
        image: tokens ~ pixels / (patch * merge)^2)."""
        if config.vision is None:
            raise LoadError("vision: the artifact has no vision tower (packed with --no-vision?)")
        if config.image_token_id is None:
            raise LoadError("model.image_token_id: missing, needed to place image tokens in the prompt")
        if config.vision.out_hidden_size != config.hidden_size:
            raise LoadError(f"vision_config.out_hidden_size: {config.vision.out_hidden_size} differs from "
                            f"hidden_size {config.hidden_size}")
        self.config, self.limits = config, limits
        pre = preprocess or PreprocessConfig.from_resources(resources, config.vision)
        if max_pixels is not None:
            if not isinstance(max_pixels, int) or max_pixels < pre.min_pixels:
                raise VisionError(f"max_pixels: {max_pixels!r} is below the preprocessor's min_pixels "
                                  f"{pre.min_pixels}")
            pre = dataclasses.replace(pre, max_pixels=max_pixels)
        self.preprocess = pre
        self.tower = VisionTower(config.vision, weights, ops, dtype=dtype)
        self.image_token_id = int(config.image_token_id)
        self.merge = config.vision.spatial_merge_size

    @classmethod
    def from_loaded(cls, loaded, ops, **kw) -> "VisionRuntime":
        """From a `ninfer_rt.loader.LoadedModel`."""
        return cls(loaded.config, loaded.weights, loaded.resources, ops, **kw)

    def load_images(self, sources, names=None) -> list:
        return load_images(sources, self.limits, names)

    def expand_placeholders(self, ids: list[int], grids: torch.Tensor) -> list[int]:
        """Each image's placeholder run (1 token from a chat template, or already its full length) gets
        exactly that image's token count."""
        runs = placeholder_runs(ids, self.image_token_id)
        if len(runs) != len(grids):
            raise VisionError(f"prompt: {len(runs)} image placeholders for {len(grids)} images "
                              "(each image needs its own <|image_pad|>)")
        out, prev = [], 0
        for (a, b), g in zip(runs, grids.tolist()):
            need = num_image_tokens(g, self.merge)
            if b - a not in (1, need):
                raise VisionError(f"prompt: image placeholder run at {a} has {b - a} tokens, "
                                  f"expected 1 or {need}")
            out += ids[prev:a] + [self.image_token_id] * need
            prev = b
        return out + ids[prev:]

    def preprocess_request(self, prompt_ids, images, names=None) -> VisionRequest:
        """CPU phase: pixels + grids, placeholders expanded and checked (VisionError on any mismatch)."""
        ids = [int(t) for t in (prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else prompt_ids)]
        images = list(images)
        if not images:
            raise VisionError("images: a vision prompt needs at least one image")
        self.limits.check_count(len(images))
        pixels, grid = preprocess_images(images, self.preprocess, names)
        ids = self.expand_placeholders(ids, grid)
        return VisionRequest(ids, pixels, grid)

    def encode_request(self, req: VisionRequest) -> VisionPrompt:
        """Device phase: run the tower, lay out MRoPE positions."""
        positions, delta = mrope_positions(req.token_ids, req.grid_thw, self.image_token_id, self.merge)
        token_ids = torch.tensor(req.token_ids, dtype=torch.long)
        rows = torch.nonzero(token_ids == self.image_token_id).flatten()
        embeds = torch.cat(self.tower(req.pixel_values, req.grid_thw))
        return VisionPrompt(token_ids=token_ids, positions=positions, rope_delta=delta, image_rows=rows,
                            image_embeds=embeds, grid_thw=req.grid_thw)

    def encode(self, images, names=None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Images -> (per image [tokens, H] merged embeddings, grid_thw [n, 3])."""
        self.limits.check_count(len(images))
        pixels, grid = preprocess_images(images, self.preprocess, names)
        return self.tower(pixels, grid), grid

    def prepare(self, prompt_ids, images, names=None) -> VisionPrompt:
        return self.encode_request(self.preprocess_request(prompt_ids, images, names))
