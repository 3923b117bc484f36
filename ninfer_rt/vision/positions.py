"""3-axis (T, H, W) MRoPE positions of a prompt with image placeholders, and the decode-time rope delta
(reference §6; equal to transformers' `Qwen3_5Model.get_rope_index` for image prompts).

A text token at index i takes position p on all three axes, p = 1 + the previous token's largest position.
A run of image placeholders (one image, grid (t, h, w) patches, merged to (t, h/m, w/m) tokens in raster
order) starting at position s takes (s + ti, s + hi, s + wi); the text after it resumes at
s + max(h, w) / m. rope_delta = max position + 1 - prompt length, so the token at index i >= prompt length
(decode) sits at i + rope_delta on all three axes.
"""
from __future__ import annotations

import torch

from .errors import VisionError


def placeholder_runs(ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """[start, stop) of every maximal run of `image_token_id`."""
    runs, i, n = [], 0, len(ids)
    while i < n:
        if ids[i] == image_token_id:
            j = i
            while j < n and ids[j] == image_token_id:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    return runs


def _grids(grid_thw) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in g) for g in torch.as_tensor(grid_thw, dtype=torch.long).reshape(-1, 3).tolist()]


def mrope_positions(token_ids, grid_thw, image_token_id: int, merge_size: int) -> tuple[torch.Tensor, int]:
    """-> (positions int64 [3, T], rope_delta). Each placeholder run must hold exactly its image's tokens."""
    ids = [int(t) for t in (token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids)]
    if not ids:
        raise VisionError("prompt: empty token sequence")
    grids = _grids(grid_thw) if grid_thw is not None else []
    runs = placeholder_runs(ids, image_token_id)
    if len(runs) != len(grids):
        raise VisionError(f"prompt: {len(runs)} image placeholder runs for {len(grids)} images")
    pos = torch.empty(3, len(ids), dtype=torch.long)
    cur, prev = 0, 0
    for (a, b), (t, h, w) in zip(runs, grids):
        pos[:, prev:a] = torch.arange(cur, cur + a - prev)
        cur += a - prev
        lh, lw = h // merge_size, w // merge_size
        if b - a != t * lh * lw:
            raise VisionError(f"prompt: image placeholder run at {a} has {b - a} tokens, its image needs "
                              f"{t * lh * lw}")
        ti, hi, wi = torch.meshgrid(torch.arange(t), torch.arange(lh), torch.arange(lw), indexing="ij")
        pos[:, a:b] = torch.stack([ti, hi, wi]).reshape(3, -1) + cur
        cur += max(h, w) // merge_size
        prev = b
    pos[:, prev:] = torch.arange(cur, cur + len(ids) - prev)
    return pos, int(pos.max()) + 1 - len(ids)


def decode_positions(start: int, n: int, rope_delta: int) -> torch.Tensor:
    """int64 [n]: rows start..start+n-1 after the prompt (all three axes equal, so 1-D positions suffice)."""
    return torch.arange(start + rope_delta, start + rope_delta + n, dtype=torch.long)
