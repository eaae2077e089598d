"""``betty stage NAME SPEC``: one stage as its own run."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from workflow.commands._common import ExperimentOpt, JsonOpt, SetOpt, SpecArg, emit_json, experiment_id, fail, load
from workflow.specfile import STAGES


def _auto_upstream(rspec, stage: str, upstream: dict[str, str], exp: str) -> dict[str, str]:
    """For ``evaluate`` without ``--upstream train=...``: the newest FINISHED train run
    of this spec content and code version in the active experiment
    (:func:`workflow.reuse.find_reusable` without the train run's own upstream)."""
    if stage != "evaluate" or "train" in upstream:
        return upstream
    from workflow.components import resolve_device
    from workflow.reuse import find_reusable, stage_key

    key = stage_key(rspec, "train", None, str(resolve_device(rspec.spec.train.device)))
    del key["upstream_run_id"]  # any partition run of this content
    run_id = find_reusable(exp, key)
    return {**upstream, "train": run_id} if run_id else upstream


def stage(name: Annotated[str, typer.Argument(metavar="STAGE", help=f"One of: {', '.join(STAGES)}.")],
          spec: SpecArg, set_: SetOpt = None, experiment: ExperimentOpt = None,
          upstream: Annotated[Optional[List[str]], typer.Option(
              "--upstream", "-u", help="An earlier stage's run: stage=RUN_ID. Repeatable.")] = None,
          json_: JsonOpt = False) -> None:
    """Run one stage in its own MLflow run. Stages without --upstream compute what they
    need from the spec (evaluate looks up the newest matching train run)."""
    from workflow.pipeline import run_stage
    from workflow.progress import format_metrics, make_reporter
    from workflow.runs import decode_upstream

    if name not in STAGES:
        raise fail(f"stage {name!r} is not one of {', '.join(STAGES)}", 2)
    try:
        ups = decode_upstream(";".join(upstream or []))
    except ValueError as err:
        raise fail(str(err), 2) from None
    from workflow.tracking import use_spec_experiment

    rspec = load(spec, set_)
    exp = use_spec_experiment(rspec, experiment) or experiment_id(experiment)
    ups = _auto_upstream(rspec, name, ups, exp)
    if name == "evaluate" and "train" not in ups:  # refused before a run exists
        raise fail("the evaluate stage needs a train run of this spec: none in this experiment "
                   "matches its content and code version (a train key changed, e.g. an evaluate.* "
                   "setting validation reads); run `betty stage train` first, or give "
                   "--upstream train=<RUN_ID>", 2)
    with make_reporter() as reporter:
        reporter.stage_started(name)
        try:
            run_id, metrics = run_stage(name, rspec, ups, reporter=reporter)
        except BaseException as exc:
            reporter.stage_finished(name, "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
            raise
        reporter.stage_finished(name, "FINISHED", f"run {run_id[:8]}")
    if json_:
        emit_json({"stage": name, "run_id": run_id, "metrics": metrics})
    else:
        typer.echo(f"{name}: run {run_id} {format_metrics(metrics)}")
