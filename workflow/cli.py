"""The ``betty`` command line (Typer).

Commands live one per module in :mod:`workflow.commands` and are discovered
automatically: adding a command is adding a module with a function of its name.

Exit codes: 0 success, 2 invalid spec or arguments (message, no traceback), 1 any other
failure (message; set ``BETTY_TRACEBACK=1`` for the traceback), 130 interrupted.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

from workflow import env as _env  # noqa: F401  (before MLflow is imported)
from workflow import signals as _signals

__all__ = ["app", "main"]


def _started_as_command() -> bool:
    """Whether this process is the ``betty`` command (not an import, e.g. by tests)."""
    return os.path.basename(sys.argv[0]).removesuffix(".exe") == "betty"


# As the betty command: a Ctrl-C during the start-up (imports, argument parsing: a
# second or more) is only recorded (a KeyboardInterrupt raised inside an import is
# swallowed by some libraries, or prints a traceback); the command raises it first thing
# (:func:`workflow.commands._common.cli_errors`): exit 130 with one line.
if _started_as_command():
    _signals.install(hold=True)

import typer  # noqa: E402

from workflow.commands import register_all  # noqa: E402

app = typer.Typer(
    name="betty",
    help="Exact micro-batch GNN training: run spec-driven experiments tracked in MLflow.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        from betty import __version__

        typer.echo(f"betty {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True, help="Print betty's version and exit.")] = False) -> None:
    """Exact micro-batch GNN training: run spec-driven experiments tracked in MLflow."""


register_all(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
