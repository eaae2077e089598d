"""When may a finished stage run stand in for running the stage again?

Only when all of these match (the run's tags):

* ``stage`` (the entry point) and ``run_kind = stage``;
* ``stage_sha``: the content hash of the spec sections the stage depends on, plus
  runtime facts that change its result (the resolved device for ``train``/``evaluate``),
  see :meth:`workflow.specfile.ResolvedSpec.stage_sha`. It is a hash of the *resolved
  content*, never of the spec's path or name, so an edited spec file misses and a
  renamed copy hits;
* ``upstream_run_id``: the run of the stage before it (``none`` for ``download``), so a
  re-run upstream stage invalidates everything below it;
* ``code_version``: git commit plus a hash of the ``betty/`` and ``workflow/`` sources
  on disk (:mod:`workflow.provenance`), so uncommitted edits count;
* status ``FINISHED`` (failed, killed or running runs are never reused).

A run found this way is then checked by :func:`workflow.pipeline.run_pipeline`: its
checksummed artifacts must be intact and a train run's logged MLflow model present,
otherwise the stage runs again with a warning.
"""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from workflow.provenance import code_version
from workflow.specfile import ResolvedSpec

__all__ = ["DEVICE_DEPENDENT", "stage_runtime", "stage_key", "find_reusable"]

DEVICE_DEPENDENT = ("train", "evaluate")


def stage_runtime(stage: str, device: str) -> dict[str, str]:
    """The runtime facts that enter ``stage``'s ``stage_sha`` (the device, for train/evaluate)."""
    return {"device": device} if stage in DEVICE_DEPENDENT else {}


def stage_key(rspec: ResolvedSpec, stage: str, upstream_run_id: str | None, device: str) -> dict[str, str]:
    """The tags that identify a stage's result (set on its run, matched on reuse)."""
    return {
        "stage": stage,
        "stage_sha": rspec.stage_sha(stage, stage_runtime(stage, device)),
        "upstream_run_id": upstream_run_id or "none",
        "code_version": code_version(),
    }


def find_reusable(experiment_id: str, key: dict[str, str]) -> str | None:
    """The newest FINISHED stage run in ``experiment_id`` whose tags match ``key``."""
    clauses = [f"tags.{name} = '{value}'" for name, value in key.items()]
    clauses += ["tags.run_kind = 'stage'", "attributes.status = 'FINISHED'"]
    runs = MlflowClient().search_runs([experiment_id], " and ".join(clauses), max_results=1,
                                      order_by=["attributes.start_time DESC"])
    return runs[0].info.run_id if runs else None
