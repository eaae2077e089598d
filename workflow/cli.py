"""The ``betty`` command line (Typer).

Commands live one per module in :mod:`workflow.commands` and are discovered
automatically: adding a command is adding a module with a ``register(app)`` function.

Exit codes: 0 success, 2 invalid spec or arguments (message, no traceback), 1 any other
failure (message; set ``BETTY_TRACEBACK=1`` for the traceback), 130 interrupted.
"""

from __future__ import annotations

from workflow import env as _env  # noqa: F401  (before MLflow is imported)
from typing import Annotated

import typer

from workflow.commands import register_all

__all__ = ["app", "main"]

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
