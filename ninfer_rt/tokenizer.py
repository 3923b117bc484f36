"""Tokenizer, chat template and streaming detokenization from an artifact's resources.

The tokenizer is the artifact's own `tokenizer.json` (HF `tokenizers`); the chat template is rendered in a
sandboxed jinja2 environment configured like HF's (`trim_blocks`, `lstrip_blocks`, `tojson`,
`raise_exception`), so a template cannot reach Python objects. Stop ids = the model's eos ids plus
`generation_config.json`'s `eos_token_id` (Qwen stops on both `<|endoftext|>` and `<|im_end|>`).
"""
from __future__ import annotations

import datetime
import json
import os

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from ninfer_formats.errors import NinferError


# Qwen3.8's tool-call tags (reference §15: ids 248058 / 248059); a tokenizer may mark them special
TOOL_CALL_TAGS = ("<tool_call>", "</tool_call>")


class TokenizerError(NinferError):
    """The artifact's tokenizer/template resources are missing or unusable, or rendering failed."""


def _resource_text(resources: dict, name: str) -> str | None:
    v = resources.get(name)
    if v is None:
        return None
    if not isinstance(v, (bytes, bytearray, memoryview)):
        return str(v)
    try:
        return bytes(v).decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"resource {name}: not valid UTF-8 "
                             f"(byte 0x{e.object[e.start]:02x} at offset {e.start})") from None


def text_problem(text: str) -> str | None:
    """Why `text` cannot be tokenized, or None. Command-line bytes that are not UTF-8 arrive as surrogate
    escapes and JSON `\\ud800` as a lone surrogate; the Rust tokenizer refuses both with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        if 0xDC80 <= c <= 0xDCFF:       # os.fsdecode's surrogateescape of one undecodable byte
            return f"not valid UTF-8 (byte 0x{c - 0xDC00:02x} at character {e.start})"
        return f"not valid UTF-8 text (lone surrogate U+{c:04X} at character {e.start})"
    return None


def first_text_problem(obj, path: str = "") -> tuple[str, str] | None:
    """(dotted path, problem) of the first string (key or value) in a JSON value that is not valid text."""
    stack = [(path, obj)]
    while stack:                          # iterative: a deeply nested request body must not hit the recursion limit
        where, v = stack.pop()
        if isinstance(v, str):
            why = text_problem(v)
            if why:
                return where, why
        elif isinstance(v, dict):
            for k, x in reversed(list(v.items())):
                sub = f"{where}.{k}" if where else str(k)
                stack.append((sub, x))
                stack.append((sub, k))    # checked first: a bad key also makes a bad path
        elif isinstance(v, list):
            stack.extend((f"{where}.{i}" if where else str(i), x) for i, x in reversed(list(enumerate(v))))
    return None


class ChatTemplateError(TokenizerError):
    """The artifact's chat template is unusable or failed while rendering: a server-side problem, not the
    request's (a template's own `raise_exception` about the messages stays a plain TokenizerError)."""


def _pick_template(tcfg: dict):
    """tokenizer_config.json's chat_template: a string, or HF's list of {name, template} (the default one)."""
    source = "tokenizer_config.json: chat_template"
    where = f"resource {source}"
    t = tcfg.get("chat_template")
    if t is None or isinstance(t, str):
        return t, source
    if isinstance(t, list) and all(isinstance(x, dict) for x in t):
        t = next((x.get("template") for x in t if x.get("name") == "default"), None)
        if t is None or isinstance(t, str):
            return t, source
        raise ChatTemplateError(f"{where}: the 'default' entry's template is {type(t).__name__}, expected a string")
    raise ChatTemplateError(f"{where}: expected a string or a list of {{name, template}} objects, "
                            f"got {type(t).__name__} {t!r:.60}")


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


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet, char -> byte: printable bytes stand for themselves, the other 68 bytes for
    the characters from U+0100 on, in byte order (the GPT-2 scheme Qwen's tokenizer uses)."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + n)] = b
            n += 1
    return out


_BYTE_OF = _byte_alphabet()


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
        added = self._tok.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self._added = frozenset(added)
        self._byte_level = type(self._tok.decoder).__name__ == "ByteLevel"
        self._template = None
        self.template_source = "chat_template.jinja"   # named in template errors
        self.template_problem: str | None = None          # a broken template, reported when it is needed

    @classmethod
    def from_resources(cls, resources: dict, eos_token_ids=()) -> Tokenizer:
        """From the artifact's resources {name: bytes|str} and the model config's eos ids."""
        text = _resource_text(resources, "tokenizer.json")
        if text is None:
            raise TokenizerError("resource tokenizer.json: missing from the artifact")
        tcfg = _json_resource(resources, "tokenizer_config.json")
        gen = _json_resource(resources, "generation_config.json")
        template, source, problem = _template_of(resources, tcfg)
        stop = set(_ids(eos_token_ids)) | set(_ids(gen.get("eos_token_id")))
        tok = cls(text, chat_template=template, bos_token=_tok_str(tcfg.get("bos_token")),
                  eos_token=_tok_str(tcfg.get("eos_token")))
        tok.template_source, tok.template_problem = source, problem
        if tok.eos_token is not None and tok.token_to_id(tok.eos_token) is not None:
            stop.add(tok.token_to_id(tok.eos_token))
        tok.stop_ids = frozenset(stop)
        return tok

    # ---- ids <-> text ----
    def encode(self, text: str) -> list[int]:
        """No BOS is added (Qwen); special-token text such as `<|im_start|>` maps to its id."""
        why = text_problem(text)
        if why:                  # callers check their inputs first; this keeps a TypeError out of the rest
            raise TokenizerError(f"prompt text: {why}")
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: a byte-level BPE piece may be part of a UTF-8 character, which its
        decoded text cannot show (OpenAI's logprobs `bytes`). Added tokens and other decoders: their text."""
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            return b""
        if self._byte_level and token_id not in self._added and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        return self.decode([token_id], skip_special_tokens=False).encode()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    # ---- chat template ----
    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True, tools=None,
                    **kwargs) -> str:
        template = self._compiled()
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   tools=tools, bos_token=self.bos_token or "",
                                   eos_token=self.eos_token or "", **kwargs)
        except TemplateError as e:       # raise_exception / undefined use: the template refuses these messages
            raise TokenizerError(f"chat template: {_first_line(e)}") from None
        except Exception as e:  # noqa: BLE001 -- e.g. {{ 1/0 }}: a bug in the artifact's template, not the input
            raise ChatTemplateError(f"resource {self.template_source}: rendering failed: "
                                    f"{type(e).__name__}: {_first_line(e)}") from None

    def _compiled(self):
        if self.template_problem:
            raise ChatTemplateError(self.template_problem)
        if not self.chat_template:       # a 400 like vLLM's: the client asked a base model for chat
            raise TokenizerError("resource chat_template.jinja: the artifact has no chat template")
        if self._template is None:
            try:
                self._template = _jinja_env().from_string(self.chat_template)
            except Exception as e:  # noqa: BLE001 -- TemplateSyntaxError mostly; any failure means unusable
                raise ChatTemplateError(f"resource {self.template_source}: {_first_line(e)}") from None
        return self._template

    def use_template(self, text: str, source: str) -> None:
        """Replace the artifact's chat template (serve --chat-template); `source` names it in errors."""
        self.chat_template, self.template_source, self.template_problem, self._template = text, source, None, None
        self.check_template()

    def check_template(self) -> None:
        """Raise TokenizerError now if the chat template cannot be used (missing, broken, not compiling)."""
        self._compiled()


def read_template(given: str) -> tuple[str, str]:
    """--chat-template: a file, or the template itself (vLLM takes both) -> (its name in errors, its text),
    compiled once to check it; TokenizerError naming it otherwise."""
    inline = not os.path.exists(given) and ("{{" in given or "{%" in given)
    name = "--chat-template (inline)" if inline else f"--chat-template {given}"
    text = given
    if not inline:
        try:
            with open(given, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{name}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    try:
        _jinja_env().from_string(text)
    except Exception as e:  # noqa: BLE001 -- TemplateSyntaxError mostly
        raise TokenizerError(f"{name}: {_first_line(e)}") from None
    return name, text


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _template_of(resources: dict, tcfg: dict) -> tuple[str | None, str, str | None]:
    """(template, its source for messages, problem). A broken template is kept as a problem rather than
    raised: raw prompts and /v1/completions do not need it, chat rendering reports it."""
    try:
        jinja = _resource_text(resources, "chat_template.jinja")
        if jinja:
            return jinja, "chat_template.jinja", None
        template, source = _pick_template(tcfg)
        return template, source, None
    except TokenizerError as e:
        return None, "chat_template.jinja", str(e)


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


def _find_ending_past(text: str, s: str, start: int, floor: int) -> int:
    """The first index >= start where s occurs and ends past `floor` chars; -1 if none."""
    return text.find(s, max(start, floor - len(s) + 1))


class TextStream:
    """Incremental detokenization with stop strings for one sequence.

    Decoding the whole output each time is O(n^2) and splits multi-byte characters; instead a window of
    ids is re-decoded and text is released only once it no longer ends in a partial character (U+FFFD).
    Text that could be the start of a stop string is held back until it is decided.
    """

    def __init__(self, tok: Tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True,
                 armed: bool = True, keep_stop: bool = False):
        """`armed=False`: stop strings do not apply until `arm()` (min_tokens: only text after it can stop);
        `keep_stop`: the text ends with the matched stop string (vLLM's include_stop_str_in_output)."""
        self.tok, self.stop, self.skip, self.keep_stop = tok, tuple(stop), skip_special_tokens, keep_stop
        self.ids: list[int] = []
        self._prefix = self._read = 0
        self.text = ""            # everything decoded so far (before stop trimming)
        self._sent = 0            # chars of `text` already released
        self.stopped = False      # a stop string matched; text is final
        self.matched: str | None = None      # which one (Anthropic's stop_sequence)
        self._floor = 0 if armed else None    # a stop string must end past this many chars of `text`

    def arm(self) -> None:
        """From the next pushed id on, stop strings apply (a match must end in text decoded from then)."""
        if self._floor is None:
            self._floor = len(self.text)

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
        if not self.stop:
            return self._emit(len(self.text))
        if self._floor is not None:
            start = max(0, self._sent - max(len(s) for s in self.stop) + 1)
            hits = [(i, s) for s in self.stop if (i := _find_ending_past(self.text, s, start, self._floor)) >= 0]
            if hits:
                at, self.matched = min(hits)
                self.text, self.stopped = self.text[:at + len(self.matched) * self.keep_stop], True
                return self._emit(len(self.text))
        # unarmed too: a stop string begun before the arming may still end after it, and then it is cut
        return self._emit(len(self.text) - self._held())

    def _held(self) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string (none is held when a
        match keeps its stop string: the text released stays a prefix of the final text either way)."""
        if self.keep_stop:
            return 0
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
