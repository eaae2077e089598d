"""CLI commands, one module each.

Every public module here (name not starting with ``_``) defines ``register(app)``,
which adds its command(s) to the Typer app; :func:`register_all` imports them in
alphabetical order. To add ``betty estimate``, add ``estimate.py`` with a ``register``.
"""

from __future__ import annotations

import importlib
import pkgutil

__all__ = ["command_modules", "register_all"]


def command_modules() -> list[str]:
    """Names of the command modules (``run``, ``stage``, ...)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def register_all(app) -> None:
    for name in command_modules():
        importlib.import_module(f"{__name__}.{name}").register(app)
