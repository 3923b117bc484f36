"""Signals for helper processes (TP follower ranks, convert workers): the parent owns Ctrl-C / SIGTERM.

A terminal's Ctrl-C (or a supervisor's SIGTERM) reaches the whole process group. Helper processes ignore
those signals and leave the shutdown to the parent, which reports one line and ends them itself.

A spawned child only runs our code after it has re-imported its modules, so ignoring the signals in the
child alone leaves a window in which a Ctrl-C prints a traceback from the child's bootstrap. Instead the
parent starts children with the signals *blocked* (`parent_signals_blocked`): the mask is inherited across
fork and exec, a group signal stays pending in the child until `ignore_in_child` discards it, and the
parent receives its own pending copy as soon as it unblocks them.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

PARENT_OWNED = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def parent_signals_blocked(signals=PARENT_OWNED):
    """Block `signals` in this thread while it starts child processes. The mask is per thread, so the
    kernel may still hand a group signal to another thread; on the main thread the Python handlers are
    therefore swapped for a recorder too (else a KeyboardInterrupt could cut a child's start in half and
    leave it reading an empty pipe), and what was recorded is raised again once the children are started."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    # multiprocessing starts its resource tracker on the first spawn and *unblocks* SIGINT/SIGTERM after
    # that (bpo-33613), which would undo the block below for the children started after it: start it first
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()
    caught: list[int] = []
    saved = {}
    if threading.current_thread() is threading.main_thread():
        for s in signals:
            if signal.getsignal(s) is not None:          # None: a handler installed from C; leave it
                saved[s] = signal.signal(s, lambda sig, frame: caught.append(sig))
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)   # a pending signal reaches the recorder now
        for s, handler in saved.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(caught):
            signal.raise_signal(s)


def ignore_in_child(signals=PARENT_OWNED) -> None:
    """First thing in a child process: ignore `signals` (discarding any pending one), then unblock them."""
    for s in signals:
        signal.signal(s, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def exit_with_parent(parent_pid: int, code: int, poll_s: float = 0.5) -> None:
    """In a helper process: exit with `code` once the parent process is gone. A killed parent cannot end its
    helpers, and they ignore the group signals (above); an idle one would otherwise live on forever. Portable:
    a daemon thread polls getppid(), which changes when the parent dies (reparenting to init or a subreaper)."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(code)
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
