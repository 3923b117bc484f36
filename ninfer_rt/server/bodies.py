"""OpenAI reply bodies: a chat or text completion, its choices and usage, and the chunks of a streamed one."""
from __future__ import annotations

import time
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt: int, completion: int, cached: int = 0) -> dict:
    """`cached`: prompt tokens resumed from the prefix cache (vLLM's prompt_tokens_details, sent when some were)."""
    use = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached:
        use["prompt_tokens_details"] = {"cached_tokens": cached}
    return use


def cached_tokens(use: dict) -> int:
    return (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _body(obj: str, rid: str, model: str, created: int, fp: str | None, choices: list, use) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": fp,
            "choices": choices, **use}


def chat_choice(index: int, content: str, reasoning: str | None, finish: str, logprobs: dict | None = None,
                tool_calls: list[dict] | None = None) -> dict:
    """With tool calls, an answer of whitespace only is a null content, as OpenAI sends it."""
    msg = {"role": "assistant", "content": content, "reasoning_content": reasoning or None}
    if tool_calls:
        msg["tool_calls"] = tool_calls
        msg["content"] = content if content.strip() else None
    return {"index": index, "message": msg, "finish_reason": finish, "logprobs": logprobs}


def completion_choice(index: int, text: str, finish: str, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def reply_body(rid: str, model: str, chat: bool, choices: list[dict], use: dict, fp: str | None = None) -> dict:
    obj = "chat.completion" if chat else "text_completion"
    return _body(obj, rid, model, int(time.time()), fp, choices, {"usage": use})


class Chunks:
    """The SSE chunk bodies of one streamed reply (same id, created and fingerprint on every chunk).

    With `include_usage`, every chunk carries `"usage": null` and only the extra last one (empty
    `choices`) the counts, as OpenAI documents for `stream_options.include_usage`; without it, no chunk
    has a `usage` key. With vLLM's `continuous_usage_stats` too, a choice's chunks carry its counts so far
    (`running[index]`, kept by the stream)."""

    def __init__(self, rid: str, model: str, *, chat: bool, include_usage: bool, fp: str | None = None,
                 continuous: bool = False):
        self.rid, self.model, self.chat, self.fp = rid, model, chat, fp
        self.include_usage, self.created = include_usage, int(time.time())
        self.continuous = include_usage and continuous
        self.running: dict[int, dict] = {}

    def _make(self, choices: list, use) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        extra = {"usage": use} if self.include_usage else {}
        return _body(obj, self.rid, self.model, self.created, self.fp, choices, extra)

    def delta(self, delta_or_text, finish: str | None = None, logprobs: dict | None = None, index: int = 0) -> dict:
        key = "delta" if self.chat else "text"
        return self._make([{"index": index, key: delta_or_text, "finish_reason": finish, "logprobs": logprobs}],
                          self.running.get(index) if self.continuous else None)

    def usage(self, use: dict) -> dict:
        return self._make([], use)
