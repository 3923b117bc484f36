"""Optional JSONL request log (`--log-requests FILE`): one line per event, never prompt or completion text.

Events: `server_start`, `request_done` (timings, token counts, finish reason, speculative stats; image
requests add `images` and `image_tokens`), `request_error` (status and message of a request that failed
inside the engine).
"""
from __future__ import annotations

import json
import threading
import time


class RequestLog:
    def __init__(self, path: str):
        self._f = open(path, "a", buffering=1, encoding="utf-8")      # line-buffered: each event lands whole
        self._lock = threading.Lock()

    def write(self, event: str, **fields) -> None:
        line = json.dumps({"event": event, "time": round(time.time(), 6), **fields}, separators=(",", ":"))
        with self._lock:
            if not self._f.closed:
                self._f.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._f.close()


class NullLog:
    def write(self, event: str, **fields) -> None:
        pass

    def close(self) -> None:
        pass


def done_record(h, reason: str, now: float) -> dict:
    """The `request_done` fields of a finished scheduler Handle."""
    rec = {"id": h.id, "reply_id": h.reply_id, "choice": h.choice, "finish_reason": reason,
           "prompt_tokens": h.prompt_len, "cached_tokens": h.cached, "completion_tokens": h.generated,
           "timings_seconds": _timings(h, now),
           "speculative": _spec_record(h)}
    if h.images:
        rec.update(images=h.images, image_tokens=h.image_tokens)
    return rec


def _spec_record(h) -> dict:
    """Tokens per emitting step (1 + mean accepted drafts with MTP); this request's MTP drafted / accepted
    counts and their ratio when the engine reports them (StepOutput.drafted / .accepted)."""
    rec = {"steps": h.steps, "tokens_per_step": round(h.generated / h.steps, 4) if h.steps else None}
    if h.drafted is not None:
        acc = h.accepted or 0
        rec.update(drafted=h.drafted, accepted=acc,
                   acceptance_rate=round(acc / h.drafted, 4) if h.drafted else None)
    return rec


def _timings(h, now: float) -> dict:
    def d(a, b):
        return None if a is None or b is None else round(b - a, 6)
    return {"queued": d(h.arrival, h.admitted), "ttft": d(h.arrival, h.first),
            "decode": d(h.first, h.last), "total": d(h.arrival, now)}
