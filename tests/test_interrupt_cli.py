"""Ctrl-C / SIGTERM to the whole process group (as a terminal or a supervisor sends them) while the real CLIs
run with helper processes: TP follower ranks (`ninfer-rt generate/serve --tp 2`) and convert workers
(`ninfer-pack convert -j 2`). The project rule: no traceback from any process, one clear line at most, and
the exit code of the signal's convention; no process of the group is left behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from test_server import tiny_artifact

pytestmark = pytest.mark.usefixtures("one_thread")

READY_TIMEOUT_S = 50.0      # the slowest part on 2 shared cores: spawned ranks re-import torch
EXIT_TIMEOUT_S = 40.0


class Group:
    """A CLI in its own session/process group with default signal handling; stdout and stderr collected."""

    def __init__(self, module: str, args: list[str]):
        cmd = [sys.executable, "-c", f"from {module}.cli import main; main()", *map(str, args)]
        self.proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=os.environ.copy(),
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.out, self.err = [], []
        self.seen = threading.Condition()
        self.readers = [threading.Thread(target=self._read, args=(s, buf), daemon=True)
                        for s, buf in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self.readers:
            t.start()

    def _read(self, stream, buf) -> None:
        while True:
            chunk = os.read(stream.fileno(), 4096)
            with self.seen:
                if chunk:
                    buf.append(chunk.decode(errors="replace"))
                self.seen.notify_all()
            if not chunk:
                return

    def stderr(self) -> str:
        return "".join(self.err)

    def wait_for(self, marker: str, stream: str = "err", timeout: float = READY_TIMEOUT_S) -> None:
        """Until `marker` shows on stderr (or any stdout text with marker ''); fail if the process ends first."""
        buf = self.err if stream == "err" else self.out
        deadline = time.monotonic() + timeout
        with self.seen:
            while marker not in "".join(buf) or (marker == "" and not buf):
                assert self.proc.poll() is None, f"exited ({self.proc.returncode}) before {marker!r}:\n{self.stderr()}"
                left = deadline - time.monotonic()
                assert left > 0, f"no {marker!r} within {timeout:.0f} s:\n{self.stderr()}"
                self.seen.wait(min(left, 0.5))

    def signal(self, sig: int) -> int:
        assert self.proc.poll() is None, f"already exited ({self.proc.returncode}):\n{self.stderr()}"
        os.killpg(self.proc.pid, sig)
        try:
            rc = self.proc.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running {EXIT_TIMEOUT_S:.0f} s after {signal.Signals(sig).name}:\n"
                                 + self.stderr())
        for t in self.readers:
            t.join(10)
        self._assert_group_gone()
        return rc

    def _assert_group_gone(self, timeout: float = 15.0) -> None:
        """Every process of the group (ranks, workers, multiprocessing's resource tracker) has exited."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError("processes of the group outlived the command")
            time.sleep(0.2)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


@pytest.fixture
def group_runs():
    runs = []

    def start(module, args):
        runs.append(Group(module, args))
        return runs[-1]
    yield start
    for g in runs:
        if g.proc.poll() is None:
            g.kill()


def assert_quiet(err: str, max_error_lines: int = 1) -> list[str]:
    assert "Traceback" not in err, err
    assert "Aborted!" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) <= max_error_lines, err
    return errors


@pytest.fixture(scope="module")
def art_tp2(tmp_path_factory):
    return tiny_artifact(tmp_path_factory, tp=2)


SERVE = ["--tp", "2", "--port", "0", "--device", "cpu", "--no-verify", "--drain-timeout", "10"]


def test_generate_tp2_ctrl_c_while_generating(group_runs, art_tp2):
    g = group_runs("ninfer_rt", ["generate", art_tp2, "--tp", "2", "--device", "cpu", "--no-verify", "--raw",
                                 "def f(", "--temperature", "1", "--seed", "1", "--max-new", "500",
                                 "--spec", "none", "--max-context", "512"])
    g.wait_for("", stream="out")          # tokens are streaming: both ranks are inside the decode loop
    rc = g.signal(signal.SIGINT)
    assert rc == 130, g.stderr()
    assert assert_quiet(g.stderr()) == ["error: interrupted"]


@pytest.mark.parametrize("when", ["loading", "ready"])
def test_serve_tp2_ctrl_c(group_runs, art_tp2, when):
    g = group_runs("ninfer_rt", ["serve", art_tp2, *SERVE])
    g.wait_for("listening on" if when == "loading" else "ready in")
    rc = g.signal(signal.SIGINT)
    assert rc == 130, g.stderr()
    assert assert_quiet(g.stderr(), max_error_lines=0) == []
    assert "ninfer-rt serve: stopped" in g.stderr()


def test_serve_tp2_sigterm_to_the_group_drains(group_runs, art_tp2):
    g = group_runs("ninfer_rt", ["serve", art_tp2, *SERVE])
    g.wait_for("ready in")
    rc = g.signal(signal.SIGTERM)
    assert rc == 0, g.stderr()
    assert assert_quiet(g.stderr(), max_error_lines=0) == []
    assert "ninfer-rt serve: stopped" in g.stderr()


def test_convert_ctrl_c_while_workers_start(group_runs, tmp_path):
    from hf_tiny import make_tiny_checkpoint
    src = make_tiny_checkpoint(tmp_path / "hf", seed=3)
    # spawned workers still importing is the window of the old traceback; on a fast machine the tiny job can be
    # done before 0.3 s, so earlier signals follow (a job that finished first must have exited quietly)
    for i, delay in enumerate((0.3, 0.1, 0.0)):
        g = group_runs("ninfer_pack", ["convert", src, tmp_path / f"out{i}", "--tp", "2", "-j", "2",
                                       "--recipe", "bf16"])
        g.wait_for("weights")             # the progress bars open just before the worker pool starts
        time.sleep(delay)
        if g.proc.poll() is not None:     # finished before the signal could be sent
            assert g.proc.wait() == 0 and assert_quiet(g.stderr(), max_error_lines=0) == [], g.stderr()
            continue
        rc = g.signal(signal.SIGINT)
        if rc == 0:                       # the signal came while it was exiting: it must not have said so
            assert assert_quiet(g.stderr(), max_error_lines=0) == [], g.stderr()
            continue
        assert rc == 130, g.stderr()
        assert assert_quiet(g.stderr()) == ["error: interrupted; rerun the same command to resume"]
        return
    pytest.fail("the conversion finished before every Ctrl-C (0.3 / 0.1 / 0 s after its progress bars)")


def _child_mask(q) -> None:
    q.put(sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))


def test_parent_signals_blocked_defers_ctrl_c_and_children_inherit_the_block():
    """The helper both CLIs start their children under: a Ctrl-C inside does not interrupt the start (it is
    raised once the block ends) and the child starts with the signals blocked (no bootstrap traceback)."""
    import multiprocessing as mp
    import threading
    from ninfer_formats.proc_signals import parent_signals_blocked
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # the preconditions a CLI starts from (an earlier test in this process may have changed either): Python's
    # Ctrl-C handler, and SIGINT / SIGTERM deliverable to the main thread
    old_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    old_mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGTERM])
    raised = started = False
    try:
        with parent_signals_blocked():
            # at the main thread, which has it blocked: a process-directed kill may go to another thread of the
            # test process (one an earlier test left), whose handler can run only after this test has returned
            # on a loaded machine, and a KeyboardInterrupt then ends the whole pytest session
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            p = ctx.Process(target=_child_mask, args=(q,))
            p.start()
            started = True
    except KeyboardInterrupt:
        raised = True
    finally:
        handler = signal.getsignal(signal.SIGINT)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        signal.signal(signal.SIGINT, old_handler)
    assert raised and started, (f"no KeyboardInterrupt after the block (started={started}; SIGINT handler now "
                                f"{handler!r}, before the test {old_handler!r}; blocked before {sorted(old_mask)}; "
                                f"threads {[t.name for t in threading.enumerate()]})")
    assert {signal.SIGINT, signal.SIGTERM} <= set(q.get(timeout=READY_TIMEOUT_S))
    p.join(READY_TIMEOUT_S)
    assert p.exitcode == 0
    assert handler is signal.default_int_handler


_EXIT_HOOK_SCRIPT = """
import atexit, os, signal, sys, time
import click
from ninfer_formats.cli_common import user_errors

def ctrl_c_at_exit():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.3)                       # the handler runs here, inside an exit hook
    print("hook done", file=sys.stderr)

@click.command()
@user_errors
def cmd():
    atexit.register(ctrl_c_at_exit)       # as weakref.finalize's own hook, registered by the first finalizer
    click.echo("job done")

cmd()
"""


def test_ctrl_c_during_an_exit_hook_the_command_registered_is_quiet():
    """A Ctrl-C that lands in an exit hook registered during the command (after the CLI's own) is ignored: the
    job is done, so exit 0 and no "Exception ignored in atexit callback" traceback."""
    p = subprocess.run([sys.executable, "-c", _EXIT_HOOK_SCRIPT], capture_output=True, text=True, timeout=60,
                       check=False, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert p.returncode == 0 and p.stdout == "job done\n", p.stderr
    assert "Traceback" not in p.stderr and "KeyboardInterrupt" not in p.stderr, p.stderr
    assert "hook done" in p.stderr
