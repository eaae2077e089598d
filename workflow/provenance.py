"""Which code produced a run: git commit plus a hash of the sources as they are on disk,
and the GNN framework a spec's model runs on (:func:`backend_version`).

The source hash covers every ``*.py`` file under ``betty/`` and ``workflow/`` (relative
path and bytes), so uncommitted edits change the code version even when the commit does
not. Stage reuse (:mod:`workflow.reuse`) only matches runs with the same code version.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

__all__ = ["package_roots", "source_hash", "git_commit", "backend_version", "partitioner_versions",
           "code_version"]

PARTITIONER_LIBRARIES = ("numpy", "scipy", "pymetis", "kaminpar", "mtkahypar")
"""The libraries a split is computed with (the REG's sparse products, METIS, KaMinPar,
Mt-KaHyPar; torch is in :func:`backend_version`)."""


def package_roots() -> list[Path]:
    """The source folders that define the computation: ``betty/`` and ``workflow/``."""
    import betty

    import workflow

    # __path__ rather than __file__: an editable install may expose them as namespace
    # packages (no __file__) when imported from outside the project folder.
    return [Path(next(iter(pkg.__path__))).resolve() for pkg in (betty, workflow)]


def source_hash(roots: list[Path] | None = None) -> str:
    """First 16 hex digits of SHA-256 over (path relative to its root's parent, bytes)
    of every ``*.py`` file under ``roots``, in sorted order."""
    digest = hashlib.sha256()
    for root in roots or package_roots():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root.parent).as_posix()
            digest.update(rel.encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def git_commit() -> str | None:
    """The project's commit as MLflow reads it for its ``mlflow.source.git.commit`` tag
    (:func:`mlflow.utils.git_utils.get_git_commit`), ``None`` outside a repository.
    MLflow looks next to the entry script, which for the ``betty`` command lies outside
    the repository; betty asks about the folder holding its packages."""
    from mlflow.utils.git_utils import get_git_commit

    return get_git_commit(str(package_roots()[0].parent))


@functools.lru_cache(maxsize=None)
def backend_version(backend: str) -> str:
    """What a spec's ``model.backend`` (``auto``, ``dgl``, ``pyg``) runs on here: the
    backend it resolves to and the versions of its framework and torch, e.g.
    ``"dgl (dgl 2.1.0, torch 2.2.1)"``. ``auto`` picks the first framework that imports,
    so the answer depends on the environment, not on the spec."""
    from betty.backends import library_versions, resolve_backend

    name = resolve_backend(backend)
    return f"{name} ({library_versions(name)})"


@functools.lru_cache(maxsize=1)
def partitioner_versions() -> str:
    """The installed versions of :data:`PARTITIONER_LIBRARIES` (``"absent"`` where one is
    not installed), e.g. ``"numpy 1.26.4, scipy 1.17.1, pymetis 2025.2.2, ..."``: another
    version may cut another split (read from the package metadata, nothing imported)."""
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "absent"

    return ", ".join(f"{dist} {version(dist)}" for dist in PARTITIONER_LIBRARIES)


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """``<commit[:12] or 'nogit'>+<source hash>`` for this process (computed once)."""
    commit = git_commit()
    return f"{commit[:12] if commit else 'nogit'}+{source_hash()}"
