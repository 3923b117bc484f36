"""The image side of a chat request (`ninfer-rt serve --vision`): find the image parts, read and check them,
expand the prompt's placeholders, and enforce the per-request image-token budget.

Everything here runs before the request is queued, so a bad image is a 400 that never reaches the engine:
no vision runtime -> 400 naming `--vision`; unreadable / oversized / too many images, or a template that does
not emit one placeholder per image -> 400 with the VisionError's one-line message; more image tokens than
`--vision-max-tokens` -> 400. Decoding and resizing run in a worker thread (they are CPU-heavy); the tower
itself runs later, on the engine thread, when the scheduler admits the request.
"""
from __future__ import annotations

from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from ..vision.chat_parts import image_urls
from ..vision.errors import VisionError
from ..vision.preprocess import num_image_tokens
from . import protocol as P


@dataclass(frozen=True)
class ImagePrompt:
    request: object            # VisionRequest: expanded token ids, pixel values, grids
    image_tokens: int


def _param(message: str) -> str:
    """The request field a VisionError names (`messages.1.content.0.image_url: ...`), else `messages`."""
    head = message.split(":", 1)[0]
    return head if head.startswith("messages.") and " " not in head else "messages"


def _invalid(message: str, code: str = "invalid_image") -> P.ApiError:
    return P.bad_request(message, param=_param(message), code=code)


def _prepare(vis, ids: list[int], urls: list[str], names: list[str]):
    return vis.preprocess_request(ids, vis.load_images(urls, names), names)


async def image_prompt(vis, max_tokens: int, messages, ids: list[int]) -> ImagePrompt | None:
    """None for a text-only request; else the prepared image prompt (ApiError 400 on any problem)."""
    try:
        urls, names = image_urls(messages)
    except VisionError as e:
        raise _invalid(str(e)) from None
    if not urls:
        return None
    if vis is None:
        raise P.bad_request(f"{names[0]}: this server was started without --vision, so image inputs are not "
                            f"accepted (the request has {len(urls)} image(s))", param=names[0],
                            code="vision_disabled")
    try:
        vr = await run_in_threadpool(_prepare, vis, ids, urls, names)
    except VisionError as e:
        raise _invalid(str(e)) from None
    n = sum(num_image_tokens(g, vis.merge) for g in vr.grid_thw.tolist())
    if n > max_tokens:
        raise P.bad_request(f"messages: the {len(urls)} image(s) make {n} image tokens, more than this server's "
                            f"limit of {max_tokens} per request (--vision-max-tokens); send fewer or smaller "
                            "images", param="messages", code="image_tokens_exceeded")
    return ImagePrompt(vr, n)
