"""`ninfer-rt`: thin click wrappers over importable functions; logs to stderr, results to stdout."""
from __future__ import annotations

import click

from ninfer_formats.cli_common import user_errors  # noqa: F401  (the command modules decorate with it)


@click.group()
@click.version_option(package_name="ninfer")
def main():
    """Run and serve .ninfer artifacts."""


# the command modules attach themselves to `main`; imported last because they import `main` from here
from ninfer_rt import cmd_generate, cmd_serve  # noqa: E402,F401

if __name__ == "__main__":
    # run the module object the command modules registered on, not this __main__ copy
    from ninfer_rt.cli import main as _main
    _main()
