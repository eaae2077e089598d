"""Checks ``betty validate`` runs beyond the schema: is the spec runnable *here*?

* :func:`missing_data`: the dataset's files are not under ``dataset.root`` (real
  datasets are read offline only; the check is the one the loader makes before
  reading, without loading anything);
* :func:`unavailable_device`: ``train.device`` names a device this machine lacks
  (``cuda`` without CUDA).

Each returns a message, or ``None`` when all is well. ``validate`` prints them as
warnings (exit 0) or, with ``--strict``, as errors (exit 2).
"""

from __future__ import annotations

from workflow.specfile import ResolvedSpec

__all__ = ["missing_data", "unavailable_device", "environment_problems"]


def missing_data(rspec: ResolvedSpec) -> str | None:
    """Why the spec's dataset cannot be read from disk, or ``None``
    (:func:`betty.data.check_available`: the loader's own check, nothing loaded)."""
    from betty.data import DatasetNotFoundError, check_available

    ds = rspec.spec.dataset
    try:
        check_available(ds.name, ds.root, **rspec.dataset_options)
    except DatasetNotFoundError as err:
        return f"data files missing: {err}"
    return None


def unavailable_device(rspec: ResolvedSpec) -> str | None:
    """Why ``train.device`` cannot be used on this machine, or ``None`` (``auto`` and
    ``cpu`` always can: torch is imported only to ask about another device)."""
    if rspec.spec.train.device in ("auto", "cpu"):
        return None
    from workflow.components import resolve_device

    try:
        resolve_device(rspec.spec.train.device)
    except RuntimeError as err:
        return str(err)
    return None


def environment_problems(rspec: ResolvedSpec) -> list[str]:
    """Every message of the checks above that applies."""
    return [m for m in (missing_data(rspec), unavailable_device(rspec)) if m]
