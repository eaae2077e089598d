"""The pipeline stages, in order: ``download`` -> ``sample`` -> ``partition`` ->
``train`` -> ``evaluate``. Each is an importable function ``run(ctx) -> metrics``
(see :mod:`workflow.stages.base`); MLproject entry points and the CLI only call them.
"""

from __future__ import annotations

from collections.abc import Callable

from workflow.specfile import STAGES

__all__ = ["STAGES", "UPSTREAM", "stage_function"]

UPSTREAM: dict[str, str | None] = dict(zip(STAGES, (None, *STAGES[:-1])))
"""The stage whose run a stage's reuse key depends on: the one before it (``download``:
none)."""


def stage_function(name: str) -> Callable:
    """The ``run`` function of stage ``name`` (imported lazily)."""
    import importlib

    if name not in STAGES:
        raise ValueError(f"stage must be one of {', '.join(STAGES)}, got {name!r}")
    return importlib.import_module(f"workflow.stages.{name}").run
