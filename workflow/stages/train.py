"""Stage ``train``: epochs of exact micro-batch training (:mod:`workflow.training`), then
the outputs: ``model.pt`` (the selected weights), the MLflow model ``model`` logged at the
last epoch's step before that epoch's metrics (so MLflow links them, with the spec's
dataset, to it), the memory table per micro-batch (``revgnn``: per part), the K
searches, the figures and ``models.json`` (the runs holding the trained models, read by
the ``evaluate`` stage). ``train.repeats: N > 1`` trains N times in nested runs and logs
the mean and population std of every final metric.

Metrics and artifacts: docs/workflow.md, *Stages*, *Repeats* and *Model selection*.
"""

from __future__ import annotations

import contextlib

import mlflow
import torch

from betty.fit import summarize_repeats
from betty.plots import curves_figure, memory_figure

from workflow.artifacts import write_csv, write_json
from workflow.checksums import log_artifact
from workflow.components import build_model
from workflow.runs import log_metrics, tracked_run
from workflow.stages.base import StageContext
from workflow.tracking import MODEL_NAME, dataset_input, log_dataset_input, log_pytorch_model
from workflow.training import launched, train_distributed, train_epochs

__all__ = ["run", "train_once"]

PROGRESS_KEYS = ("loss", "train_acc", "valid_acc", "valid_rocauc")


def train_once(ctx: StageContext, repeat: int = 0) -> dict[str, float]:
    """Train one model in the active run (:func:`workflow.training.train_epochs`; on
    ``train.world_size`` ranks through :func:`workflow.training.train_distributed`);
    returns the last epoch's metrics (plus the maximum measured/estimated peak memory
    over epochs)."""
    spec = ctx.rspec.spec
    label = "epochs" + (f" ({spec.train.world_size} ranks)" if spec.train.world_size > 1 else "")
    advance = ctx.reporter.steps(label + (f" (repeat {repeat})" if spec.train.repeats > 1 else ""),
                                 spec.train.epochs)
    dataset = dataset_input(ctx.rspec)

    def on_epoch(entry: dict, last: bool) -> None:
        metrics = {k: v for k, v in entry.items() if k != "epoch"}
        if not last:  # the last epoch's: after the model (_log_outputs)
            log_metrics(metrics, step=entry["epoch"], dataset=dataset)
        advance(1, **{k: metrics[k] for k in PROGRESS_KEYS if k in metrics})

    if launched(ctx.rspec):
        out = train_distributed(ctx.rspec, repeat, dataset=ctx.dataset())
        for entry in out["history"]:  # rank 0's, logged once the ranks are done
            on_epoch(entry, entry is out["history"][-1])
        model = build_model(ctx.rspec, ctx.dataset(), seed=spec.train.seed + repeat)
        model.load_state_dict(out.pop("state"))  # rank 0's selected weights (identical on every rank)
    else:
        out = train_epochs(ctx.rspec, ctx.dataset(), ctx.device, repeat, on_epoch=on_epoch)
        model = out.pop("model")
    return _log_outputs(ctx, repeat, model, **out)


def _log_outputs(ctx: StageContext, repeat: int, model, *, history: list[dict], rows: list[dict],
                 searches: list, selection: dict[str, float], record: type) -> dict[str, float]:
    """Log ``model.pt`` (the selected weights), the memory table of ``record`` (the
    epoch record type: :attr:`betty.engine.EpochRecord.ROWS_TABLE` and friends), K
    searches and figures; return the final metrics (the last epoch's, plus
    ``selection``: the tracker's ``best_valid_acc``, ``best_epoch``, ``stopped_epoch``)."""
    folder = ctx.workdir / f"repeat-{repeat}"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, folder / "model.pt")
    log_artifact(folder / "model.pt")
    _log_model_and_last_epoch(ctx, model, history[-1])
    table, columns = record.ROWS_TABLE, ("repeat", *record.ROW_COLUMNS)
    if launched(ctx.rspec):
        columns = (*columns, "rank")
    log_artifact(write_csv(folder / f"{table}.csv", rows, columns))
    if searches:
        log_artifact(write_json(folder / "ksearch.json", [r.to_dict() for r in searches]))
    _log_figures(ctx, history, rows, record)

    final = {k: v for k, v in history[-1].items() if k != "epoch"}
    if selection:  # at the model's step, so the logged model carries them too
        log_metrics(selection, step=history[-1]["epoch"], dataset=dataset_input(ctx.rspec))
        final.update(selection)
    for key in ("peak_mem_measured_bytes", "peak_mem_estimated_bytes"):
        values = [h[key] for h in history if h.get(key) is not None]
        if values:
            final[key] = max(values)
    return final


def _log_model_and_last_epoch(ctx: StageContext, model, last: dict) -> None:
    """Log the MLflow model at the last epoch's step, then that epoch's metrics.

    MLflow links metrics logged at a logged model's step to it (with the dataset they
    name); metrics logged before the model would be copied onto it without their dataset."""
    log_pytorch_model(model, ctx.rspec, step=last["epoch"])
    log_metrics({k: v for k, v in last.items() if k != "epoch"}, step=last["epoch"],
                dataset=dataset_input(ctx.rspec))


def _log_figures(ctx: StageContext, history: list[dict], rows: list[dict], record) -> None:
    """The loss/accuracy curves, and the last epoch's memory per micro-batch of ``record``
    (the epoch record type: :attr:`betty.engine.EpochRecord.ROWS_TABLE` and friends)."""
    mlflow.log_figure(curves_figure(history, title=ctx.rspec.name), "plots/curves.png")
    last = [r for r in rows if r["epoch"] == history[-1]["epoch"]
            and r.get("batch", 0) == rows[-1].get("batch", 0) and r["peak_bytes"] is not None]
    if last:
        fig = memory_figure(last, title=f"{ctx.rspec.name}: epoch {history[-1]['epoch']}",
                            index_key=record.MICRO_BATCH_KEY, xlabel=record.MICRO_BATCH_NAME)
        mlflow.log_figure(fig, f"plots/{record.ROWS_TABLE}.png")


@contextlib.contextmanager
def _repeat_run(ctx: StageContext, repeat: int):
    """With ``train.repeats > 1``: repeat ``repeat``'s nested run, with its seeds as params."""
    spec = ctx.rspec.spec
    if spec.train.repeats == 1:
        yield
        return
    name = f"{mlflow.active_run().info.run_name or ctx.rspec.name}/repeat-{repeat}"
    with tracked_run("repeat", "train", ctx.rspec, nested=True, run_name=name, device=str(ctx.device),
                     tags={"repeat": str(repeat)}, log_spec=False):
        mlflow.log_params({"repeat": repeat, "train_seed": spec.train.seed + repeat,
                           "sampling_seed": spec.sampling.seed + repeat})
        yield


def run(ctx: StageContext) -> dict[str, float]:
    spec = ctx.rspec.spec
    models, finals = [], []
    log_dataset_input(ctx.rspec)
    for r in range(spec.train.repeats):
        with _repeat_run(ctx, r):
            finals.append(train_once(ctx, r))
            models.append({"repeat": r, "run_id": mlflow.active_run().info.run_id, "artifact": "model.pt",
                           "mlflow_model": MODEL_NAME, "train_seed": spec.train.seed + r,
                           "sampling_seed": spec.sampling.seed + r, "k": int(finals[-1]["k"])})
    final = finals[0]
    if len(finals) > 1:
        final = summarize_repeats(finals)
        log_metrics(final)
    log_artifact(write_json(ctx.workdir / "models.json", models))
    return final
