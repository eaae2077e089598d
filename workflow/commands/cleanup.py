"""``betty cleanup``: find (and with ``--fail`` end) runs stuck in ``RUNNING``.

A run is stuck when nothing will ever end it:

* ``never started``: a project run without betty's tags, older than ``--min-age``.
  ``mlflow run .`` without ``--env-manager local`` on a machine without conda creates
  the run, fails to build the conda environment, exits, and leaves it ``RUNNING``
  (MLflow 3.17); betty sets ``run_kind`` first thing, so such a run has none. Ended
  ``FAILED``;
* ``parent ended``: a betty run (``run_kind`` tag) whose parent run
  (``mlflow.parentRunId``) is no longer running, e.g. a stage whose process was killed
  before it could end its run. Ended ``KILLED``;
* ``process gone``: a betty run whose process (tags ``betty.host``, ``betty.pid``) ran
  on this machine and no longer exists. Ended ``KILLED``.

Each ended run gets an ``error`` tag saying which of these applied.
"""

from __future__ import annotations

import socket
import time
from typing import Annotated

import typer

from workflow.finalize import process_alive
from workflow.commands._common import ExperimentOpt, JsonOpt, cli_errors, emit_json, experiment_id

REASON = ("never started: the project environment could not be created (no conda?); "
          "run the project with --env-manager local")


def stuck_reason(run, client, min_age_s: float, host: str | None = None) -> tuple[str, str] | None:
    """``(status to end it with, reason)`` if ``run`` (RUNNING) is stuck, else ``None``."""
    tags = run.data.tags
    if "run_kind" not in tags:
        cutoff = (time.time() - min_age_s) * 1000
        if "mlflow.project.entryPoint" in tags and (run.info.start_time or 0) <= cutoff:
            return "FAILED", REASON
        return None
    parent_id = tags.get("mlflow.parentRunId")
    if parent_id:
        try:
            parent_status = client.get_run(parent_id).info.status
        except Exception:  # noqa: BLE001  (parent deleted)
            parent_status = "DELETED"
        if parent_status not in ("RUNNING", "SCHEDULED"):
            return "KILLED", f"stuck: its parent run {parent_id} ended {parent_status}"
    pid = tags.get("betty.pid", "")
    if tags.get("betty.host") == (host or socket.gethostname()) and pid.isdigit() and not process_alive(int(pid)):
        return "KILLED", f"stuck: its process {pid} on {tags['betty.host']} is gone"
    return None


def stale_runs(exp: str, min_age_s: float) -> list[tuple]:
    """``(run, status, reason)`` for every stuck RUNNING run of ``exp`` (see the module docstring)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    runs = client.search_runs([exp], "attributes.status = 'RUNNING'", max_results=1000)
    out = []
    for run in runs:
        verdict = stuck_reason(run, client, min_age_s)
        if verdict is not None:
            out.append((run, *verdict))
    return out


@cli_errors
def cleanup(experiment: ExperimentOpt = None,
            fail: Annotated[bool, typer.Option("--fail", help="End the listed runs (FAILED or KILLED, see the docs).")] = False,
            min_age: Annotated[float, typer.Option("--min-age", min=0, help="Project runs betty never started: only those started at least this many seconds ago.")] = 60.0,
            json_: JsonOpt = False) -> None:
    """List (and with --fail, end) runs stuck in RUNNING: project runs betty never
    started (e.g. `mlflow run` without --env-manager local and no conda), and betty runs
    whose parent run ended or whose process on this machine is gone."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    stuck = stale_runs(experiment_id(experiment), min_age)
    rows = [{"run_id": r.info.run_id, "run_name": r.info.run_name,
             "entry_point": r.data.tags.get("mlflow.project.entryPoint") or r.data.tags.get("stage", "?"),
             "environment": r.data.tags.get("mlflow.project.env"), "end_as": status, "reason": reason}
            for r, status, reason in stuck]
    if fail:
        for r, status, reason in stuck:
            client.set_tag(r.info.run_id, "error", reason)
            client.set_terminated(r.info.run_id, status)
    if json_:
        emit_json({"stale": rows, "ended": fail})
        return
    for row in rows:
        typer.echo(f"{row['run_id']}  {row['entry_point']:<10} {row['reason']}"
                   + (f"  -> {row['end_as']}" if fail else ""))
    if rows and not fail:
        typer.echo("(run again with --fail to end them)")
    if not rows:
        typer.echo("no stuck runs")


def register(app: typer.Typer) -> None:
    app.command("cleanup")(cleanup)
