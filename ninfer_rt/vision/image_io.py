"""Image sources -> decoded Pillow images, with the request limits enforced before any large allocation.

Accepted sources: `data:image/<type>;base64,<payload>` URIs, raw bytes, and (only when the caller allows it,
e.g. the local CLI, never a public server by default) local file paths or `file://` URIs. http(s) URLs are
refused: the runtime machines are not expected to reach the network, and fetching would be an SSRF vector.

Order of checks: count, then encoded size (the base64 length bounds the decoded size, so nothing big is
decoded first), then the header's pixel count (Pillow reads only the header in `open`), then the full decode.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import re
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from .errors import VisionError, one_line

_DATA_URI = re.compile(r"data:(?P<mime>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<payload>.*)", re.S)
_WS = re.compile(rb"\s+")


@dataclass(frozen=True)
class ImageLimits:
    """Per-request limits. `max_pixels` bounds the *decoded* image (before the resize to the patch grid)."""

    max_images: int = 8
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000
    allow_files: bool = False

    def __post_init__(self):
        for n in ("max_images", "max_bytes", "max_pixels"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise VisionError(f"image limits: {n} must be a positive integer, got {v!r}")

    def check_count(self, n: int) -> None:
        if n > self.max_images:
            raise VisionError(f"images: {n} images in one request, at most {self.max_images} are allowed")


def _too_big(where: str, n: int, limits: ImageLimits) -> VisionError:
    return VisionError(f"{where}: {n} bytes, more than the {limits.max_bytes}-byte limit")


def _from_data_uri(uri: str, where: str, limits: ImageLimits) -> bytes:
    m = _DATA_URI.fullmatch(uri)
    if m is None:
        raise VisionError(f"{where}: malformed data URI (expected data:image/<type>;base64,<payload>)")
    mime, params = m["mime"].strip().lower(), [p.strip().lower() for p in m["params"].split(";")[1:]]
    if not mime.startswith("image/"):
        raise VisionError(f"{where}: data URI media type {mime or '(none)'!r} is not image/*")
    if "base64" not in params:
        raise VisionError(f"{where}: data URI must be base64-encoded (…;base64,<payload>)")
    payload = _WS.sub(b"", m["payload"].encode("ascii", errors="replace"))
    if len(payload) // 4 * 3 > limits.max_bytes:           # upper bound of the decoded size, before decoding
        raise _too_big(where, len(payload) // 4 * 3, limits)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise VisionError(f"{where}: data URI payload is not valid base64 ({one_line(e)})") from None


def _from_file(path: str, where: str, limits: ImageLimits) -> bytes:
    if not limits.allow_files:
        raise VisionError(f"{where}: local file paths are not accepted here; send a data:image/...;base64 URI")
    path = path[len("file://"):] if path.startswith("file://") else path
    try:
        size = os.stat(path).st_size
        if size > limits.max_bytes:
            raise _too_big(f"{where} ({path})", size, limits)
        with open(path, "rb") as f:
            return f.read(limits.max_bytes + 1)
    except OSError as e:
        raise VisionError(f"{where}: cannot read {path}: {e.strerror or one_line(e)}") from None


def read_source(source, where: str = "image", limits: ImageLimits = ImageLimits()) -> bytes:
    """The encoded bytes of one image source (str URI/path or bytes)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        raw = bytes(source)
    elif isinstance(source, str):
        s = source.strip()
        if s[:5].lower() == "data:":
            raw = _from_data_uri(s, where, limits)
        elif re.match(r"(?i)https?://", s):
            raise VisionError(f"{where}: http(s) image URLs are not fetched by this server; "
                              "send a data:image/...;base64 URI")
        elif not s:
            raise VisionError(f"{where}: empty image URL")
        else:
            raw = _from_file(s, where, limits)
    else:
        raise VisionError(f"{where}: expected an image URL string or bytes, got {type(source).__name__}")
    if len(raw) > limits.max_bytes:
        raise _too_big(where, len(raw), limits)
    if not raw:
        raise VisionError(f"{where}: empty image data")
    return raw


def decode_image(raw: bytes, where: str = "image", limits: ImageLimits = ImageLimits()) -> Image.Image:
    """Decode fully (first frame of animations); header-checked against `limits.max_pixels` first."""
    with warnings.catch_warnings():
        # our own pixel limit applies; Pillow's bomb warning would only duplicate it
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(raw))
        except UnidentifiedImageError:
            raise VisionError(f"{where}: not an image (unrecognised format)") from None
        except Image.DecompressionBombError:
            raise VisionError(f"{where}: too large (decompression bomb check failed)") from None
        except (OSError, ValueError, SyntaxError) as e:
            raise VisionError(f"{where}: not a decodable image ({one_line(e)})") from None
        w, h = img.size
        if w <= 0 or h <= 0:
            raise VisionError(f"{where}: empty image ({w}x{h})")
        if w * h > limits.max_pixels:
            raise VisionError(f"{where}: {w}x{h} = {w * h} pixels, more than the {limits.max_pixels}-pixel limit")
        try:
            img.seek(0)
            img.load()
        except Image.DecompressionBombError:
            raise VisionError(f"{where}: too large (decompression bomb check failed)") from None
        except (OSError, ValueError, SyntaxError, EOFError) as e:
            raise VisionError(f"{where}: cannot be decoded ({one_line(e)})") from None
    return img


def load_image(source, where: str = "image", limits: ImageLimits = ImageLimits()) -> Image.Image:
    """A Pillow image as given (`Image.Image` passes through), or decoded from a URI / path / bytes."""
    if isinstance(source, Image.Image):
        w, h = source.size
        if w * h > limits.max_pixels:
            raise VisionError(f"{where}: {w}x{h} = {w * h} pixels, more than the {limits.max_pixels}-pixel limit")
        return source
    return decode_image(read_source(source, where, limits), where, limits)


def load_images(sources, limits: ImageLimits = ImageLimits(), names=None) -> list[Image.Image]:
    """Every source of one request, in order; `names[i]` labels errors (default `image i`)."""
    sources = list(sources)
    limits.check_count(len(sources))
    names = list(names) if names is not None else [f"image {i}" for i in range(len(sources))]
    return [load_image(s, n, limits) for s, n in zip(sources, names)]
