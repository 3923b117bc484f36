"""What both CLIs (`ninfer-pack`, `ninfer-rt`) share: bad input is one line on stderr, never a traceback."""
from __future__ import annotations

import functools
import sys

import click

from .errors import NinferError


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
    return wrapper
