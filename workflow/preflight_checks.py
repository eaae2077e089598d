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

from pathlib import Path

from workflow.specfile import ResolvedSpec

__all__ = ["missing_data", "unavailable_device", "environment_problems"]


def missing_data(rspec: ResolvedSpec) -> str | None:
    """Why the spec's dataset cannot be read from disk, or ``None``."""
    from betty.data import registry
    from betty.data.ogb_loader import DatasetNotFoundError, check_ogb_files

    name = rspec.spec.dataset.name
    root = Path(rspec.spec.dataset.root)
    spec = registry._spec(name)
    try:
        if spec.build is registry._ogb_build:
            check_ogb_files(name, root)
        elif spec.build is registry._dgl_builtin_build:
            registry.dgl_builtin._check_files(name, root)
        elif spec.build is registry._dgl_file_build:
            path = Path(rspec.dataset_options["path"])
            if not path.is_file():
                raise DatasetNotFoundError(f"dgl-file: path={str(path)!r} does not exist")
    except DatasetNotFoundError as err:
        return f"data files missing: {err}"
    return None


def unavailable_device(rspec: ResolvedSpec) -> str | None:
    """Why ``train.device`` cannot be used on this machine, or ``None``."""
    from workflow.components import resolve_device

    try:
        resolve_device(rspec.spec.train.device)
    except RuntimeError as err:
        return str(err)
    return None


def environment_problems(rspec: ResolvedSpec) -> list[str]:
    """Every message of the checks above that applies."""
    return [m for m in (missing_data(rspec), unavailable_device(rspec)) if m]
