"""What every stage receives: the resolved spec, its upstream runs, a reporter.

A stage is a function ``run(ctx: StageContext) -> dict[str, float]`` that executes
inside an active MLflow run (opened by :func:`workflow.runs.tracked_run`), logs its
metrics and artifacts there, and returns the metrics worth a summary line. Artifacts of
earlier stages are read by run ID (``runs:/<id>/<path>``) through :meth:`upstream_file`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workflow.checksums import fetch
from workflow.components import load_data, resolve_device
from workflow.progress import Reporter
from workflow.specfile import ResolvedSpec

__all__ = ["StageContext", "UpstreamMissing"]


class UpstreamMissing(RuntimeError):
    """A stage needs an earlier stage's run and none was given."""


@dataclass
class StageContext:
    """Inputs of one stage run.

    Attributes:
        rspec: the resolved spec.
        upstream: run IDs of earlier stages (``{"sample": "<run id>", ...}``).
        reporter: progress sink.
        workdir: scratch folder for files before they are logged.
        shared: objects reused across stages of one process (the loaded dataset).
    """

    rspec: ResolvedSpec
    upstream: dict[str, str]
    reporter: Reporter
    workdir: Path
    shared: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return resolve_device(self.rspec.spec.train.device)

    def dataset(self):
        """The spec's dataset, loaded once per process (keyed by its resolved section)."""
        key = json.dumps(self.rspec.data["dataset"], sort_keys=True)
        if self.shared.get("dataset_key") != key:
            self.shared.pop("dataset", None)  # release the previous one first
            self.shared["dataset"] = load_data(self.rspec)
            self.shared["dataset_key"] = key
        return self.shared["dataset"]

    def upstream_file(self, stage: str, artifact_path: str, *, required: bool = False) -> Path | None:
        """Download ``artifact_path`` of the ``stage`` run, checked against its checksum
        (:func:`workflow.checksums.fetch`, raises
        :class:`~workflow.checksums.ArtifactDamaged` naming the run and file); ``None``
        when no such run was given (or :class:`UpstreamMissing` if ``required``)."""
        run_id = self.upstream.get(stage)
        if run_id is None:
            if required:
                raise UpstreamMissing(
                    f"this stage needs the {stage} stage's run: run the pipeline (betty run / "
                    f"mlflow run -e main) or pass --upstream {stage}=<RUN_ID>")
            return None
        dst = self.workdir / f"upstream-{stage}-{run_id}"
        dst.mkdir(parents=True, exist_ok=True)
        return fetch(run_id, artifact_path, dst)
