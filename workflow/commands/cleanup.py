"""``betty cleanup``: end project runs that ``mlflow run`` left RUNNING before betty started.

``mlflow run .`` without ``--env-manager local`` on a machine without conda creates the
run, fails to build the conda environment, exits, and leaves the run ``RUNNING``
forever (MLflow 3.17). Such a run has the ``mlflow.project.entryPoint`` tag but none of
betty's tags (betty sets ``run_kind`` first thing). This command lists them and, with
``--fail``, ends them ``FAILED`` with an ``error`` tag saying why.
"""

from __future__ import annotations

import time
from typing import Annotated

import typer

from workflow.commands._common import ExperimentOpt, JsonOpt, cli_errors, emit_json, experiment_id

REASON = ("never started: the project environment could not be created (no conda?); "
          "run the project with --env-manager local")


def stale_runs(exp: str, min_age_s: float) -> list:
    """RUNNING project runs without betty's tags, started more than ``min_age_s`` ago."""
    from mlflow.tracking import MlflowClient

    runs = MlflowClient().search_runs([exp], "attributes.status = 'RUNNING'", max_results=1000)
    cutoff = (time.time() - min_age_s) * 1000
    return [r for r in runs
            if "mlflow.project.entryPoint" in r.data.tags and "run_kind" not in r.data.tags
            and (r.info.start_time or 0) <= cutoff]


@cli_errors
def cleanup(experiment: ExperimentOpt = None,
            fail: Annotated[bool, typer.Option("--fail", help="End the listed runs as FAILED.")] = False,
            min_age: Annotated[float, typer.Option("--min-age", min=0, help="Only runs started at least this many seconds ago.")] = 60.0,
            json_: JsonOpt = False) -> None:
    """List (and with --fail, end) MLflow project runs stuck in RUNNING that betty
    never started, e.g. after `mlflow run` without --env-manager local and no conda."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    runs = stale_runs(experiment_id(experiment), min_age)
    rows = [{"run_id": r.info.run_id, "run_name": r.info.run_name,
             "entry_point": r.data.tags["mlflow.project.entryPoint"],
             "environment": r.data.tags.get("mlflow.project.env")} for r in runs]
    if fail:
        for r in runs:
            client.set_tag(r.info.run_id, "error", REASON)
            client.set_terminated(r.info.run_id, "FAILED")
    if json_:
        emit_json({"stale": rows, "ended": fail})
        return
    for row in rows:
        typer.echo(f"{row['run_id']}  {row['entry_point']:<10} env={row['environment']}"
                   + ("  -> FAILED" if fail else ""))
    if rows and not fail:
        typer.echo("(run again with --fail to end them)")
    if not rows:
        typer.echo("no stuck project runs")


def register(app: typer.Typer) -> None:
    app.command("cleanup")(cleanup)
