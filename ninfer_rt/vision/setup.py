"""Building the vision side of a runtime from command-line options (shared by `generate` and `serve`).

    opts = VisionOptions(max_images=4, max_pixels=512 * 28 * 28)       # validated on creation
    vis = build_vision_runtime(loaded, ops, opts, dtype=torch.bfloat16)  # binds visual.* on rank 0's device
    engine.attach_vision(vis)                                          # or Engine(..., vision=vis)

Only rank 0 builds it: followers receive the merged embeddings with each admitted image prompt.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import VisionError
from .image_io import ImageLimits
from .prompt import VisionRuntime

_LIMITS = ImageLimits()


@dataclass(frozen=True)
class VisionOptions:
    """`max_image_*` bound what a request may send (decoded size); `max_pixels` lowers the resize target of
    the artifact's preprocessor (fewer vision tokens per image). `allow_files`: local paths as image URLs
    (the local CLI only, never a public server)."""

    max_images: int = _LIMITS.max_images
    max_image_bytes: int = _LIMITS.max_bytes
    max_image_pixels: int = _LIMITS.max_pixels
    max_pixels: int | None = None
    allow_files: bool = False

    def __post_init__(self):
        self.limits()                         # raises VisionError naming the bad limit
        v = self.max_pixels
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise VisionError(f"vision max_pixels: expected a positive integer, got {v!r}")

    def limits(self) -> ImageLimits:
        return ImageLimits(max_images=self.max_images, max_bytes=self.max_image_bytes,
                           max_pixels=self.max_image_pixels, allow_files=self.allow_files)


def build_vision_runtime(loaded, ops, options: VisionOptions, dtype: torch.dtype | None = None) -> VisionRuntime:
    """The tower over the artifact's `visual.*` (bound now on the load device if `load(vision=False)` left
    them in the file). LoadError when the artifact has no tower, VisionError for a bad preprocessor config."""
    loaded.bind_vision()
    return VisionRuntime.from_loaded(loaded, ops, dtype=dtype, limits=options.limits(),
                                     max_pixels=options.max_pixels)
