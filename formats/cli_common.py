"""What both CLIs (`ninfer-pack`, `ninfer-rt`) share: bad input is one line on stderr, never a traceback."""
from __future__ import annotations

import atexit
import functools
import signal
import sys

import click

from .errors import NinferError


def _quiet_exit() -> None:
    """At interpreter exit, after the command finished and the threads were joined: a Ctrl-C now would print
    "Exception ignored in atexit callback ... KeyboardInterrupt" from a finalizer, for a job that is done."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def user_errors(fn):
    """Report NinferError/OSError as `error: <message>` on stderr with exit 2; Ctrl-C as `error: interrupted`, 130."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NinferError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except OSError as e:
            click.echo(f"error: {e.filename or ''}: {e.strerror or e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:       # Ctrl-C: one line and the shell's 128 + SIGINT, not click's "Aborted!"
            click.echo("error: interrupted", err=True)
            sys.exit(130)
        finally:
            # registered (again) when the command ends, so it runs first: exit hooks run last-in first-out, and
            # the command may have registered its own (weakref.finalize's, made by torch.library during a convert;
            # a Ctrl-C inside it printed a traceback in test_interrupt_cli)
            atexit.unregister(_quiet_exit)
            atexit.register(_quiet_exit)
    return wrapper
