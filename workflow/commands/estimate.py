"""``betty estimate SPEC [--k K] [--measure] [--micro-batches]``: the memory model's view of a batch."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from workflow.commands._common import JsonOpt, SetOpt, SpecArg, check_k_fits, emit_json, fail, load


def _parse_k(text: str | None) -> str | None:
    if text in (None, "auto"):
        return text
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise fail(f"--k must be an integer >= 1 or 'auto', got {text!r}", 2)
    return str(k)


def estimate(spec: SpecArg,
             k: Annotated[Optional[str], typer.Option("--k", help="Micro-batches, an integer or 'auto' (default: the spec's).")] = None,
             measure: Annotated[bool, typer.Option("--measure", help="Also run forward+backward of every micro-batch once and report the measured peak and the relative error.")] = False,
             set_: SetOpt = None, json_: JsonOpt = False,
             micro_batches: Annotated[bool, typer.Option(
                 "--micro-batches", help="Also print one line per micro-batch (revgnn: per part).")] = False) -> None:
    """Estimate the peak memory of every micro-batch of the spec's first sampled batch
    (revgnn: of every cluster part), per component, before running anything (k: auto
    searches K for the spec's memory_budget). With --measure, train one step to reach the
    optimizer's steady state, then measure every micro-batch once with the memory meter
    (revgnn: a second, measured step); the trainer's memory_report does both. Prints a
    summary (budget, the Ks tried, the chosen K, the largest micro-batch);
    --micro-batches adds one line per micro-batch, --json gives everything."""
    from workflow.components import load_data, make_trainer, resolve_device

    k_value = _parse_k(k)
    rspec = load(spec, set_, {"partition.k": k_value})
    if rspec.spec.model.arch == "revgnn" and rspec.spec.model.deq:
        raise fail("the memory model does not cover model.deq: true (one weight-tied "
                   "cell solved to a fixed point); it estimates the other revgnn variants", 2)
    trainer, _, _ = make_trainer(rspec, load_data(rspec), resolve_device(rspec.spec.train.device))
    if k_value not in (None, "auto"):
        check_k_fits(trainer, int(k_value), f"--k {k_value}")
    out = {"spec": rspec.name, **trainer.memory_report(measure)}
    if json_:
        emit_json(out)
        return
    for line in summary_lines(out, listed=micro_batches):
        typer.echo(line)
    if micro_batches:
        for line in micro_batch_lines(out):
            typer.echo(line)


def _mib(n: int | float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _tried_pairs(tried) -> list[tuple[int, int]]:
    """``(K, max estimated peak)`` from a K search record (a list of rows or a dict)."""
    if isinstance(tried, dict):
        return [(int(k), int(v)) for k, v in tried.items()]
    return [(int(r["k"]), int(r["max_estimated_peak_bytes"])) for r in tried or []]


def _unit(out: dict) -> tuple[str, str]:
    """What the report's rows are, singular and plural (``micro-batch``, RevGNN's ``part``)."""
    name = out["micro_batch_name"]
    return name, name + ("es" if name.endswith("h") else "s")


def summary_lines(out: dict, *, listed: bool = False) -> list[str]:
    """What ``betty estimate`` prints first: method and K, the budget and how the K search
    went, the largest micro-batch (measured too with ``--measure``) and its components;
    unless ``listed`` (``--micro-batches``), a pointer to the per-micro-batch lines."""
    lines = [f"{out['spec']}: {out['method']} K={out['k']} ({out['backend']} constants)"]
    budget = out.get("memory_budget_bytes")
    if budget:
        line = f"  budget {_mib(budget)} (safety margin {out.get('safety_margin') or 0:.0%})"
    else:
        line = "  no memory budget (partition.memory_budget)"
    tried = _tried_pairs(out.get("k_tried"))
    if tried:
        line += "; K tried: " + ", ".join(f"{k} ({_mib(peak)})" for k, peak in tried) + f" -> K={out['k']}"
    lines.append(line)
    rows, (one, many) = out["micro_batches"], _unit(out)
    worst = max(rows, key=lambda r: r["estimated_peak_bytes"])
    line = f"  largest {one}: {worst['index']} of {len(rows)}, estimated {_mib(worst['estimated_peak_bytes'])}"
    if worst.get("measured_peak_bytes"):
        line += f", measured {_mib(worst['measured_peak_bytes'])} ({100 * worst['relative_error']:+.2f}%)"
    if out.get("max_abs_relative_error") is not None:
        line += f"; worst error over {many} {100 * out['max_abs_relative_error']:.2f}%"
    lines.append(line)
    parts = ", ".join(f"{c} {b / 2**20:.1f}" for c, b in
                      sorted(worst["components"].items(), key=lambda kv: -kv[1]) if b)
    lines.append(f"  largest {one} by component (MiB): {parts}")
    if len(rows) > 1 and not listed:
        lines.append(f"  (--micro-batches lists all {len(rows)} {many})")
    return lines


def micro_batch_lines(out: dict) -> list[str]:
    """One line per micro-batch (RevGNN: per cluster part): estimated peak (and measured
    peak and error with ``--measure``)."""
    lines, (one, _) = [], _unit(out)
    for row in out["micro_batches"]:
        line = f"  {one} {row['index']:<3} estimated {row['estimated_peak_bytes'] / 2**20:10.2f} MiB"
        if row.get("measured_peak_bytes"):
            line += (f"  measured {row['measured_peak_bytes'] / 2**20:10.2f} MiB"
                     f"  error {100 * row['relative_error']:+.2f}%")
        lines.append(line)
    return lines
