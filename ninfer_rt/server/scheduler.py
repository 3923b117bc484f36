"""The asyncio-facing scheduler: one background thread owns the Engine.

HTTP handlers (event-loop thread) call `submit()` and read events from the returned `Handle`; the engine
thread admits waiting requests between steps (FIFO, up to `max_concurrency`, while the KV reservation
fits), calls `engine.step()` while there is work, detokenizes, and pushes events to each request's
asyncio queue with `loop.call_soon_threadsafe`. The Engine is never touched from another thread.

Image requests carry their `VisionRequest` (placeholders already expanded, pixels preprocessed); the engine
runs the tower when it admits them, on this thread. Their prompt length is the expanded one everywhere
(context check, reservation, usage, metrics).

KV admission: a request reserves pages for prompt + max_tokens (+ `reserve_slack` for speculative drafts
written past the end), rounded up to whole pages; the sum of reservations never exceeds the pool, so an
admitted request always runs to completion (never truncated, never preempted).
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field, replace

from ..sampling import SamplingParams
from .bodies import usage
from .protocol import ApiError, bad_request
from .reasoning import OutputText
from .request_log import NullLog, done_record

DEFAULT_MAX_TOKENS = 4096
POLICIES = ("fcfs", "priority")     # vLLM's --scheduling-policy values


@dataclass(frozen=True)
class SchedulerConfig:
    max_concurrency: int = 4
    max_context: int = 4096            # prompt + completion tokens of one request
    max_pending: int = 64              # queued (not yet running) requests before 429
    reserve_slack: int = 0             # extra KV tokens reserved per request (speculative drafts)
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    policy: str = "fcfs"               # vLLM's --scheduling-policy: "fcfs", or "priority" (lower value first)

    def __post_init__(self):
        for n in ("max_concurrency", "max_context", "max_pending", "default_max_tokens"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"scheduler.{n}: expected a positive integer, got {v!r}")
        if not isinstance(self.reserve_slack, int) or self.reserve_slack < 0:
            raise ValueError(f"scheduler.reserve_slack: expected an integer >= 0, got {self.reserve_slack!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"scheduler.policy: expected one of {', '.join(POLICIES)}, got {self.policy!r}")


@dataclass(eq=False)
class Handle:
    """One request. Fields after `events` belong to the engine thread until `done` is set."""

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    text: OutputText
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    vision: object = None              # VisionRequest of an image request until admitted (pixels), then None
    prompt_len: int = 0                # tokens the engine prefills (image placeholders expanded)
    images: int = 0
    image_tokens: int = 0              # of prompt_len, image tokens
    pages: int = 0                     # reserved KV pages
    priority: int = 0                  # queue order under the "priority" policy (lower first, then arrival)
    arrival: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    first: float | None = None
    last: float | None = None
    generated: int = 0
    steps: int = 0                     # engine steps that emitted tokens for this request
    drafted: int | None = None         # per-request MTP counts, when the engine's StepOutput carries them
    accepted: int | None = None
    cached: int = 0                    # prompt tokens the engine resumed from its prefix cache
    reply_id: str | None = None        # the client's response id, and which of its n choices this is
    choice: int = 0
    in_engine: bool = False
    done: bool = False
    cancelled: bool = False
    scheduler: Scheduler | None = field(default=None, repr=False)

    def cancel(self) -> None:
        """Client gone: free the request's KV and state at the next step boundary (idempotent)."""
        if self.scheduler is not None and not self.done:
            self.scheduler.cancel(self)

    async def next_event(self):
        """('delta', reasoning, content, logprobs, reasoning ids among them) | ('prompt', prompt logprobs) |
        ('done', finish_reason, usage) | ('error', ApiError)."""
        return await self.events.get()


class Scheduler:
    def __init__(self, engine, kv_pool, tokenizer, config: SchedulerConfig, metrics, log=None, thread_init=None):
        """`thread_init` runs first in the engine thread (per-thread torch state: CUDA device, grad mode)."""
        self.engine, self.pool, self.tok, self.cfg, self.metrics = engine, kv_pool, tokenizer, config, metrics
        self._thread_init = thread_init
        self.log = log or NullLog()
        self.page_size, self.total_pages = kv_pool.page_size, kv_pool.num_pages
        self._cv = threading.Condition()
        self._waiting: collections.deque[Handle] = collections.deque()
        self._cancels: list[Handle] = []
        self._running: dict[str, Handle] = {}
        self._reserved = 0
        self._busy = False
        self._stopping = self._draining = False
        self._ids = itertools.count()
        self._spec_seen = (0, 0, [], [])
        self._prefix_seen = (0, 0)
        self._thread = threading.Thread(target=self._run, name="ninfer-engine", daemon=True)
        self.metrics.set_kv(self.total_pages, 0, 0)

    def start(self) -> None:
        self._thread.start()

    # ---- event-loop side ----
    @property
    def max_context(self) -> int:
        return min(self.cfg.max_context, self.total_pages * self.page_size - self.cfg.reserve_slack)

    def max_tokens_for(self, prompt_len: int, requested: int | None, prompt_param: str = "messages",
                       limit_param: str = "max_tokens") -> int:
        """The completion budget; 400 `context_length_exceeded` if the request cannot fit. `limit_param`: the
        request field that set `requested` (max_tokens or max_completion_tokens), named in the error."""
        limit = self.max_context
        if prompt_len >= limit:
            raise bad_request(f"the prompt has {prompt_len} tokens; this server's context limit is {limit} "
                              f"tokens (prompt + completion)", param=prompt_param, code="context_length_exceeded")
        if requested is None:
            return min(self.cfg.default_max_tokens, limit - prompt_len)
        if prompt_len + requested > limit:
            raise bad_request(f"prompt ({prompt_len} tokens) + {limit_param} ({requested}) exceeds this server's "
                              f"context limit of {limit} tokens", param=limit_param, code="context_length_exceeded")
        return requested

    def submit(self, prompt_ids: list[int], params: SamplingParams, split=None, vision=None,
               image_tokens: int = 0) -> Handle:
        """Queue a request (call on the event loop); 429 when the queue is full, 503 while draining.
        `vision`: the request's VisionRequest, prepared from `prompt_ids` (its length is the prompt's)."""
        return self.submit_all([self.handle(prompt_ids, params, split, vision, image_tokens)])[0]

    def handle(self, prompt_ids: list[int], params: SamplingParams, split=None, vision=None,
               image_tokens: int = 0, keep_special: bool = False, priority: int = 0) -> Handle:
        """A request to `submit_all` (the arguments of `submit`; `keep_special`: see OutputText; `priority`: its
        place in the queue under the "priority" policy, where it must be 0 otherwise)."""
        if priority and self.cfg.policy != "priority":
            raise bad_request(f"priority: {priority} needs priority scheduling; this server schedules first come, "
                              f"first served (start it with --scheduling-policy priority)", param="priority")
        n_prompt, images = (len(vision), len(vision.grid_thw)) if vision is not None else (len(prompt_ids), 0)
        h = Handle(id=f"r{next(self._ids)}", prompt_ids=list(prompt_ids), params=replace(params, stop=()),
                   text=OutputText(self.tok, params.stop, split, keep_special or not params.skip_special_tokens,
                                   params.min_tokens, params.include_stop_str_in_output,
                                   not params.skip_special_tokens),
                   loop=asyncio.get_running_loop(),
                   events=asyncio.Queue(), vision=vision, prompt_len=n_prompt, images=images,
                   image_tokens=image_tokens, scheduler=self, priority=priority)
        self.max_tokens_for(h.prompt_len, params.max_tokens)
        h.pages = -(-(h.prompt_len + params.max_tokens + self.cfg.reserve_slack) // self.page_size)
        return h

    def submit_all(self, handles: list[Handle]) -> list[Handle]:
        """Queue requests together (a reply's n choices): all of them, or none with the 429 / 503."""
        if not self.healthy():
            raise ApiError(503, "the engine failed and cannot serve; restart the server", type="server_error",
                           code="engine_unusable")
        with self._cv:
            if self._draining:
                raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
            if len(self._waiting) + len(handles) > self.cfg.max_pending:
                raise ApiError(429, f"too many queued requests ({self.cfg.max_pending}); retry later",
                               type="rate_limit_error", code="queue_full")
            for h in handles:
                self._enqueue(h)
            self.metrics.waiting.set(len(self._waiting))
            self._cv.notify()
        return handles

    def _enqueue(self, h: Handle) -> None:
        """FCFS: at the end. Priority: behind every waiting request of the same or a lower value (vLLM's order:
        priority, then arrival); a running request is never preempted for it."""
        if self.cfg.policy == "priority":
            i = next((i for i, w in enumerate(self._waiting) if w.priority > h.priority), len(self._waiting))
            self._waiting.insert(i, h)
        else:
            self._waiting.append(h)

    def cancel(self, h: Handle) -> None:
        with self._cv:
            if h.done or h.cancelled:
                return
            h.cancelled = True
            self._cancels.append(h)
            self._cv.notify()

    def healthy(self) -> bool:
        """False once the engine says it can no longer step (e.g. a failed TP step left the ranks out of step)."""
        return bool(getattr(self.engine, "usable", True))

    def idle(self) -> bool:
        with self._cv:
            return not self._waiting and not self._running and not self._cancels

    def drain(self, timeout_s: float) -> bool:
        """Refuse new requests, let queued and running ones finish within timeout_s; True if all did."""
        with self._cv:
            self._draining = True
            deadline = time.monotonic() + timeout_s
            while (self._waiting or self._running) and time.monotonic() < deadline:
                self._cv.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            return not (self._waiting or self._running)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Cancel whatever is left, free it in the engine, and end the thread."""
        with self._cv:
            self._draining = True
            for h in list(self._waiting) + list(self._running.values()):
                if not h.cancelled:
                    h.cancelled = True
                    self._cancels.append(h)
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self.log.close()

    # ---- engine thread ----
    def _run(self) -> None:
        if self._thread_init is not None:
            self._thread_init()
        while True:
            with self._cv:
                while not (self._stopping or self._cancels or self._busy or self._can_admit()):
                    self._cv.wait()
                cancels, self._cancels = self._cancels, []
                if self._stopping and not cancels and not self._running and not self._waiting:
                    return
            try:
                self._apply_cancels(cancels)
                self._admit()
                if self._running and self.engine.has_work():
                    self._dispatch(self.engine.step())
            except Exception as e:     # an engine failure: fail what is in flight, keep serving new requests
                traceback.print_exc(file=sys.stderr)
                self._fail_running(e)
            self._after_step()

    def _can_admit(self) -> bool:
        return bool(self._waiting) and len(self._running) < self.cfg.max_concurrency

    def _apply_cancels(self, cancels: list[Handle]) -> None:
        for h in cancels:
            if h.done:
                continue
            with self._cv:
                if h in self._waiting:
                    self._waiting.remove(h)
            self._finish(h, "abort", push=False)

    def _admit(self) -> None:
        while True:
            with self._cv:
                if not self._can_admit() or self._reserved + self._waiting[0].pages > self.total_pages:
                    return          # FIFO: the head waits for pages rather than being overtaken
                h = self._waiting.popleft()
                self._reserved += h.pages
                self._running[h.id] = h
            h.admitted = time.monotonic()
            try:
                if h.vision is None:
                    self.engine.add_request(h.id, h.prompt_ids, h.params)
                else:                      # runs the vision tower here, on the engine thread
                    self.engine.add_request(h.id, h.prompt_ids, h.params, vision=h.vision)
            except Exception as e:     # this request fails; the others keep running
                if _is_bug(e):         # a client's bad input is its 400; anything else needs the traceback
                    traceback.print_exc(file=sys.stderr)
                self._fail(h, e)
                continue
            h.vision = None                # the engine has what it needs; free the pixels
            h.in_engine = True
            self.metrics.prompt_tokens.inc(h.prompt_len)
            if h.images:
                self.metrics.images.inc(h.images)
                self.metrics.image_tokens.inc(h.image_tokens)

    def _dispatch(self, outputs) -> None:
        now = time.monotonic()
        for o in outputs:
            h = self._running.get(o.req_id)
            if h is None or h.done:
                continue
            self._take_spec(h, o)
            h.cached = max(h.cached, getattr(o, "cached_tokens", 0) or 0)
            ids = list(o.new_token_ids)[:h.params.max_tokens - h.generated]
            # a stop token id ends the output out of its text (as vLLM), though it counts and has its logprob;
            # include_stop_str_in_output keeps its text too (vLLM's rule for stop tokens as for stop strings)
            stop_id = o.finished and o.finish_reason == "stop" and ids and ids[-1] in h.params.stop_token_ids \
                and not h.params.include_stop_str_in_output
            before = h.text.reasoning_tokens
            used, reasoning, content = self._detok(h, ids[:-1] if stop_id else ids)
            used += bool(stop_id) and not h.text.stopped
            self._account_tokens(h, used, now)
            if getattr(o, "prompt_logprobs", None) is not None:      # completions' echo: before the first token
                self._push(h, ("prompt", o.prompt_logprobs))
            lps = o.logprobs[:used] if getattr(o, "logprobs", None) else None
            if reasoning or content or lps:
                # a delta event: (reasoning, content, TokenLogprobs or None, how many of them are reasoning ids,
                # tokens generated so far)
                self._push(h, ("delta", reasoning, content, lps, h.text.reasoning_tokens - before, h.generated))
            if h.text.stopped:
                self._finish(h, "stop")
            elif o.finished:
                self._finish(h, _finish_reason(o.finish_reason), in_engine=False)
            elif h.generated >= h.params.max_tokens:
                self._finish(h, "length")

    def _detok(self, h: Handle, ids: list[int]) -> tuple[int, str, str]:
        """Feed ids one at a time while a stop string may match, so tokens after the stop are not counted."""
        if not h.text.answer.stop:
            r, c = h.text.push(ids)
            return len(ids), r, c
        rs = cs = ""
        used = 0
        for t in ids:
            r, c = h.text.push([t])
            rs, cs, used = rs + r, cs + c, used + 1
            if h.text.stopped:
                break
        return used, rs, cs

    def _account_tokens(self, h: Handle, n: int, now: float) -> None:
        if not n:
            return
        if h.first is None:
            h.first = now
            self.metrics.ttft.observe(now - h.arrival)
        elif h.last is not None:
            gap = (now - h.last) / n
            for _ in range(n):
                self.metrics.itl.observe(gap)
        h.last = now
        h.steps += 1
        h.generated += n
        self.metrics.generation_tokens.inc(n)

    def _take_spec(self, h: Handle, o) -> None:
        for name in ("drafted", "accepted"):
            v = getattr(o, name, None)
            if v is not None:
                setattr(h, name, (getattr(h, name) or 0) + int(v))

    def _finish(self, h: Handle, reason: str, *, push: bool = True, in_engine: bool = True) -> None:
        """Release the request in the engine (abort if it is still there) and its reservation."""
        if h.done:
            return
        if in_engine and h.in_engine:
            try:
                self.engine.abort(h.id)
            except Exception:       # still return the reservation and answer the client
                traceback.print_exc(file=sys.stderr)
        h.in_engine = False
        with self._cv:
            if self._running.pop(h.id, None) is not None:
                self._reserved -= h.pages
            h.done = True
            self._cv.notify_all()
        if push:
            r, c = h.text.flush()
            if r or c:
                self._push(h, ("delta", r, c, None, 0, h.generated))
        use = usage(h.prompt_len, h.generated, h.cached)
        if push:
            self._push(h, ("done", reason, use))
        self.metrics.requests.labels(finish_reason=reason).inc()
        now = time.monotonic()
        self.metrics.e2e.observe(now - h.arrival)
        self.log.write("request_done", **done_record(h, reason, now))

    def _fail(self, h: Handle, e: Exception) -> None:
        err = e if isinstance(e, ApiError) else _engine_error(e)
        self._finish(h, "error", push=False)
        self._push(h, ("error", err))
        self.log.write("request_error", id=h.id, status=err.status, message=err.message)

    def _fail_running(self, e: Exception) -> None:
        for h in list(self._running.values()):
            self._fail(h, e)

    def _after_step(self) -> None:
        self._update_spec_metrics()
        self._update_prefix_metrics()
        busy = bool(self._running)
        try:
            busy = busy and self.engine.has_work()
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            self._fail_running(e)
        if self._running and not busy:     # the engine lost track of them: fail rather than hang
            self._fail_running(RuntimeError("the engine has no work but requests are still running"))
        with self._cv:
            self._busy = busy
            waiting, running, reserved = len(self._waiting), len(self._running), self._reserved
        self.metrics.waiting.set(waiting)
        self.metrics.running.set(running)
        self.metrics.set_kv(self.total_pages, self.total_pages - self.pool.free_pages(), reserved)

    def _update_spec_metrics(self) -> None:
        now = spec_totals(getattr(self.engine, "stats", None))
        prev, self._spec_seen = self._spec_seen, now
        pos_d = [a - (prev[2][i] if i < len(prev[2]) else 0) for i, a in enumerate(now[2])]
        pos_a = [a - (prev[3][i] if i < len(prev[3]) else 0) for i, a in enumerate(now[3])]
        self.metrics.add_spec(now[0] - prev[0], now[1] - prev[1], pos_d, pos_a)

    def _update_prefix_metrics(self) -> None:
        prefix = getattr(self.engine, "prefix", None)
        if prefix is None:
            return
        now = (prefix.stats.queries, prefix.stats.hits)
        prev, self._prefix_seen = self._prefix_seen, now
        if now[0] > prev[0]:
            self.metrics.prefix_queries.inc(now[0] - prev[0])
        if now[1] > prev[1]:
            self.metrics.prefix_hits.inc(now[1] - prev[1])

    @staticmethod
    def _push(h: Handle, event) -> None:
        try:
            h.loop.call_soon_threadsafe(h.events.put_nowait, event)
        except RuntimeError:        # the event loop is closed (server shut down): nobody is listening
            pass


def spec_totals(stats) -> tuple[int, int, list[int], list[int]]:
    """(drafted, accepted, drafted per position, accepted per position) from the engine's stats.

    Engine.stats is an EngineStats whose `spec` is a SpecStats (None without speculative decoding);
    a plain dict with the same names is accepted too.
    """
    spec = stats.get("spec", stats) if isinstance(stats, dict) else getattr(stats, "spec", None)
    if spec is None:
        return 0, 0, [], []
    get = spec.get if isinstance(spec, dict) else (lambda k, d=None: getattr(spec, k, d))
    return (int(get("drafted", 0) or 0), int(get("accepted", 0) or 0),
            [int(x) for x in get("drafted_at", None) or []], [int(x) for x in get("accepted_at", None) or []])


def _finish_reason(reason) -> str:
    r = str(reason or "stop").lower()
    return "length" if ("length" in r or "max" in r) else "stop"


def _is_bug(e: Exception) -> bool:
    from ninfer_formats.errors import NinferError
    return not isinstance(e, (ApiError, NinferError))


def _engine_error(e: Exception) -> ApiError:
    if not _is_bug(e):
        return bad_request(str(e))
    return ApiError(500, f"internal engine error: {type(e).__name__}: {e}", type="server_error",
                    code="engine_error")
