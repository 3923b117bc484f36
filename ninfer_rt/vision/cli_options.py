"""The image-limit flags that `ninfer-rt generate` and `ninfer-rt serve` share (each only with --vision)."""
from __future__ import annotations

import click

# option keyword -> flag, for "only applies with --vision" messages
IMAGE_LIMIT_FLAGS = {"max_images": "--max-images", "max_image_bytes": "--max-image-bytes",
                     "max_image_pixels": "--max-image-pixels", "max_pixels": "--vision-max-pixels"}


def image_limit_options(per: str):
    """Click decorator adding the four image limits; `per` names the unit ("prompt", "request")."""
    options = [
        click.option("--max-images", type=click.IntRange(1), help=f"Images per {per} at most (--vision). [default: 8]"),
        click.option("--max-image-bytes", type=click.IntRange(1), help="Encoded bytes per image at most (--vision)."),
        click.option("--max-image-pixels", type=click.IntRange(1), help="Decoded pixels per image at most (--vision)."),
        click.option("--vision-max-pixels", type=click.IntRange(1),
                     help="Resize images to at most this many pixels (fewer vision tokens); default: the artifact's."),
    ]

    def decorate(fn):
        for opt in reversed(options):
            fn = opt(fn)
        return fn
    return decorate
