"""``betty cleanup``: find (and with ``--fail`` end) runs stuck in ``RUNNING``, only those
whose process is provably gone (:func:`stuck_reason`), each with an ``error`` tag saying
why. Which runs: docs/workflow.md, *Interrupts and kills*.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from typing import Annotated

import typer

from betty.owner import Owner, pid_exists

from workflow.commands._common import ExperimentOpt, JsonOpt, active_experiment_ids, emit_json, experiment_id

REASON = ("never started: the project environment could not be created (no conda?); "
          "run the project with --env-manager local")


def _conda_missing() -> bool:
    """Whether this machine has no conda (so a conda-environment project run never started)."""
    return shutil.which("conda") is None and not os.environ.get("MLFLOW_CONDA_HOME")


def _process_gone(tags: dict) -> bool:
    """Whether the process of a betty run of this host has surely ended: its
    ``betty.owner`` (:class:`betty.owner.Owner`: pid, start time, PID namespace, boot)
    is gone, judged as for folders: a pid now held by a later process, or one of an
    earlier boot, is gone; one of another PID namespace (a container sharing the host's
    name) cannot be judged. A run without that tag (made by hand, or by an older betty)
    is judged by ``betty.pid`` alone, and only a pid this system could hold."""
    owner = Owner.of(tags.get("betty.owner", ""))
    if owner is not None:
        return owner.is_gone()
    pid = tags.get("betty.pid", "")
    return pid.isdigit() and 0 < int(pid) < 2**31 and not pid_exists(int(pid))


def stuck_reason(run, client, min_age_s: float, host: str | None = None,
                 ending: dict[str, str] | None = None, *, local_store: bool = True) -> tuple[str, str] | None:
    """``(status to end it with, reason)`` if ``run`` (RUNNING) is provably stuck, else
    ``None``: its parent ended (``KILLED``); on a ``local_store`` (a database or folder,
    not a tracking server other machines share) a project run without betty's tags, a
    conda environment and no conda here, started ``min_age_s`` ago (``FAILED``); a betty
    run whose process on this host is gone (:func:`_process_gone`, ``KILLED``).
    ``ending``: runs already found stuck in this pass (ID -> status)."""
    tags = run.data.tags
    parent_id = tags.get("mlflow.parentRunId")
    if parent_id:
        if ending and parent_id in ending:
            parent_status = ending[parent_id]
        else:
            from mlflow.exceptions import MlflowException
            from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode

            try:
                parent_status = client.get_run(parent_id).info.status
            except MlflowException as err:  # only a parent that is gone (purged); not a timeout or a refusal
                if err.error_code != ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
                    raise
                parent_status = "DELETED"
        if parent_status not in ("RUNNING", "SCHEDULED"):
            return "KILLED", f"stuck: its parent run {parent_id} ended {parent_status}"
    if "run_kind" not in tags:
        cutoff = (time.time() - min_age_s) * 1000
        if local_store and "mlflow.project.entryPoint" in tags and tags.get("mlflow.project.env") == "conda" \
                and _conda_missing() and (run.info.start_time or 0) <= cutoff:
            return "FAILED", REASON
        return None
    if tags.get("betty.host") == (host or socket.gethostname()) and _process_gone(tags):
        return "KILLED", f"stuck: its process {tags.get('betty.pid')} on {tags['betty.host']} is gone"
    return None


def stale_runs(exp: str | None, min_age_s: float) -> list[tuple]:
    """``(run, status, reason)`` for every stuck RUNNING run of ``exp`` (``None``: of every
    active experiment), in passes until one finds no more (a stage whose parent is found
    stuck is stuck too)."""
    from mlflow.tracking import MlflowClient

    from workflow.runs import local_store

    client, local = MlflowClient(), local_store()
    exps = [exp] if exp is not None else active_experiment_ids()
    runs = client.search_runs(exps, "attributes.status = 'RUNNING'", max_results=50000) if exps else []
    ending: dict[str, str] = {}
    out = []
    changed = True
    while changed:  # a stage whose parent is found stuck in this pass is stuck too
        changed = False
        for run in runs:
            if run.info.run_id in ending:
                continue
            verdict = stuck_reason(run, client, min_age_s, ending=ending, local_store=local)
            if verdict is not None:
                ending[run.info.run_id] = verdict[0]
                out.append((run, *verdict))
                changed = True
    return out


def cleanup(experiment: ExperimentOpt = None,
            fail: Annotated[bool, typer.Option("--fail", help="End the listed runs (FAILED or KILLED, see the docs).")] = False,
            min_age: Annotated[float, typer.Option("--min-age", min=0, help="Project runs betty never started: only those started at least this many seconds ago.")] = 60.0,
            json_: JsonOpt = False) -> None:
    """List (and with --fail, end) runs stuck in RUNNING, in every active experiment
    unless --experiment (or $MLFLOW_EXPERIMENT_NAME) names one: project runs that never started (a conda environment
    on a machine without conda), runs whose parent run ended, and betty runs whose process
    on this machine is gone. Runs whose process may still live are left alone."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    named = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
    stuck = stale_runs(experiment_id(named) if named else None, min_age)
    rows = [{"run_id": r.info.run_id, "run_name": r.info.run_name,
             "entry_point": r.data.tags.get("mlflow.project.entryPoint") or r.data.tags.get("stage", "?"),
             "environment": r.data.tags.get("mlflow.project.env"), "end_as": status, "reason": reason}
            for r, status, reason in stuck]
    if fail:
        from workflow.runs import ERROR_TAG_LIMIT
        from workflow.spec import short_text

        for r, status, reason in stuck:  # the failure recorded before, if any, stays first
            earlier = r.data.tags.get("error")
            client.set_tag(r.info.run_id, "error",
                           short_text(f"{earlier}; then {reason}" if earlier else reason, ERROR_TAG_LIMIT))
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
