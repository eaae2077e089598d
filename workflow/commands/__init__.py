"""CLI commands, one module each.

Every public module here (name not starting with ``_``) defines the function of its
name, the command; :func:`register_all` adds them to the Typer app in alphabetical order.
To add ``betty estimate``, add ``estimate.py`` with a function ``estimate``.
"""

from __future__ import annotations

import importlib
import pkgutil
import re

from typer.core import TyperCommand

__all__ = ["command_modules", "register_all", "PlainUsageCommand"]


def command_modules() -> list[str]:
    """Names of the command modules (``run``, ``stage``, ...)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def register_all(app) -> None:
    """Register every command module's command, its exceptions turned into exit codes
    (:func:`workflow.commands._common.cli_errors`), with :class:`PlainUsageCommand`."""
    from workflow.commands._common import cli_errors

    for name in command_modules():
        command = getattr(importlib.import_module(f"{__name__}.{name}"), name)
        app.command(name, cls=PlainUsageCommand)(cli_errors(command))


class PlainUsageCommand(TyperCommand):
    """A command whose usage line names required arguments plainly (``betty run
    [OPTIONS] SPEC``), not in the braces this Typer puts around them (``{SPEC}``)."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [re.sub(r"^\{([^{}]*)\}", r"\1", part) for part in super().collect_usage_pieces(ctx)]
