"""`ninfer-rt serve` as a function: bind, serve /health at once, load in the background, drain on SIGTERM.

Order: check the options and bind the socket (a bad flag, a missing artifact or a busy port is an
`error:` line before anything starts); start uvicorn; a loader thread resolves the artifact (hf://),
loads it and builds the Engine, then flips `/health` to 200. SIGTERM/SIGINT (uvicorn's handlers) stop
accepting connections and give in-flight requests up to `drain_timeout_s` to finish; then the scheduler
cancels what is left and the Engine (and TP followers) shut down.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace

from ninfer_formats.errors import NinferError

from .app import MAX_BODY_BYTES, ServerState, create_app
from .request_log import NullLog, RequestLog
from .runtime import RuntimeOptions, ServeError, default_model_id, open_runtime, resolve_artifact
from .scheduler import DEFAULT_MAX_TOKENS, POLICIES, Scheduler, SchedulerConfig


@dataclass(frozen=True)
class ServeOptions:
    runtime: RuntimeOptions
    host: str = "127.0.0.1"
    port: int = 8080
    model_id: str | None = None
    aliases: tuple[str, ...] = ()      # more names requests may use; replies carry model_id
    max_pending: int = 64
    api_key: str | None = None
    log_requests: str | None = None
    drain_timeout_s: float = 30.0
    max_body_bytes: int = MAX_BODY_BYTES
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    allowed_origins: tuple[str, ...] = ("*",)     # CORS (vLLM's default); () = no CORS headers
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    scheduling_policy: str = "fcfs"    # vLLM's --scheduling-policy (scheduler.POLICIES)

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ServeError(f"--port: expected 0..65535, got {self.port}")
        for name in ("max_pending", "default_max_tokens", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ServeError(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(self, name)}")
        if self.scheduling_policy not in POLICIES:
            raise ServeError(f"--scheduling-policy: expected one of {', '.join(POLICIES)}, got "
                             f"{self.scheduling_policy!r}")
        if self.drain_timeout_s < 0:
            raise ServeError(f"--drain-timeout: expected seconds >= 0, got {self.drain_timeout_s}")
        for name in (self.model_id, *self.aliases):
            if name is not None and not name.strip():
                raise ServeError("--served-model-name: a name must not be empty")
        if self.aliases and self.model_id is None:
            raise ServeError("--served-model-name: aliases need a first name")
        if self.api_key is not None and not self.api_key.strip():
            raise ServeError("--api-key: must not be empty")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ServeError("--ssl-keyfile and --ssl-certfile: give both (HTTPS) or neither")
        for flag, path in (("--ssl-keyfile", self.ssl_keyfile), ("--ssl-certfile", self.ssl_certfile)):
            if path is not None and not os.path.isfile(path):
                raise ServeError(f"{flag} {path}: no such file")
        if self.runtime.vision is not None and self.runtime.vision.allow_files:
            raise ServeError("vision: a server never reads image files from its own disk (allow_files must be off)")


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ServeError(f"--host {host} --port {port}: cannot bind ({e.strerror or e})") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _Loader(threading.Thread):
    """Resolve + load + build in the background; on failure print `error:` and stop the server."""

    def __init__(self, opts: ServeOptions, state: ServerState, server, log):
        super().__init__(name="ninfer-loader", daemon=True)
        self.opts, self.state, self.server, self.log = opts, state, server, log
        self.runtime = self.scheduler = None
        self.failed = False
        self.abandoned = False      # the server stopped while this was loading: the process is exiting

    def run(self) -> None:
        # abandoned: the server stopped mid-load and the process is exiting (its TP ranks are ended under the
        # load in progress); whatever that raises here is not news
        try:
            self._load()
        except (NinferError, OSError) as e:
            if not self.abandoned:
                self._give_up(str(e) if isinstance(e, NinferError) else f"{e.filename or ''}: {e.strerror or e}")
        except BaseException as e:      # a bug: still stop the server instead of serving 503 forever
            if not self.abandoned:
                import traceback
                traceback.print_exc(file=sys.stderr)
                self._give_up(f"loading failed: {type(e).__name__}: {e}")

    def _give_up(self, msg: str) -> None:
        self.failed = True
        self.state.load_error = msg
        print(f"error: {msg}", file=sys.stderr)
        self.server.should_exit = True

    def _load(self) -> None:
        o = self.opts
        t0 = time.monotonic()
        path, downloaded = resolve_artifact(o.runtime.artifact, verify=o.runtime.verify)
        # a download was just verified file by file (TP set included): no need to hash it twice
        ropts = replace(o.runtime, artifact=path, verify=o.runtime.verify and not downloaded)
        rt = self.runtime = open_runtime(ropts)
        pool = rt.engine.model.kv_pool
        cfg = SchedulerConfig(max_concurrency=ropts.max_concurrency, max_context=rt.max_context,
                              max_pending=o.max_pending, default_max_tokens=o.default_max_tokens,
                              policy=o.scheduling_policy)
        sched = self.scheduler = Scheduler(rt.engine, pool, rt.tokenizer, cfg, self.state.metrics, self.log,
                                           thread_init=_thread_init(ropts, rt))
        sched.start()
        self.state.ready(sched, rt.tokenizer, rt.loaded.config.vocab_size, rt.loaded.generation_config,
                         vision=rt.vision, vision_max_tokens=ropts.vision_max_tokens)
        self.log.write("server_start", model_id=self.state.model_id, artifact=o.runtime.artifact,
                       identity=rt.loaded.identity, load_seconds=round(time.monotonic() - t0, 3),
                       tp=ropts.tp, max_concurrency=ropts.max_concurrency, kv_pages=pool.num_pages,
                       page_size=pool.page_size, max_context=sched.max_context, draft_tokens=ropts.draft_tokens,
                       vision_max_tokens=ropts.vision_max_tokens if rt.vision is not None else None)
        _warn_template(rt.tokenizer)
        print(f"ninfer-rt serve: {self.state.model_id} ready in {time.monotonic() - t0:.1f} s", file=sys.stderr)


def _warn_template(tok) -> None:
    """A broken chat template does not stop the server (/v1/completions needs none); say so once at start,
    chat requests then get an error naming the same problem."""
    from ..tokenizer import TokenizerError
    try:
        tok.check_template()
    except TokenizerError as e:
        print(f"ninfer-rt serve: warning: {e}; chat requests will fail", file=sys.stderr)


def _thread_init(opts: RuntimeOptions, rt):
    def init():
        import torch
        torch.set_grad_enabled(False)            # this thread only: grad mode and the CUDA device are per thread
        dev = rt.engine.device
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
    return init


def run_server(opts: ServeOptions) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code (2 when loading failed, 130 after Ctrl-C, else 0)."""
    import uvicorn
    if not opts.runtime.artifact.startswith("hf://"):
        resolve_artifact(opts.runtime.artifact)          # a missing artifact fails before binding
    state = ServerState(model_id=opts.model_id or default_model_id(opts.runtime.artifact), api_key=opts.api_key,
                        max_body_bytes=opts.max_body_bytes, allowed_origins=opts.allowed_origins,
                        aliases=tuple(n for n in dict.fromkeys(opts.aliases) if n != opts.model_id))
    config = uvicorn.Config(create_app(state), log_level="warning", timeout_graceful_shutdown=opts.drain_timeout_s,
                            timeout_keep_alive=5, ssl_keyfile=opts.ssl_keyfile, ssl_certfile=opts.ssl_certfile)
    try:
        config.load()                    # the TLS files are read here: a bad key or certificate fails before binding
    except (OSError, ValueError) as e:   # ssl.SSLError is an OSError
        raise ServeError(f"--ssl-keyfile / --ssl-certfile: cannot use them ({e})") from None
    sock = bind(opts.host, opts.port)
    log = RequestLog(opts.log_requests) if opts.log_requests else NullLog()
    server = uvicorn.Server(config)
    loader = _Loader(opts, state, server, log)
    # uvicorn re-raises the signal that stopped it once it returns; with these handlers in place that
    # re-raise is only noted (it picks the exit code) instead of killing the process before the engine and
    # TP ranks shut down; signals after that change nothing: shutdown is already under way and bounded.
    # Installed before anything starts, so a Ctrl-C before uvicorn's own handlers is not lost either.
    stops: list[int] = []

    def on_signal(sig, frame) -> None:
        stops.append(sig)
        server.should_exit = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        loader.start()
        scheme = "https" if opts.ssl_certfile else "http"
        print(f"ninfer-rt serve: listening on {scheme}://{opts.host}:{sock.getsockname()[1]} (loading the model)",
              file=sys.stderr)
        server.run(sockets=[sock])
    finally:
        t_stop = time.monotonic()
        _shutdown(loader, opts.drain_timeout_s)
        log.close()
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"ninfer-rt serve: stopped ({time.monotonic() - t_stop:.1f} s to shut down)", file=sys.stderr)
    rc = 2 if loader.failed else 130 if signal.SIGINT in stops else 0   # Ctrl-C: the shell's 128 + SIGINT
    if loader.abandoned:
        _exit_now(rc)
    return rc


def _exit_now(rc: int) -> None:
    """Exit with the loader thread still inside torch: interpreter teardown under its C++ threads can abort
    ('terminate called without an active exception'), so end the TP ranks and leave without it."""
    import os
    tp = sys.modules.get("ninfer_rt.tp")
    if tp is not None:
        tp.end_followers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _shutdown(loader: _Loader, drain_s: float) -> None:
    """Let the scheduler finish what uvicorn's drain left running, then cancel the rest and close the engine."""
    if loader.is_alive():
        loader.abandoned = True
        print("ninfer-rt serve: shut down while still loading", file=sys.stderr)
        return
    if loader.scheduler is not None:
        if not loader.scheduler.drain(min(drain_s, 5.0)):
            print("ninfer-rt serve: cancelling requests still running after the drain timeout", file=sys.stderr)
        loader.scheduler.stop()
    if loader.runtime is not None:
        loader.runtime.close()
