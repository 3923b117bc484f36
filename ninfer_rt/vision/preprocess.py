"""Image -> `pixel_values` [num_patches, C*tp*p*p] + grid (t, h, w), the Qwen2-VL/Qwen3-VL image processor's
math (transformers' PIL backend, which `qwen3_5` uses when torchvision is absent):

1. RGB (alpha composited over white), 2. `smart_resize` to a multiple of `patch * merge` on both sides with
min_pixels <= h*w <= max_pixels, Pillow resample (bicubic by default) on the uint8 image, 3. x * rescale
(float64, then float32), 4. (x - mean) / std in float32, 5. patchify in spatial-merge-block order (the
merger takes 4 consecutive patches), each patch repeated `temporal_patch_size` times (a still image is a
one-step video), flattened as (C, tp, p, p) -- the Conv3d weight's layout.

The parameters come from the artifact's `preprocessor_config.json` resource; patch/merge/temporal sizes
default to the model's vision config and must agree with it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from ninfer_formats.model_config import VisionConfig

from .errors import VisionError, one_line

# transformers' Qwen2VLImageProcessor class defaults (used only for keys the config leaves out)
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT = 200
RESOURCE = "preprocessor_config.json"


@dataclass(frozen=True)
class PreprocessConfig:
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    resample: int = int(Image.Resampling.BICUBIC)

    def __post_init__(self):
        object.__setattr__(self, "image_mean", tuple(float(x) for x in self.image_mean))
        object.__setattr__(self, "image_std", tuple(float(x) for x in self.image_std))
        for n in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise VisionError(f"{RESOURCE}: {n} must be a positive integer, got {v!r}")
        if self.min_pixels > self.max_pixels:
            raise VisionError(f"{RESOURCE}: min_pixels {self.min_pixels} > max_pixels {self.max_pixels}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise VisionError(f"{RESOURCE}: image_mean / image_std need 3 values (RGB)")
        if any(not s > 0 for s in self.image_std):
            raise VisionError(f"{RESOURCE}: image_std values must be positive, got {list(self.image_std)}")
        if self.resample not in {int(r) for r in Image.Resampling}:
            raise VisionError(f"{RESOURCE}: resample {self.resample!r} is not a Pillow resampling filter")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_json(cls, d: dict, vision: VisionConfig) -> "PreprocessConfig":
        """From the HF preprocessor config dict. Like transformers, legacy `min_pixels`/`max_pixels` win over
        `size.shortest_edge`/`size.longest_edge`."""
        if not isinstance(d, dict):
            raise VisionError(f"{RESOURCE}: expected a JSON object")
        size = d.get("size") or {}
        if not isinstance(size, dict):
            raise VisionError(f"{RESOURCE}: size must be an object with shortest_edge/longest_edge")
        kw = dict(patch_size=d.get("patch_size", vision.patch_size),
                  temporal_patch_size=d.get("temporal_patch_size", vision.temporal_patch_size),
                  merge_size=d.get("merge_size", vision.spatial_merge_size),
                  min_pixels=d.get("min_pixels", size.get("shortest_edge", DEFAULT_MIN_PIXELS)),
                  max_pixels=d.get("max_pixels", size.get("longest_edge", DEFAULT_MAX_PIXELS)))
        for k in ("image_mean", "image_std", "rescale_factor", "do_resize", "do_rescale", "do_normalize",
                  "do_convert_rgb", "resample"):
            if d.get(k) is not None:
                kw[k] = d[k]
        try:
            cfg = cls(**kw)
        except (TypeError, ValueError) as e:
            if isinstance(e, VisionError):
                raise
            raise VisionError(f"{RESOURCE}: {e}") from None
        cfg.check_against(vision)
        return cfg

    @classmethod
    def from_resources(cls, resources: dict, vision: VisionConfig) -> "PreprocessConfig":
        raw = resources.get(RESOURCE)
        if raw is None:
            raise VisionError(f"{RESOURCE}: the artifact has no image preprocessor config; repack from a "
                              "checkpoint that ships one (normalisation constants are model-specific)")
        try:
            d = json.loads(raw)
        except ValueError as e:
            raise VisionError(f"{RESOURCE}: invalid JSON ({e})") from None
        return cls.from_json(d, vision)

    def check_against(self, v: VisionConfig) -> None:
        for mine, theirs, name in ((self.patch_size, v.patch_size, "patch_size"),
                                   (self.temporal_patch_size, v.temporal_patch_size, "temporal_patch_size"),
                                   (self.merge_size, v.spatial_merge_size, "spatial_merge_size")):
            if mine != theirs:
                raise VisionError(f"{RESOURCE}: {name} {mine} differs from the model's vision_config ({theirs})")
        if v.in_channels != 3:
            raise VisionError(f"vision_config.in_channels: {v.in_channels}, only RGB (3) images are supported")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
                 where: str = "image") -> tuple[int, int]:
    """(h, w): multiples of `factor`, pixel count within [min, max], aspect ratio kept as far as possible."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise VisionError(f"{where}: aspect ratio {max(height, width) / min(height, width):.1f} of a "
                          f"{width}x{height} image exceeds {MAX_ASPECT}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB; transparency (alpha band or palette transparency) composited over white."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return img.convert("RGB")


def normalized_pixels(img: Image.Image, cfg: PreprocessConfig, where: str = "image") -> np.ndarray:
    """float32 [3, H', W'] after convert, resize, rescale and normalise."""
    if cfg.do_convert_rgb or img.mode != "RGB":
        try:
            img = to_rgb(img)
        except (ValueError, OSError) as e:
            raise VisionError(f"{where}: cannot convert a {img.mode} image to RGB ({one_line(e)})") from None
    if cfg.do_resize:
        h, w = smart_resize(img.height, img.width, cfg.factor, cfg.min_pixels, cfg.max_pixels, where)
        img = img.resize((w, h), resample=cfg.resample)
    elif img.height % cfg.factor or img.width % cfg.factor:
        raise VisionError(f"{where}: {img.width}x{img.height} is not a multiple of {cfg.factor} and "
                          "do_resize is off")
    x = np.moveaxis(np.asarray(img), -1, 0)
    x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32) if cfg.do_rescale else x.astype(np.float32)
    if cfg.do_normalize:
        mean = np.asarray(cfg.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(cfg.image_std, dtype=np.float32)[:, None, None]
        x = (x - mean) / std
    return x


def patchify(x: np.ndarray, cfg: PreprocessConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[C, H, W] -> ([gh*gw, C*tp*p*p] in merge-block order, (1, gh, gw))."""
    c, h, w = x.shape
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = h // p, w // p
    blocks = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # gh', gw', m, m, C, p, p
    blocks = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], tp, p, p))
    return np.ascontiguousarray(blocks.reshape(gh * gw, c * tp * p * p)), (1, gh, gw)


def preprocess_image(img: Image.Image, cfg: PreprocessConfig, where: str = "image"):
    """One image -> (pixel_values float32 [gh*gw, C*tp*p*p], (1, gh, gw))."""
    return patchify(normalized_pixels(img, cfg, where), cfg)


def preprocess_images(images, cfg: PreprocessConfig, names=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Images -> (pixel_values float32 [sum patches, D], grid_thw int64 [n, 3]), concatenated in order."""
    images = list(images)
    if not images:
        raise VisionError("images: no images to preprocess")
    names = list(names) if names is not None else [f"image {i}" for i in range(len(images))]
    pix, grids = [], []
    for img, name in zip(images, names):
        p, g = preprocess_image(img, cfg, name)
        pix.append(p)
        grids.append(g)
    return torch.from_numpy(np.concatenate(pix)), torch.tensor(grids, dtype=torch.long)


def num_image_tokens(grid: tuple[int, int, int], merge_size: int) -> int:
    t, h, w = (int(v) for v in grid)
    return t * h * w // merge_size ** 2
