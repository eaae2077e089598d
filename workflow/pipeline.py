"""Run stages: one alone (:func:`run_stage`), or all of them as child runs of one parent
(:func:`run_pipeline`), each reused (:mod:`workflow.reuse`) or run in this process with
the loaded dataset shared from stage to stage. ``betty run`` and ``mlflow run -e main``
run the pipeline; ``betty stage`` and the per-stage entry points run one stage.

Parent run, reuse: docs/workflow.md, *The parent run* and *Reuse*.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import warnings
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from workflow.checksums import ArtifactDamaged, damaged_artifacts
from workflow import components
from workflow.components import resolve_device
from workflow.lineage import DIGEST_TAG, check_upstream
from workflow.progress import Reporter
from workflow.reuse import find_reusable, stage_key
from workflow.runs import encode_upstream, log_metrics, tracked_run
from workflow import signals
from workflow.specfile import STAGES, ResolvedSpec
from workflow.stages import UPSTREAM, stage_function
from workflow.stages.base import StageContext
from workflow.tracking import MODEL_NAME, log_dataset_input, logged_model_problem

__all__ = ["run_stage", "run_pipeline", "collect_summary"]


def run_stage(stage: str, rspec: ResolvedSpec, upstream: dict[str, str] | None = None, *,
              reporter: Reporter | None = None, nested: bool = False, shared: dict | None = None) -> tuple[str, dict]:
    """Run one stage in its own run (nested under the active run if ``nested``).

    ``upstream`` runs are checked first (:func:`workflow.lineage.check_upstream`).

    Returns:
        ``(run_id, summary metrics)``.
    """
    upstream = dict(upstream or {})
    reporter = reporter or Reporter()
    device = str(resolve_device(rspec.spec.train.device))
    check_upstream(rspec, stage, upstream)  # before a run exists: a refused lineage leaves none
    key = stage_key(rspec, stage, upstream.get(UPSTREAM[stage] or ""), device)
    tags = {**key, "upstream": encode_upstream(upstream) or "none"}
    with tempfile.TemporaryDirectory(prefix=f"betty-{stage}-") as tmp, \
            tracked_run("stage", stage, rspec, nested=nested, run_name=f"{rspec.name}/{stage}",
                        device=device, tags=tags) as run:
        signals.check()  # a signal swallowed by a library (importing torch) ends the run here
        ctx = StageContext(rspec=rspec, upstream=upstream, reporter=reporter, workdir=Path(tmp),
                           shared=shared if shared is not None else {})
        metrics = stage_function(stage)(ctx)
        mlflow.set_tag(DIGEST_TAG, components.dataset_digest(rspec))  # the data it was made from, once fetched
        signals.check()
    return run.info.run_id, metrics


def collect_summary(upstream: dict[str, str]) -> dict[str, float]:
    """Headline metrics for the parent run: the train run's latest metrics, with the
    peak memory figures replaced by their maximum over epochs and ``epoch_time_s`` by
    its mean; then every metric of the evaluate run."""
    client = MlflowClient()
    out: dict[str, float] = {}
    if "train" in upstream:
        train_id = upstream["train"]
        out.update(client.get_run(train_id).data.metrics)
        for name in ("peak_mem_measured_bytes", "peak_mem_estimated_bytes", "mem_estimate_error"):
            history = client.get_metric_history(train_id, name)
            if history:
                out[name] = max(m.value for m in history)
        history = client.get_metric_history(train_id, "epoch_time_s")
        if history:
            out["epoch_time_s"] = statistics.fmean(m.value for m in history)
    if "partition" in upstream:
        part = client.get_run(upstream["partition"]).data.metrics
        for name in ("time_build_s", "time_block_s", "imbalance"):
            if name in part:
                out.setdefault(name, part[name])
    if "evaluate" in upstream:
        out.update(client.get_run(upstream["evaluate"]).data.metrics)
    return out


def _trained_models_damaged(run_id: str, listed: Path) -> list[ArtifactDamaged]:
    """What is wrong with the models train run ``run_id`` lists in ``models.json`` (its
    own, or one per repeat run with ``train.repeats > 1``; ``listed``: where
    :func:`damaged_artifacts` downloaded it, found intact): each run's checksummed
    artifacts and its logged MLflow model (``runs:/<id>/model``). A missing or damaged
    ``models.json`` is :func:`damaged_artifacts`' to report, and not read."""
    try:
        entries = json.loads(listed.read_text())
    except (OSError, ValueError):
        return []
    from mlflow.exceptions import MlflowException

    damaged = []
    for model_run in dict.fromkeys(entry.get("run_id") if isinstance(entry, dict) else None for entry in entries):
        if not isinstance(model_run, str):
            damaged.append(ArtifactDamaged(run_id, "models.json", "damaged (an entry without a run_id)"))
            continue
        if model_run != run_id:
            try:
                damaged += damaged_artifacts(model_run)
            except MlflowException as err:  # the repeat run was deleted
                damaged.append(ArtifactDamaged(model_run, "the run", f"missing ({str(err)[:120]})"))
                continue
        problem = logged_model_problem(model_run)
        if problem is not None:
            damaged.append(ArtifactDamaged(model_run, MODEL_NAME, problem))
    return damaged


def _intact(stage: str, run_id: str, reporter: Reporter) -> str | None:
    """``run_id`` if every checksummed artifact of it (:mod:`workflow.checksums`) and,
    for a train run, the models it lists (:func:`_trained_models_damaged`) are present
    and intact, else ``None`` after a warning naming the run and each damaged file (the
    stage runs again)."""
    with tempfile.TemporaryDirectory(prefix="betty-verify-") as tmp:
        damaged = damaged_artifacts(run_id, tmp)
        if stage == "train" and not any(err.artifact == "models.json" for err in damaged):
            damaged += _trained_models_damaged(run_id, Path(tmp) / "models.json")
    if not damaged:
        return run_id
    for err in damaged:
        where = err.artifact if err.run_id == run_id else f"{err.artifact} of its repeat run {err.run_id}"
        text = f"not reusing the {stage} run {run_id}: {where} is {err.problem}; running {stage} again"
        warnings.warn(text, stacklevel=3)
        reporter.note(f"warning: {text}")
    mlflow.set_tag(f"reuse_refused.{stage}", f"{run_id}: " + ", ".join(e.artifact for e in damaged))
    return None


def run_pipeline(rspec: ResolvedSpec, *, reuse: bool = True, reporter: Reporter | None = None,
                 stages: tuple[str, ...] = STAGES, rerun: tuple[str, ...] = ()) -> dict[str, dict]:
    """All ``stages`` as children of one parent run, each reused when a run with its key
    is found intact (:func:`_intact`), else run (always for the stages in ``rerun``:
    the train stage of several machines, whose other machines' ranks wait for it); the
    parent gets the ``stage_run.*`` and ``reused*`` tags and :func:`collect_summary`.

    Returns:
        ``{stage: {"run_id": ..., "reused": bool}}`` plus ``"main": {"run_id": ...}``.
    """
    reporter = reporter or Reporter()
    device = str(resolve_device(rspec.spec.train.device))
    outcomes: dict[str, dict] = {}
    shared: dict = {}  # what one stage loaded for the next (the dataset)
    with tracked_run("main", "main", rspec, run_name=rspec.name, device=device) as parent:
        experiment_id = parent.info.experiment_id
        log_dataset_input(rspec)
        outcomes["main"] = {"run_id": parent.info.run_id}
        upstream: dict[str, str] = {}
        for stage in stages:
            signals.check()
            key = stage_key(rspec, stage, upstream.get(UPSTREAM[stage] or ""), device)
            run_id = find_reusable(experiment_id, key) if reuse and stage not in rerun else None
            if run_id is not None:
                run_id = _intact(stage, run_id, reporter)
            reused = run_id is not None
            if reused:
                reporter.stage_finished(stage, "REUSED", f"run {run_id[:8]}")
                mlflow.set_tag(f"reused.{stage}", run_id)
            else:
                reporter.stage_started(stage)
                try:
                    run_id, _ = run_stage(stage, rspec, dict(upstream), reporter=reporter, nested=True,
                                          shared=shared)
                except BaseException as exc:
                    status = "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"
                    reporter.stage_finished(stage, status, str(exc).splitlines()[0][:120] if str(exc) else "")
                    raise
                reporter.stage_finished(stage, "FINISHED", f"run {run_id[:8]}")
            mlflow.set_tag(f"stage_run.{stage}", run_id)
            outcomes[stage] = {"run_id": run_id, "reused": reused}
            upstream[stage] = run_id
        reused = [s for s in stages if outcomes[s]["reused"]]
        mlflow.set_tag("reused_stages", ",".join(reused) or "none")
        log_metrics(collect_summary(upstream))
    return outcomes
