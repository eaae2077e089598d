"""CLI commands, one module each.

Every public module here (name not starting with ``_``) defines ``register(app)``,
which adds its command(s) to the Typer app; :func:`register_all` imports them in
alphabetical order. To add ``betty estimate``, add ``estimate.py`` with a ``register``.
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
    """Register every command module's commands, each with :class:`PlainUsageCommand`."""
    for name in command_modules():
        importlib.import_module(f"{__name__}.{name}").register(app)
    for info in app.registered_commands:
        if info.cls in (None, TyperCommand):
            info.cls = PlainUsageCommand


class PlainUsageCommand(TyperCommand):
    """A command whose usage line names required arguments plainly (``betty run
    [OPTIONS] SPEC``), not in the braces this Typer puts around them (``{SPEC}``)."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [re.sub(r"^\{([^{}]*)\}", r"\1", part) for part in super().collect_usage_pieces(ctx)]
