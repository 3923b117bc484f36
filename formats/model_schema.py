"""JSON type checks for the directory's `model` member before ModelConfig sees it (FORMAT.md §2.1).

ModelConfig validates consistency but trusts Python types; a file is untrusted, so every member's JSON type
is checked here first, driven by the dataclass annotations (no second list of fields to keep in sync).
"""
from __future__ import annotations

import math
from dataclasses import MISSING, fields

from .constants import MAX_JSON_INT
from .errors import FormatError, NinferError
from .model_config import ModelConfig, VisionConfig


def _is_int(v) -> bool:
    return type(v) is int and -MAX_JSON_INT < v < MAX_JSON_INT


def _is_num(v) -> bool:
    return _is_int(v) or (type(v) is float and math.isfinite(v))


_CHECKS = {
    "int": (_is_int, "an integer"),
    "float": (_is_num, "a number"),
    "bool": (lambda v: type(v) is bool, "a boolean"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
    "int | None": (lambda v: v is None or _is_int(v), "an integer or null"),
    "tuple[str, ...]": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "an array of strings"),
    "tuple[int, ...]": (lambda v: isinstance(v, list) and all(_is_int(x) for x in v), "an array of integers"),
    "VisionConfig | None": (lambda v: v is None or isinstance(v, dict), "an object or null"),
}


def _check_members(d, cls, field: str) -> None:
    if not isinstance(d, dict):
        raise FormatError(f"{field}: not an object")
    known = {f.name: f for f in fields(cls)}
    for k in d:
        if k not in known:
            raise FormatError(f"{field}.{k}: unknown member")
    for k, f in known.items():
        if k not in d:
            if f.default is MISSING and f.default_factory is MISSING:
                raise FormatError(f"{field}.{k}: missing member")
            continue
        check, what = _CHECKS.get(str(f.type), (None, None))
        if check is not None and not check(d[k]):
            shown = repr(d[k]) if len(repr(d[k])) <= 24 else type(d[k]).__name__
            raise FormatError(f"{field}.{k}: expected {what}, got {shown}")


def check_model(d) -> ModelConfig:
    """A ModelConfig from the untrusted `model` member; any problem is a FormatError naming the field."""
    _check_members(d, ModelConfig, "model")
    if d.get("vision") is not None:
        _check_members(d["vision"], VisionConfig, "model.vision")
    try:
        return ModelConfig.from_dict(d)
    except NinferError as e:
        msg = str(e)
        raise FormatError(msg if msg.startswith("model") else f"model.{msg}") from None
    except Exception as e:  # noqa: BLE001 - a config the dataclass cannot digest is still just bad input
        raise FormatError(f"model: invalid ({type(e).__name__}: {str(e)[:80]})") from None
