"""Image parts of OpenAI-style chat messages, in prompt order, with the field path of each for error messages.

Accepted part shapes: `{"type": "image_url", "image_url": {"url": ...}}` (OpenAI), `{"type": "image_url",
"image_url": "..."}`, and `{"type": "image", "image": "..."}` (the HF chat-template convention). Qwen chat
templates emit one `<|vision_start|><|image_pad|><|vision_end|>` per such part, in the same order.
"""
from __future__ import annotations

from .errors import VisionError

IMAGE_TYPES = ("image_url", "image")


def _as_dict(x):
    if hasattr(x, "model_dump"):           # pydantic request models
        return x.model_dump(exclude_none=True)
    return x


def _url(part: dict, where: str) -> str:
    kind = part.get("type")
    val = part.get(kind)
    if isinstance(val, dict):
        val = val.get("url")
        where += ".url"
    if not isinstance(val, str) or not val:
        raise VisionError(f"{where}: expected a non-empty image URL string")
    return val


def image_urls(messages) -> tuple[list[str], list[str]]:
    """-> (urls, names): every image part of `messages` in order; names like `messages.1.content.0.image_url`."""
    urls, names = [], []
    for i, m in enumerate(messages):
        content = _as_dict(m).get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            part = _as_dict(part)
            if isinstance(part, dict) and part.get("type") in IMAGE_TYPES:
                where = f"messages.{i}.content.{j}.{part['type']}"
                urls.append(_url(part, where))
                names.append(where)
    return urls, names
