"""The one error type of the vision path; the server maps it to HTTP 400."""
from __future__ import annotations

from ninfer_formats.errors import NinferError


class VisionError(NinferError):
    """An image input is unusable (not an image, too large, too many, bad placeholder layout) or the
    artifact's preprocessor config is inconsistent. `str()` is one line naming the image / field."""


def one_line(e: BaseException) -> str:
    """The first line of an exception's message (Pillow messages can span lines), or its type name."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
