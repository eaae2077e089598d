"""Which code produced a run: git commit plus a hash of the sources as they are on disk.

The source hash covers every ``*.py`` file under ``betty/`` and ``workflow/`` (relative
path and bytes), so uncommitted edits change the code version even when the commit does
not. Stage reuse (:mod:`workflow.reuse`) only matches runs with the same code version.
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
from pathlib import Path

__all__ = ["package_roots", "source_hash", "git_commit", "code_version"]


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


def git_commit(folder: Path | None = None) -> str | None:
    """``git rev-parse HEAD`` in ``folder`` (default: the project), ``None`` outside a
    repository or without git."""
    folder = folder or package_roots()[0].parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """``<commit[:12] or 'nogit'>+<source hash>`` for this process (computed once)."""
    commit = git_commit()
    return f"{commit[:12] if commit else 'nogit'}+{source_hash()}"
