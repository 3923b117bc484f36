"""Checks of the tokenizer and chat-template files, so an artifact the runtime cannot talk to is never packed.

The runtime (`ninfer_rt.tokenizer`) needs `tokenizer.json` to tokenize any prompt and compiles the chat template
in its own sandboxed jinja2 environment; both are done here the same way, once, at pack time. Templates are
only compiled, never rendered: rendering needs messages, and `raise_exception` is legitimate at render time.
"""
from __future__ import annotations

from ninfer_formats.errors import SourceError


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _text(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SourceError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def check_tokenizer(raw: bytes | None, where: str) -> None:
    """Refuse a missing tokenizer.json or one the `tokenizers` library cannot load."""
    if raw is None:
        raise SourceError(f"{where}: missing (the runtime needs it to tokenize prompts)")
    from tokenizers import Tokenizer
    try:
        Tokenizer.from_str(_text(raw, where))
    except SourceError:
        raise
    except Exception as e:  # noqa: BLE001 -- the Rust side raises a plain Exception, multi-line
        raise SourceError(f"{where}: not loadable by the tokenizers library ({_first_line(e)})") from None


def check_template(raw: bytes | str, where: str) -> str:
    """The template text, compiled as the runtime compiles it; a syntax error names its line."""
    from jinja2 import TemplateError
    from ninfer_rt.tokenizer import _jinja_env     # the runtime's environment: same extensions, same syntax
    text = raw if isinstance(raw, str) else _text(raw, where)
    try:
        _jinja_env().from_string(text)
    except TemplateError as e:
        line = getattr(e, "lineno", None)
        at = f"line {line}: " if line else ""
        raise SourceError(f"{where}: not a valid Jinja template ({at}{_first_line(e)})") from None
    return text


def config_template(v, where: str) -> str | None:
    """tokenizer_config.json's `chat_template`: a string, or HF's named list [{name, template}] (-> "default")."""
    if v is None or isinstance(v, str):
        return v
    named = isinstance(v, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                        and isinstance(t.get("template"), str) for t in v)
    if not named:
        raise SourceError(f"{where}: chat_template: expected a string or a list of {{name, template}} objects, "
                          f"got {v!r:.40}")
    return next((t["template"] for t in v if t["name"] == "default"), None)
