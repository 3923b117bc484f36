"""Tokenizer, chat template and streaming detokenization from an artifact's resources.

The tokenizer is the artifact's own `tokenizer.json` (HF `tokenizers`); the chat template is rendered in a
sandboxed jinja2 environment configured like HF's (`trim_blocks`, `lstrip_blocks`, `tojson`,
`raise_exception`), so a template cannot reach Python objects. Stop ids = the model's eos ids plus
`generation_config.json`'s `eos_token_id` (Qwen stops on both `<|endoftext|>` and `<|im_end|>`).
"""
from __future__ import annotations

import datetime
import json

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from ninfer_formats.errors import NinferError


class TokenizerError(NinferError):
    """The artifact's tokenizer/template resources are missing or unusable, or rendering failed."""


def _resource_text(resources: dict, name: str) -> str | None:
    v = resources.get(name)
    if v is None:
        return None
    return v.decode("utf-8") if isinstance(v, (bytes, bytearray, memoryview)) else str(v)


def _json_resource(resources: dict, name: str) -> dict:
    text = _resource_text(resources, name)
    if text is None:
        return {}
    try:
        d = json.loads(text)
    except ValueError as e:
        raise TokenizerError(f"resource {name}: invalid JSON ({e})") from None
    if not isinstance(d, dict):
        raise TokenizerError(f"resource {name}: expected a JSON object")
    return d


def _ids(v) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in (v if isinstance(v, (list, tuple)) else [v])]


class Tokenizer:
    def __init__(self, tokenizer_json: str, *, chat_template: str | None = None, stop_ids=(),
                 bos_token: str | None = None, eos_token: str | None = None):
        try:
            self._tok = _HFTokenizer.from_str(tokenizer_json)
        except Exception as e:  # noqa: BLE001 -- the Rust side raises a plain Exception, multi-line
            raise TokenizerError(f"resource tokenizer.json: cannot be parsed "
                                 f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        self.chat_template = chat_template
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self.bos_token, self.eos_token = bos_token, eos_token
        self.special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        self._template = None

    @classmethod
    def from_resources(cls, resources: dict, eos_token_ids=()) -> Tokenizer:
        """From the artifact's resources {name: bytes|str} and the model config's eos ids."""
        text = _resource_text(resources, "tokenizer.json")
        if text is None:
            raise TokenizerError("resource tokenizer.json: missing from the artifact")
        tcfg = _json_resource(resources, "tokenizer_config.json")
        gen = _json_resource(resources, "generation_config.json")
        template = _resource_text(resources, "chat_template.jinja") or tcfg.get("chat_template")
        if isinstance(template, list):     # HF allows named templates; the default is the one to use
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        stop = set(_ids(eos_token_ids)) | set(_ids(gen.get("eos_token_id")))
        tok = cls(text, chat_template=template, bos_token=_tok_str(tcfg.get("bos_token")),
                  eos_token=_tok_str(tcfg.get("eos_token")))
        if tok.eos_token is not None and tok.token_to_id(tok.eos_token) is not None:
            stop.add(tok.token_to_id(tok.eos_token))
        tok.stop_ids = frozenset(stop)
        return tok

    # ---- ids <-> text ----
    def encode(self, text: str) -> list[int]:
        """No BOS is added (Qwen); special-token text such as `<|im_start|>` maps to its id."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    # ---- chat template ----
    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True, tools=None,
                    **kwargs) -> str:
        if not self.chat_template:
            raise TokenizerError("resource chat_template.jinja: the artifact has no chat template")
        if self._template is None:
            try:
                self._template = _jinja_env().from_string(self.chat_template)
            except TemplateError as e:
                raise TokenizerError(f"resource chat_template.jinja: {e}") from None
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, bos_token=self.bos_token or "",
                                         eos_token=self.eos_token or "", **kwargs)
        except TemplateError as e:
            raise TokenizerError(f"chat template: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _tok_str(v) -> str | None:
    if isinstance(v, dict):      # old tokenizer_config style {"content": ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


def _raise(msg):
    raise TemplateError(str(msg))


def _tojson(x, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    return json.dumps(x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class TextStream:
    """Incremental detokenization with stop strings for one sequence.

    Decoding the whole output each time is O(n^2) and splits multi-byte characters; instead a window of
    ids is re-decoded and text is released only once it no longer ends in a partial character (U+FFFD).
    Text that could be the start of a stop string is held back until it is decided.
    """

    def __init__(self, tok: Tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.tok, self.stop, self.skip = tok, tuple(stop), skip_special_tokens
        self.ids: list[int] = []
        self._prefix = self._read = 0
        self.text = ""            # everything decoded so far (before stop trimming)
        self._sent = 0            # chars of `text` already released
        self.stopped = False      # a stop string matched; text is final

    def push(self, ids) -> str:
        """Add ids; return newly released text ("" when held back or after a stop string)."""
        if self.stopped:
            return ""
        self.ids.extend(int(i) for i in ids)
        before = self.tok.decode(self.ids[self._prefix:self._read], self.skip)
        now = self.tok.decode(self.ids[self._prefix:], self.skip)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._release()

    def _release(self) -> str:
        if self.stop:
            start = max(0, self._sent - max(len(s) for s in self.stop) + 1)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[:min(hits)], True
                return self._emit(len(self.text))
            return self._emit(len(self.text) - self._held())
        return self._emit(len(self.text))

    def _held(self) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _emit(self, upto: int) -> str:
        upto = max(upto, self._sent)
        out, self._sent = self.text[self._sent:upto], upto
        return out

    def flush(self) -> str:
        """At the end of generation: release held-back text (a partial stop string is plain text)."""
        if not self.stopped:      # a trailing incomplete character is released as U+FFFD
            before = self.tok.decode(self.ids[self._prefix:self._read], self.skip)
            now = self.tok.decode(self.ids[self._prefix:], self.skip)
            self.text += now[len(before):]
            self._prefix = self._read = len(self.ids)
        return self._emit(len(self.text))
