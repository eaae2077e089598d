"""``betty compare``: one row per pipeline run with its headline metrics."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from workflow.commands._common import ExperimentOpt, JsonOpt, cli_errors, emit_json, experiment_id

COLUMNS = (
    # (header, source, key)
    ("run", "info", "run_name"),
    ("status", "info", "status"),
    ("spec", "tag", "spec_name"),
    ("dataset", "tag", "dataset"),
    ("arch", "param", "spec.model.arch"),
    ("aggr", "param", "spec.model.aggregator"),
    ("method", "param", "spec.partition.method"),
    ("K", "metric", "k"),
    ("redundancy", "metric", "redundancy"),
    ("mem est", "metric", "peak_mem_estimated_bytes"),
    ("mem measured", "metric", "peak_mem_measured_bytes"),
    ("est err", "metric", "mem_estimate_error"),
    ("epoch s", "metric", "epoch_time_s"),
    ("valid", "metric", "valid_acc|valid_rocauc"),
    ("test", "metric", "test_acc|test_rocauc"),
    ("test std", "metric", "test_acc_std|test_rocauc_std"),
)


def _value(run, source: str, key: str):
    if source == "info":
        return getattr(run.info, key)
    if source == "tag":
        return run.data.tags.get(key)
    if source == "param":
        return run.data.params.get(key)
    for name in key.split("|"):
        if name in run.data.metrics:
            return run.data.metrics[name]
    return None


def rows_for(runs) -> list[dict]:
    """One dict per run: header -> value, plus ``run_id``."""
    out = []
    for run in runs:
        row = {"run_id": run.info.run_id}
        for header, source, key in COLUMNS:
            row[header] = _value(run, source, key)
        if row.get("arch") == "revgnn":  # no aggregator: show the convolution of the blocks
            row["aggr"] = run.data.params.get("spec.model.conv")
        out.append(row)
    return out


def _fmt(header: str, value) -> str:
    from workflow.sizes import format_bytes

    if value is None:
        return "-"
    if header.startswith("mem ") and header != "est err":
        return format_bytes(value)
    if header == "K":
        return f"{value:.0f}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


@cli_errors
def compare(experiment: ExperimentOpt = None,
            spec: Annotated[Optional[str], typer.Option("--spec", help="Only runs of this spec name.")] = None,
            limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="Newest N runs.")] = 50,
            json_: JsonOpt = False) -> None:
    """Pipeline runs (betty run / mlflow run -e main) side by side: K, redundancy,
    estimated and measured peak memory, epoch time, accuracy."""
    from mlflow.tracking import MlflowClient

    exp = experiment_id(experiment)
    query = "tags.run_kind = 'main'"
    if spec:
        query += f" and tags.spec_name = '{spec}'"
    runs = MlflowClient().search_runs([exp], query, max_results=limit, order_by=["attributes.start_time DESC"])
    rows = rows_for(runs)
    if json_:
        emit_json({"experiment_id": exp, "runs": rows})
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"betty runs (experiment {exp})")
    for header, source, _ in COLUMNS:
        table.add_column(header, justify="right" if source == "metric" else "left", no_wrap=True)
    for row in rows:
        table.add_row(*(_fmt(h, row[h]) for h, _, _ in COLUMNS))
    console = Console()
    if not console.is_terminal:  # piped: do not squeeze the table into 80 columns
        console = Console(width=250)
    console.print(table)


def register(app: typer.Typer) -> None:
    app.command("compare")(compare)
