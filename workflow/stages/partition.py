"""Stage ``partition``: split the first epoch's work exactly as training will (the
trainer's ``measure_split``) and compare partitioners over ``partition.sweep`` (its
``sweep``); this module logs what they return.

Metrics and artifacts: docs/workflow.md, *Stages* (``revgnn``: *Reversible deep GNNs*).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import mlflow
import numpy as np

from betty.batchfile import load_batch
from betty.partition.sweep import SWEEP_COLUMNS
from betty.plots import sweep_figure
from betty.rev.sweep import CLUSTER_SWEEP_COLUMNS
from workflow.artifacts import write_csv, write_json
from workflow.checksums import log_artifact
from workflow.components import make_trainer
from workflow.progress import Reporter
from workflow.runs import log_metrics
from workflow.stages.base import StageContext

__all__ = ["run"]

TABLES = {"micro": "microbatches", "part": "parts"}
"""The CSV of a split's rows, by what they are (sampled micro-batches or RevGNN cluster parts)."""


@dataclass(frozen=True)
class _SweepLog:
    """How one engine's sweep is logged: its table's columns, the per-method metrics
    (``{row key: metric prefix}``, step K), the figure's panels (``(row key, axis
    label)``), its file name and what its title says."""

    columns: tuple[str, ...]
    metrics: Mapping[str, str]
    panels: tuple[tuple[str, str], ...]
    figure: str
    what: str


SWEEPS = {  # by the split's rows: sampled micro-batches or RevGNN cluster parts
    "micro": _SweepLog(
        SWEEP_COLUMNS, {"redundancy": "sweep_redundancy"}, (("redundancy", "redundancy (input loads / inputs)"),),
        "redundancy_vs_k", "redundancy vs K"),
    "part": _SweepLog(
        CLUSTER_SWEEP_COLUMNS,
        {"edges_kept_fraction": "sweep_edges_kept", "peak_estimated_bytes": "sweep_peak_estimated_bytes"},
        (("edges_kept_fraction", "edges kept (fraction)"), ("peak_estimated_bytes", "largest part, estimated peak")),
        "cluster_sweep", "cluster splits vs K"),
}


def run(ctx: StageContext) -> dict[str, float]:
    spec = ctx.rspec.spec
    p = spec.partition
    searches: list = []
    trainer, _, _ = make_trainer(ctx.rspec, ctx.dataset(), ctx.device, on_search=searches.append)
    path = ctx.upstream_file("sample", "batch.npz") if hasattr(trainer, "sample") else None  # revgnn: none
    split = trainer.measure_split(load_batch(path)[0] if path is not None else None)  # the first epoch's
    log_metrics(split.metrics())
    for i, row in enumerate(split.rows):
        log_metrics({f"{split.micro_batch_key}_{key.removeprefix('num_')}": value for key, value in row.items()
                     if key != split.micro_batch_key}, step=i)
    log_artifact(write_csv(ctx.workdir / f"{TABLES[split.micro_batch_key]}.csv", split.rows))
    path = ctx.workdir / "partition.npz"
    np.savez_compressed(path, **split.arrays)
    log_artifact(path)
    if searches:
        log_artifact(write_json(ctx.workdir / "ksearch.json", [r.to_dict() for r in searches]))
    ctx.reporter.note(split.summary)

    if p.sweep.k:
        options = dict(methods=p.sweep.methods or None, seed=spec.sampling.seed, time_limit_s=p.sweep.time_limit_s,
                       max_k=p.sweep.max_k, progress=_steps(ctx.reporter, "partition sweep"),
                       on_skip=lambda method, reason: ctx.reporter.note(f"sweep: {method} {reason}"))
        table, skipped = trainer.sweep(p.sweep.k, batch=split.batch, **options)
        _log_sweep(ctx, SWEEPS[split.micro_batch_key], table, skipped)
    return {key: split.report[key] for key in ("k", "redundancy", "edges_kept_fraction", "imbalance")
            if key in split.report}


def _steps(reporter: Reporter, description: str) -> Callable[[int, int], None]:
    """A library ``progress(done, total)`` shown as ``reporter``'s counted loop (started
    at the first call)."""
    state: dict = {}

    def progress(done: int, total: int) -> None:
        if "advance" not in state:
            state.update(advance=reporter.steps(description, total), done=0)
        if done > state["done"]:
            state["advance"](done - state["done"])
            state["done"] = done

    return progress


def _log_sweep(ctx: StageContext, kind: _SweepLog, table: list[dict], skipped: dict[str, str]) -> None:
    """The sweep's per-method metrics (step K), ``partition_sweep.csv`` (``kind``'s
    columns) and ``.json``, the ``sweep_skipped`` tag and, when a row has figures, the
    figure (docs/workflow.md, *Stages*). A row whose split another method made (its
    ``fallback``) is in the tables only: its figures are not its method's."""
    own = [row for row in table if not row.get("fallback")]
    for row in own:
        log_metrics({f"{prefix}.{row['method']}": row.get(key) for key, prefix in kind.metrics.items()},
                    step=row["k"])
    log_artifact(write_csv(ctx.workdir / "partition_sweep.csv", table, kind.columns))
    log_artifact(write_json(ctx.workdir / "partition_sweep.json", {"rows": table, "skipped": skipped}))
    if skipped:
        mlflow.set_tag("sweep_skipped", "; ".join(f"{m}: {r}" for m, r in skipped.items())[:500])
    first = kind.panels[0][0]
    if any(r.get(first) is not None for r in own):
        mlflow.log_figure(sweep_figure(own, kind.panels, title=f"{ctx.rspec.name}: {kind.what}"),
                          f"plots/{kind.figure}.png")
