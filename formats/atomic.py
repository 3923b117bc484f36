"""Write a file so that a reader sees the old one or the whole new one, never half of it."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def write_bytes_atomic(path, data: bytes) -> None:
    """Temp file in the same folder (so the rename stays on one filesystem), fsync, rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json_atomic(path, obj, *, indent: int = 1) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=indent) + "\n").encode())
