"""The shipped ninfer-tiny checkpoint packed by the real packer, for tests that need an artifact on disk."""
from __future__ import annotations

from pathlib import Path


def pack_tiny(out: Path, tp: int = 1, recipe: str = "bf16") -> str:
    """Pack ninfer_pack/tiny into `out` (TP `tp`, text only); returns the folder as a string."""
    from ninfer_pack.convert import convert
    from ninfer_pack.demo import tiny_checkpoint
    convert(str(tiny_checkpoint()), out, recipe=recipe, jobs=1, progress=False, vision=False, tp=tp)
    return str(out)
