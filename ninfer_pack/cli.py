"""`ninfer-pack`: thin click wrappers over importable functions; logs to stderr, results to stdout."""
from __future__ import annotations

import functools
import sys

import click

from ninfer_formats.errors import NinferError


def user_errors(fn):
    """Report NinferError/OSError as one line on stderr with exit 2, never a traceback."""
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
    return wrapper


@click.group()
@click.version_option(package_name="ninfer")
def main():
    """Pack Hugging Face Qwen3.8 checkpoints into .ninfer artifacts."""


def _register():
    # each command module attaches itself to `main`; a missing one is simply not offered yet
    import importlib
    for mod in ("ninfer_pack.cmd_inspect", "ninfer_pack.cmd_convert", "ninfer_pack.cmd_upload"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


_register()


if __name__ == "__main__":
    # run the module object the command modules registered on, not this __main__ copy
    from ninfer_pack.cli import main as _main
    _main()
