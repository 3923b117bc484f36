"""OpenAI-compatible request models, response bodies and error bodies.

Requests are validated strictly (a string where a number belongs is a 400, not a coercion) but unknown
fields are ignored, as OpenAI clients send fields this server does not know; as vLLM does, the server says so on
stderr (once per field name and route model, `_say_ignored`). Every error leaves the server
as `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status.
"""
from __future__ import annotations

import functools
import json
import re
import sys
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..sampling import MAX_LOGPROBS

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16             # n: choices per request (each one an engine request with its own KV reservation)


class ApiError(Exception):
    """An error answered to the client; `status` is the HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False     # vLLM's: with include_usage, every chunk carries the counts so far


class ImageURL(_Strict):
    url: str
    detail: str | None = None          # OpenAI's resolution hint; the artifact's preprocessor decides


class ContentPart(_Strict):
    """A text part, or an image part (`image_url` as OpenAI sends it, or the HF `image` convention)."""

    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None
    image: str | None = None


IMAGE_PART_TYPES = ("image_url", "image")


class FunctionCall(_Strict):
    name: str
    arguments: str                       # a JSON object's text, as OpenAI sends it back


class ToolCallIn(_Strict):
    """A call in an earlier assistant turn of the conversation."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None       # a JSON schema; its property types convert the parsed values
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallIn] | None = None


class _Sampling(_Strict):
    """Fields shared by chat and completions (OpenAI names plus vLLM's top_k/min_p/ignore_eos)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int | None = Field(default=None, ge=0)     # vLLM's: no stop (token or string) before this many
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None     # vLLM's (HF semantics: prompt and output tokens; 1 = off)
    seed: int | None = None
    n: int | None = None                    # null means the default (1), as in OpenAI's API
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None     # vLLM's: token ids that end the output (kept with ignore_eos)
    user: str | None = None
    logit_bias: dict | None = None          # {"token id": bias in [-100, 100]}
    # structured output (ninfer_rt.grammar): OpenAI's response_format, or one of vLLM's guided_* fields
    response_format: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None      # vLLM's {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    allowed_token_ids: list[int] | None = None  # vLLM's: the only tokens the output may hold
    bad_words: list[str] | None = None          # vLLM's: words the output may not contain (as tokenized)
    include_stop_str_in_output: bool = False    # vLLM's: a matched stop string stays at the end of the text
    skip_special_tokens: bool = True            # vLLM's: false keeps special tokens' text in the output
    truncate_prompt_tokens: int | None = None   # vLLM's: only the prompt's last k tokens (-1: the context length)
    prompt_logprobs: int | None = None          # vLLM's: each prompt token's logprob, rank and k alternatives
    return_tokens_as_token_ids: bool = False    # vLLM's: logprobs name their tokens "token_id:N"
    priority: int = 0                           # vLLM's: queue order under --scheduling-policy priority (lower first)
    # vLLM's fields this server does not implement: a 400 unless they hold their no-op value (_NOT_IMPLEMENTED)
    use_beam_search: bool = False
    logits_processors: list | None = None
    spaces_between_special_tokens: bool = True
    length_penalty: float | int = 1


# vLLM's request fields without an implementation here -> their no-op values
_NOT_IMPLEMENTED = {"use_beam_search": False, "logits_processors": None, "spaces_between_special_tokens": True,
                    "length_penalty": 1, "chat_template": None}


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    echo: bool = False                           # vLLM's: the reply repeats the final message of its own role first
    chat_template: str | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    chat_template_kwargs: dict | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict | None = None        # "auto" (the default with tools), "none", "required", a function
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = None    # vLLM's; null: true
    continue_final_message: bool = False         # vLLM's: the prompt ends inside the final message (a prefill)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None


def parse(model: type[_Strict], data) -> _Strict:
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        # a union field reports one error per member; the deepest one names the part that is actually wrong
        err = max(e.errors(), key=lambda x: len(x["loc"]))
        # pydantic adds the union member tried ('str', 'list[str]') to the location; the client wants the field
        loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in _TYPE_NAMES))]
        param = ".".join(loc) or None
        raise bad_request(f"{param or 'body'}: {err['msg']}", param=param) from None
    _check_text(data)
    _say_ignored(model, data)
    if isinstance(req, _Sampling):
        _check_common(req)
    return req


_IGNORED_SAID: set = set()


@functools.cache
def _known_fields(model: type[_Strict]) -> frozenset:
    return frozenset(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}


def _say_ignored(model: type[_Strict], data: dict) -> None:
    """One stderr line per top-level field name (and request model) this server does not read."""
    known = _known_fields(model)
    new = sorted(k for k in data if k not in known and (model.__name__, k) not in _IGNORED_SAID)
    if new:
        _IGNORED_SAID.update((model.__name__, k) for k in new)
        print(f"ninfer-rt: {model.__name__}: request fields ignored (not implemented here): {', '.join(new)}",
              file=sys.stderr, flush=True)


def check_model(model: str | None, served: tuple[str, ...]) -> None:
    """`served`: the names this server answers to (--served-model-name; replies carry the first)."""
    if model is not None and model not in served:
        names = ", ".join(map(repr, served))
        raise ApiError(404, f"model {model!r} does not exist (this server serves {names})", param="model",
                       code="model_not_found")


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "ContentPart", "ImageURL", "StreamOptions",
               "ChatMessage", "Tool", "FunctionDef", "ToolCallIn", "FunctionCall"}


def _check_text(data: dict) -> None:
    """JSON may escape a lone surrogate (`"\\ud800"`); no tokenizer can take it, so it is the client's 400."""
    from ..tokenizer import first_text_problem
    bad = first_text_problem(data)
    if bad is not None:
        where, why = bad
        raise bad_request(f"{where or 'body'}: {why}", param=where or None)


def chat_echo(req: ChatRequest) -> str:
    """vLLM's chat `echo`: the final message's text when it has the reply's role (the assistant, or with
    add_generation_prompt false / continue_final_message the final message's own role), else ""."""
    last = req.messages[-1] if req.messages else None
    if not req.echo or last is None:
        return ""
    role = last.role if req.add_generation_prompt is False or req.continue_final_message else "assistant"
    if last.role != role or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(p.text for p in last.content if p.type == "text" and p.text)


def _check_common(req: _Sampling) -> None:
    for name, noop in _NOT_IMPLEMENTED.items():
        v = getattr(req, name, noop)
        if v != noop and not (noop is None and v == []):
            raise bad_request(f"{name}: not supported by this server (only {noop!r})", param=name)
    if req.allowed_token_ids == []:
        raise bad_request("allowed_token_ids: must not be empty (leave it out to allow every token)",
                          param="allowed_token_ids")
    if req.prompt_logprobs is not None:
        _check_logprobs("prompt_logprobs", req.prompt_logprobs)
        if req.stream:
            raise bad_request("prompt_logprobs: not supported with stream (ask for a blocking reply)",
                              param="prompt_logprobs")
    t = req.truncate_prompt_tokens
    if t is not None and not (t >= 1 or t == -1):
        raise bad_request(f"truncate_prompt_tokens: expected an integer >= 1, or -1 (the context length), got {t}",
                          param="truncate_prompt_tokens")
    if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
        raise bad_request(f"n: expected an integer in [1, {MAX_CHOICES}], got {req.n}", param="n")
    from .structured_api import structured       # it builds on this module
    structured(req)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options: only allowed when stream is true", param="stream_options")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP_STRINGS or not all(stops):
        raise bad_request(f"stop: expected at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
    if isinstance(req, ChatRequest):
        check_chat(req)
    else:
        _check_completion(req)


def check_chat(req: ChatRequest) -> None:
    if not req.messages:
        raise bad_request("messages: must contain at least one message", param="messages")
    for i, m in enumerate(req.messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            if (part.type == "text" and part.text is not None) or part.type in IMAGE_PART_TYPES:
                continue           # image parts: their URLs are checked with the images (server/images.py)
            where = f"messages.{i}.content.{j}"
            if part.type == "text":
                raise bad_request(f"{where}: a text part needs a 'text' string", param=f"{where}.text")
            raise bad_request(f"{where}: only text and image_url parts are supported, got type {part.type!r}",
                              param=where)
    if req.top_logprobs is not None:
        _check_logprobs("top_logprobs", req.top_logprobs)
        if not req.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", param="top_logprobs")
    _check_tools(req)
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request("continue_final_message: cannot be combined with add_generation_prompt true",
                          param="continue_final_message")


# a name the XML call format can carry (OpenAI's own rule is ^[a-zA-Z0-9_-]{1,64}$; dots are common too)
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_PARAM_NAME = re.compile(r"[^<>\s](?:[^<>\n]*[^<>\s])?")


def _check_tools(req: ChatRequest) -> None:
    names = [t.function.name for t in req.tools or ()]
    for i, n in enumerate(names):
        if not _TOOL_NAME.fullmatch(n):
            raise bad_request(f"tools.{i}.function.name: {n!r} is not a valid function name (letters, digits, "
                              f"'_', '-', '.', ':'; 1 to 64 characters)", param=f"tools.{i}.function.name")
        if n in names[:i]:
            raise bad_request(f"tools.{i}.function.name: {n!r} is defined twice", param=f"tools.{i}.function.name")
        props = (req.tools[i].function.parameters or {}).get("properties", {})
        where = f"tools.{i}.function.parameters.properties"
        if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
            raise bad_request(f"{where}: expected an object of JSON schemas", param=where)
        bad = next((k for k in props if not _PARAM_NAME.fullmatch(k)), None)
        if bad is not None:       # the call format writes <parameter=NAME>: it cannot carry these
            raise bad_request(f"{where}: parameter name {bad!r} cannot be written in a tool call (no '<', '>', "
                              f"line breaks or surrounding spaces)", param=where)
    forced_tool(req)
    for i, m in enumerate(req.messages):
        for j, call in enumerate(m.tool_calls or ()):
            where = f"messages.{i}.tool_calls.{j}.function.arguments"
            if m.role != "assistant":
                raise bad_request(f"messages.{i}.tool_calls: only assistant messages make tool calls",
                                  param=f"messages.{i}.tool_calls")
            if not isinstance(_json_or_none(call.function.arguments), dict):
                raise bad_request(f"{where}: expected the text of a JSON object", param=where)


def forced_tool(req: ChatRequest) -> str | bool:
    """What tool_choice forces: False (nothing: "auto", "none" or absent), True ("required": some call) or the
    name of the function to call."""
    choice, names = req.tool_choice, [t.function.name for t in req.tools or ()]
    if choice is None or choice in ("auto", "none"):
        return False
    if choice == "required":
        forced = True
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        forced = choice["function"].get("name")
        if forced not in names:
            raise bad_request(f"tool_choice.function.name: {forced!r} is not one of the request's tools",
                              param="tool_choice.function.name")
    else:
        raise bad_request(f"tool_choice: expected 'auto', 'none', 'required' or {{\"type\": \"function\", "
                          f"\"function\": {{\"name\": ...}}}}, got {choice!r}", param="tool_choice")
    if not names:
        raise bad_request("tool_choice: forcing a call needs tools", param="tool_choice")
    return forced


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _check_completion(req: CompletionRequest) -> None:
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)) and len(p) != 1:
        raise bad_request("prompt: exactly one prompt per request is supported", param="prompt")
    if isinstance(p, list) and (not p or (isinstance(p[0], (str, list)) and not p[0])):
        raise bad_request("prompt: must not be empty", param="prompt")
    if isinstance(p, str) and not p:
        raise bad_request("prompt: must not be empty", param="prompt")
    if req.best_of not in (None, 1):
        raise bad_request(f"best_of: only best_of=1 is supported, got {req.best_of}", param="best_of")
    if req.suffix:
        raise bad_request("suffix: not supported by this server", param="suffix")
    if req.logprobs is not None:
        _check_logprobs("logprobs", req.logprobs)


def _check_logprobs(name: str, v: int) -> None:
    if not 0 <= v <= MAX_LOGPROBS:
        raise bad_request(f"{name}: expected an integer in [0, {MAX_LOGPROBS}], got {v}", param=name)


def message_text(m: ChatMessage) -> str:
    """A message's text: its string, or its text parts joined."""
    if isinstance(m.content, list):
        return "".join(p.text or "" for p in m.content if p.type == "text")
    return m.content or ""


def _template_content(content):
    """Text parts joined into one string; with image parts, the part list itself, so the chat template
    emits one vision placeholder per image in order (the images are read from the request separately)."""
    if not isinstance(content, list):
        return content or ""
    if not any(p.type in IMAGE_PART_TYPES for p in content):
        return "".join(p.text for p in content)
    return [p.model_dump(exclude_none=True) for p in content]


def chat_messages(req: ChatRequest) -> list[dict]:
    """Messages as plain dicts for the chat template."""
    out = []
    for m in req.messages:
        d = {"role": m.role, "content": _template_content(m.content)}
        for k in ("name", "reasoning_content", "tool_call_id"):
            if getattr(m, k) is not None:
                d[k] = getattr(m, k)
        if m.tool_calls:         # arguments as a mapping: templates iterate them (`arguments|items`), as in vLLM
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in m.tool_calls]
        out.append(d)
    return out


def template_tools(req: ChatRequest) -> list[dict] | None:
    """The request's tools for the chat template (OpenAI's {"type", "function"} objects)."""
    return [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None


def parses_tools(req: ChatRequest) -> bool:
    """Calls are parsed out of the answer unless tool_choice is "none" (the tools are still in the prompt, as in
    vLLM)."""
    return bool(req.tools) and req.tool_choice != "none"
