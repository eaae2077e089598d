"""``betty compare``: one row per pipeline run with its headline metrics, plus
mean ± std rows for repeats (runs of identical spec content), see :mod:`workflow.report`."""

from __future__ import annotations

import os
from typing import Annotated, Optional

import typer

from workflow.commands._common import ExperimentOpt, JsonOpt, active_experiment_ids, emit_json, experiment_id, fail


def _experiments(name: str | None) -> list[str]:
    """``--experiment``, else the environment's experiment, else every active one (each
    spec writes to its own experiment by default)."""
    if name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or os.environ.get("MLFLOW_EXPERIMENT_ID"):
        return [experiment_id(name)]
    return active_experiment_ids()


def compare(experiment: ExperimentOpt = None,
            spec: Annotated[Optional[str], typer.Option("--spec", help="Only runs of this spec name.")] = None,
            last: Annotated[int, typer.Option("--last", "--limit", "-n", min=1, help="The newest N runs.")] = 50,
            csv_: Annotated[bool, typer.Option("--csv", help="CSV on stdout (raw numbers; mean and std rows).")] = False,
            markdown: Annotated[bool, typer.Option("--markdown", help="A Markdown table on stdout.")] = False,
            json_: JsonOpt = False,
            wide: Annotated[bool, typer.Option("--wide", help="Every column at full width, however wide the terminal.")] = False) -> None:
    """Pipeline runs (betty run / mlflow run -e main) side by side: run ID, start time,
    status, duration, K, redundancy, estimated and measured peak memory, epoch time,
    accuracy; then mean ± std over repeats (runs with the same spec content). The table
    fits the terminal ($COLUMNS), leaving out the less important columns; --wide shows all."""
    from mlflow.tracking import MlflowClient

    from workflow.report import formatted, repeat_summaries, rows_for, to_csv, to_markdown

    if csv_ + markdown + json_ > 1:
        raise fail("choose one of --csv, --markdown and --json", 2)
    exps = _experiments(experiment)
    query = "tags.run_kind = 'main'"
    if spec:
        import re

        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", spec):  # what a spec's name may be
            raise fail(f"--spec {spec!r} is not a spec name (letters, digits, _ . -)", 2)
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
    _print_table(formatted(rows, summaries), len(rows), bool(summaries), exps, wide)


# Columns left out, in this order, until the table fits the terminal (--wide: none).
DROP_ORDER = ("run id", "start (UTC)", "aggr", "dataset", "test std", "est err", "mem est", "arch",
              "duration s", "status", "redundancy", "spec", "epoch s", "method", "mem measured", "valid")


def table_width(widths: list[int]) -> int:
    """Characters a rich table with columns this wide takes (one space of padding each
    side of a cell, a border between and around the columns)."""
    return sum(widths) + 3 * len(widths) + 1


def fit_columns(headers: tuple[str, ...], cells: list[list[str]], width: int | None) -> list[int]:
    """Indices of the columns to show: all when ``width`` is ``None``, else all but the
    first ones of :data:`DROP_ORDER` needed for the table to fit in ``width`` characters."""
    widths = [max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(headers)]
    keep = list(range(len(headers)))
    for header in DROP_ORDER:
        if width is None or table_width([widths[i] for i in keep]) <= width:
            break
        if header in headers:
            keep.remove(headers.index(header))
    return keep


def _print_table(cells: list[list[str]], n_runs: int, has_summaries: bool, exps: list[str], wide: bool) -> None:
    """The table on a console as wide as the terminal (``$COLUMNS`` when set), with the
    less important columns left out if it does not fit; every column at full width with
    ``wide`` or when the output is piped and ``$COLUMNS`` is unset."""
    from rich.console import Console
    from rich.table import Table

    from workflow.report import HEADERS, NUMERIC

    console = Console()
    fit = not wide and (console.is_terminal or bool(os.environ.get("COLUMNS")))
    keep = fit_columns(HEADERS, cells, console.width if fit else None)
    table = Table(title=f"betty runs (experiment{'s' if len(exps) > 1 else ''} {', '.join(exps)})")
    for i in keep:
        header = HEADERS[i]
        table.add_column(header, justify="right" if header in NUMERIC else "left", no_wrap=True)
    for r, row in enumerate(cells):
        table.add_row(*(row[i] for i in keep), end_section=r == n_runs - 1 and has_summaries)
    if not fit:
        console = Console(width=max(console.width, table_width(
            [max([len(HEADERS[i]), *(len(row[i]) for row in cells)]) for i in keep])))
    console.print(table)
    hidden = [HEADERS[i] for i in range(len(HEADERS)) if i not in keep]
    if hidden:
        console.print(f"(not shown to fit {console.width} columns: {', '.join(hidden)}; --wide shows them)")
