"""The rows of ``betty compare``: one per pipeline run, plus mean ± std over repeats.

A *row* maps each column header of :data:`COLUMNS` to a raw value (``None`` when the run
lacks it), plus ``run_id`` and the hidden ``spec_sha``, ``backend``, ``device`` and
``train_run`` (its train stage's run). Runs with the same ``spec_sha`` (identical resolved
spec content), ``backend`` tag (the framework and versions it ran on) and device (cpu, or
the kind of GPU: its times and peaks are another machine's) that trained apart (not one
reusing another's train run) are *repeats*; for every group of two or more FINISHED
repeats :func:`repeat_summaries` gives, per numeric column c,

    mean_c = (1/n) Σ_i x_i,   std_c = sqrt((1/n) Σ_i (x_i - mean_c)²)

(the population std, :func:`betty.fit.mean_std`, as for ``train.repeats``) over the n
runs that have c. Renderers: :func:`to_csv` (raw numbers; a summary is two rows, ``mean`` and
``std``), :func:`to_markdown` and :func:`formatted` (display strings, a summary is one
``mean ± std`` row).
"""

from __future__ import annotations

import csv
import io
from datetime import datetime, timezone

from betty.fit import mean_std

__all__ = ["COLUMNS", "NUMERIC", "rows_for", "repeat_summaries", "formatted", "to_csv", "to_markdown"]

COLUMNS = (
    # (header, source, key)
    ("run", "info", "run_name"),
    ("run id", "info", "run_id"),
    ("start (UTC)", "info", "start_time"),
    ("status", "info", "status"),
    ("duration s", "info", "duration"),
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
HEADERS = tuple(h for h, _, _ in COLUMNS)
NUMERIC = tuple(h for h, source, key in COLUMNS if source == "metric" or key == "duration")


def _value(run, source: str, key: str):
    if source == "info":
        if key == "duration":
            end = run.info.end_time
            return (end - run.info.start_time) / 1000.0 if end and run.info.start_time else None
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
    """One dict per run: header -> raw value, plus ``run_id``, ``spec_sha``, ``backend``
    and ``train_run``."""
    out = []
    for run in runs:
        row = {header: _value(run, source, key) for header, source, key in COLUMNS}
        row["run_id"] = run.info.run_id
        row["spec_sha"] = run.data.tags.get("spec_sha")
        row["backend"] = run.data.tags.get("backend")
        row["device"] = run.data.tags.get("device_identity") or run.data.tags.get("device")
        row["train_run"] = run.data.tags.get("stage_run.train")
        if row.get("arch") == "revgnn":  # no aggregator: show the convolution of the blocks
            row["aggr"] = run.data.params.get("spec.model.conv")
        out.append(row)
    return out


def repeat_summaries(rows: list[dict]) -> list[dict]:
    """For each ``spec_sha``, ``backend`` and ``device`` with >= 2 FINISHED runs that trained
    apart (in order of first appearance; a pipeline run that reused an earlier one's train
    run repeats nothing and is left out): ``{"spec", "spec_sha", "backend", "device", "n",
    "run_ids", "mean": {col: m}, "std": {col: s}}``."""
    finished = [row for row in rows if row["status"] == "FINISHED" and row.get("spec_sha")]
    trained: dict[str, dict] = {}  # train run -> the first pipeline run that had it
    for row in sorted(finished, key=lambda r: r["start (UTC)"] or 0):
        trained.setdefault(row.get("train_run"), row)
    groups: dict[str, list[dict]] = {}
    for row in finished:
        if row.get("train_run") is None or trained[row["train_run"]] is row:
            groups.setdefault((row["spec_sha"], row.get("backend"), row.get("device")), []).append(row)
    out = []
    for (sha, backend, device), members in groups.items():
        if len(members) < 2:
            continue
        mean, std = {}, {}
        for col in NUMERIC:
            values = [float(r[col]) for r in members if r[col] is not None]
            if values:
                mean[col], std[col] = mean_std(values)
        out.append({"spec": members[0]["spec"], "spec_sha": sha, "backend": backend, "device": device,
                    "n": len(members),
                    "run_ids": [r["run_id"] for r in members], "mean": mean, "std": std})
    return out


def _fmt(header: str, value) -> str:
    from betty.sizes import format_bytes

    if value is None:
        return "-"
    if header == "start (UTC)":
        return datetime.fromtimestamp(value / 1000.0, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    if header.startswith("mem "):
        return format_bytes(value)
    if header == "K":
        return f"{value:.0f}" if float(value).is_integer() else f"{value:.3g}"
    if header == "duration s":
        return f"{value:.1f}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _group(summary: dict) -> str:
    """How a summary row names its group: ``n=2``, with the backend and the device
    (``n=2, dgl, cpu``) where the runs were tagged with them."""
    backend, device = summary.get("backend"), summary.get("device")
    return (f"n={summary['n']}" + (f", {backend.split(' (')[0]}" if backend else "")
            + (f", {device}" if device else ""))


def formatted(rows: list[dict], summaries: list[dict]) -> list[list[str]]:
    """Display cells, one list per row in :data:`HEADERS` order: the runs, then one
    ``mean ± std`` row per summary."""
    out = [[_fmt(h, row[h]) for h in HEADERS] for row in rows]
    for s in summaries:
        cells = []
        for h in HEADERS:
            if h == "run":
                cells.append(f"mean ± std ({_group(s)})")
            elif h == "spec":
                cells.append(str(s["spec"]))
            elif h in s["mean"]:
                cells.append(f"{_fmt(h, s['mean'][h])} ± {_fmt(h, s['std'][h])}")
            else:
                cells.append("")
        out.append(cells)
    return out


def to_csv(rows: list[dict], summaries: list[dict]) -> str:
    """CSV with a ``row`` column (``run``, ``mean``, ``std``), raw numbers, times in
    milliseconds since the epoch (``start (UTC)``), then ``spec_sha`` and ``backend``."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["row", *HEADERS, "spec_sha", "backend"])
    for row in rows:
        writer.writerow(["run", *("" if row[h] is None else row[h] for h in HEADERS), row.get("spec_sha") or "",
                         row.get("backend") or ""])
    for s in summaries:
        for kind in ("mean", "std"):
            cells = [s["spec"] if h == "spec" else s[kind].get(h, "") for h in HEADERS]
            cells[HEADERS.index("run")] = f"{kind} ({_group(s)})"
            writer.writerow([kind, *cells, s["spec_sha"], s.get("backend") or ""])
    return buf.getvalue()


def to_markdown(rows: list[dict], summaries: list[dict]) -> str:
    """A GitHub-flavoured Markdown table of :func:`formatted` (``|`` escaped)."""
    lines = ["| " + " | ".join(HEADERS) + " |",
             "|" + "|".join("---:" if h in NUMERIC else "---" for h in HEADERS) + "|"]
    for cells in formatted(rows, summaries):
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"
