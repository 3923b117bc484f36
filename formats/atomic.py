"""Write a file so that a reader sees the old one or the whole new one, never half of it."""
from __future__ import annotations

import json
import os
import secrets
from pathlib import Path


def _open_temp(path: Path) -> tuple[int, str]:
    """A new temp file next to `path`, created with mode 0o666 so the umask applies (mkstemp's 0o600
    would leave the result unreadable to everyone else, unlike any file the user writes by hand)."""
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}-{secrets.token_hex(4)}")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{path.parent}: no free temporary file name for {path.name}")


def write_bytes_atomic(path, data: bytes, *, make_parents: bool = True) -> None:
    """Temp file in the same folder (so the rename stays on one filesystem), fsync, rename."""
    path = Path(path)
    if make_parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _open_temp(path)
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


def write_json_atomic(path, obj, *, indent: int = 1, make_parents: bool = True) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=indent) + "\n").encode(), make_parents=make_parents)
