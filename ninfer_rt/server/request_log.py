"""Optional JSONL request log (`--log-requests FILE`): one line per event, never prompt or completion text.

Events: `server_start`, `request_done` (timings, token counts, finish reason, speculative stats),
`request_error` (status and message of a request that failed inside the engine).
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
