"""Artifacts with checksums: :func:`log_artifact` logs a file with the tag
``artifact_sha256.<file name>``; :func:`fetch` and :func:`damaged_artifacts` check what
is read back and name the run and file when it is missing or damaged.

How reuse and the stages use them: docs/workflow.md, *Reuse*.
"""

from __future__ import annotations

import hashlib
import tempfile
from contextlib import nullcontext
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

__all__ = ["TAG_PREFIX", "ArtifactDamaged", "file_sha256", "log_artifact", "fetch", "damaged_artifacts"]

TAG_PREFIX = "artifact_sha256."


class ArtifactDamaged(RuntimeError):
    """An artifact of a run is missing or does not match its recorded checksum."""

    def __init__(self, run_id: str, artifact: str, problem: str) -> None:
        super().__init__(f"artifact {artifact!r} of run {run_id} is {problem}")
        self.run_id, self.artifact, self.problem = run_id, artifact, problem


def file_sha256(path: str | Path) -> str:
    """SHA-256 (hex) of the file's bytes."""
    with Path(path).open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def log_artifact(path: str | Path) -> Path:
    """Log ``path`` on the active run (top level, under its file name) with its checksum tag."""
    path = Path(path)
    digest = file_sha256(path)
    mlflow.log_artifact(str(path))
    mlflow.set_tag(TAG_PREFIX + path.name, digest)
    return path


def fetch(run_id: str, artifact: str, dst: str | Path, *, tags: dict | None = None) -> Path:
    """Download ``artifact`` of ``run_id`` into ``dst`` and check it against the run's
    checksum tag (when the run has one for it).

    Raises:
        ArtifactDamaged: the artifact is missing or its checksum does not match.
    """
    if tags is None:
        tags = MlflowClient().get_run(run_id).data.tags
    try:
        local = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=artifact, dst_path=str(dst)))
    except Exception as err:  # noqa: BLE001  (MLflow raises several types for a missing file)
        first = str(err).splitlines()[0][:200] if str(err) else ""
        raise ArtifactDamaged(run_id, artifact, f"missing or unreadable ({type(err).__name__}: {first})") from None
    if not local.is_file():
        raise ArtifactDamaged(run_id, artifact, "missing")
    want = tags.get(TAG_PREFIX + artifact)
    if want is not None and file_sha256(local) != want:
        raise ArtifactDamaged(run_id, artifact, f"damaged (SHA-256 differs from the recorded {want[:12]}...)")
    return local


def damaged_artifacts(run_id: str, dst: str | Path | None = None) -> list[ArtifactDamaged]:
    """Every checksummed artifact of ``run_id`` that is missing or does not match.
    ``dst``: the folder to download them to, damaged ones included (``None``: a
    temporary one)."""
    tags = MlflowClient().get_run(run_id).data.tags
    problems = []
    with tempfile.TemporaryDirectory(prefix="betty-verify-") if dst is None else nullcontext(dst) as folder:
        for key in sorted(tags):
            if key.startswith(TAG_PREFIX):
                try:
                    fetch(run_id, key[len(TAG_PREFIX):], folder, tags=tags)
                except ArtifactDamaged as err:
                    problems.append(err)
    return problems
