"""``betty compare``: one row per pipeline run with its headline metrics, plus
mean ± std rows for repeats (runs of identical spec content), see :mod:`workflow.report`."""

from __future__ import annotations

import os
from typing import Annotated, Optional

import typer

from workflow.commands._common import ExperimentOpt, JsonOpt, cli_errors, emit_json, experiment_id, fail


def _experiments(name: str | None) -> list[str]:
    """``--experiment``, else the environment's experiment, else every active one (each
    spec writes to its own experiment by default)."""
    if name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or os.environ.get("MLFLOW_EXPERIMENT_ID"):
        return [experiment_id(name)]
    from mlflow.tracking import MlflowClient

    return [e.experiment_id for e in MlflowClient().search_experiments()]


@cli_errors
def compare(experiment: ExperimentOpt = None,
            spec: Annotated[Optional[str], typer.Option("--spec", help="Only runs of this spec name.")] = None,
            last: Annotated[int, typer.Option("--last", "--limit", "-n", min=1, help="The newest N runs.")] = 50,
            csv_: Annotated[bool, typer.Option("--csv", help="CSV on stdout (raw numbers; mean and std rows).")] = False,
            markdown: Annotated[bool, typer.Option("--markdown", help="A Markdown table on stdout.")] = False,
            json_: JsonOpt = False) -> None:
    """Pipeline runs (betty run / mlflow run -e main) side by side: run ID, start time,
    status, duration, K, redundancy, estimated and measured peak memory, epoch time,
    accuracy; then mean ± std over repeats (runs with the same spec content)."""
    from mlflow.tracking import MlflowClient

    from workflow.report import HEADERS, NUMERIC, formatted, repeat_summaries, rows_for, to_csv, to_markdown

    if csv_ + markdown + json_ > 1:
        raise fail("choose one of --csv, --markdown and --json", 2)
    exps = _experiments(experiment)
    query = "tags.run_kind = 'main'"
    if spec:
        query += f" and tags.spec_name = '{spec}'"
    runs = MlflowClient().search_runs(exps, query, max_results=last, order_by=["attributes.start_time DESC"])
    rows = rows_for(runs)
    summaries = repeat_summaries(rows)
    if json_:
        emit_json({"experiment_ids": exps, "runs": rows, "repeats": summaries})
        return
    if csv_ or markdown:
        typer.echo(to_csv(rows, summaries) if csv_ else to_markdown(rows, summaries), nl=False)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"betty runs (experiment{'s' if len(exps) > 1 else ''} {', '.join(exps)})")
    for header in HEADERS:
        table.add_column(header, justify="right" if header in NUMERIC else "left", no_wrap=True)
    for i, cells in enumerate(formatted(rows, summaries)):
        table.add_row(*cells, end_section=i == len(rows) - 1 and bool(summaries))
    console = Console()
    if not console.is_terminal:  # piped: do not squeeze the table into 80 columns
        console = Console(width=320)
    console.print(table)


def register(app: typer.Typer) -> None:
    app.command("compare")(compare)
