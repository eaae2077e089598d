"""``betty estimate SPEC [--k K] [--measure] [--pieces]``: the memory model's view of a batch."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from workflow.commands._common import JsonOpt, SetOpt, SpecArg, cli_errors, emit_json, fail, load


def _parse_k(text: str | None) -> str | None:
    if text is None:
        return None
    if text == "auto":
        return text
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise fail(f"--k must be an integer >= 1 or 'auto', got {text!r}", 2)
    return str(k)


def _sampled_pieces(rspec, ds, device, trainer, model, optimizer):
    """GraphSAGE/GAT/GCN: the first sampled batch, split as the first epoch would be:
    ``(figures, per-piece estimates, measure)``; ``measure(meter)`` trains one step (the
    optimizer's steady state), then measures every micro-batch once."""
    from betty.memory import estimate_pieces
    from betty.models.dropout import dropout_key
    from betty.train import accumulate_gradients, train_step

    from workflow.components import torch_dtype

    batch = trainer.sample(0, 0)
    result, _, _ = trainer.partition(batch, 0, 0)
    # the Trainer's own memory-model keywords: its precision, features and targets
    estimates = estimate_pieces(batch, result.groups, result.k, model, optimizer, **trainer.memory_kwargs)

    def measure(meter) -> list[int | None]:
        common = dict(k=result.k, device=device, dropout_key=dropout_key(rspec.spec.train.seed, 0),
                      multilabel=ds.multilabel, dtype=torch_dtype(rspec), precision=trainer.precision)
        train_step(model, optimizer, batch, result.groups, ds.feat, ds.label, **common)  # Adam state
        optimizer.zero_grad(set_to_none=True)
        step = accumulate_gradients(model, batch, result.groups, ds.feat, ds.label, meter=meter, **common)
        model.zero_grad(set_to_none=True)
        return [r.peak_bytes for r in step.micro]

    return {"method": result.method, "k": result.k, "num_outputs": batch.num_outputs}, estimates, measure


def _reversible_pieces(rspec, ds, device, trainer, model, optimizer):
    """RevGNN: the first epoch's K cluster parts (each a whole induced subgraph), as
    :func:`_sampled_pieces`."""
    from betty.rev.engine import supports_estimate, train_step_parts
    from betty.rev.memory import estimate_rev_parts

    if not supports_estimate(model):
        raise ValueError("the memory model does not cover this reversible variant "
                         "(model.deq: true has no estimator)")
    parts, _, _ = trainer.split(0)
    estimates = estimate_rev_parts(parts, model, train_mask=trainer.train_mask,
                                   optimizer=optimizer, **trainer.memory_kwargs)

    def measure(meter) -> list[int | None]:
        common = dict(multilabel=ds.multilabel, device=device, dtype=trainer.dtype,
                      mask_factory=trainer.mask_factory(0))
        train_step_parts(model, optimizer, parts, ds.feat, ds.label, trainer.train_mask, **common)
        step = train_step_parts(model, optimizer, parts, ds.feat, ds.label, trainer.train_mask,
                                meter=meter, **common)
        return [r.peak_bytes for r in step.parts]

    figures = {"method": trainer.plan.method, "k": len(parts),
               "num_nodes_per_part": [int(p.node_ids.numel()) for p in parts]}
    return figures, estimates, measure


def _report(rspec, ds, device, trainer, model, optimizer, measure: bool) -> dict:
    """Every piece's estimated peak by component and, with ``measure``, its measured
    peak and relative error (pieces that did not run: ``None``)."""
    from betty.memory import MemoryMeter

    from workflow.components import uses_revgnn

    pieces = _reversible_pieces if uses_revgnn(rspec) else _sampled_pieces
    figures, estimates, measured = pieces(rspec, ds, device, trainer, model, optimizer)
    rows = [{"index": i, "estimated_peak_bytes": int(e.peak),
             "components": {c: int(b) for c, b in e.breakdown.items()}} for i, e in enumerate(estimates)]
    out = {"method": figures.pop("method"), "k": figures.pop("k"), "backend": trainer.memory_kwargs["backend"],
           **figures, "memory_budget_bytes": trainer.plan.memory_budget,
           "safety_margin": trainer.plan.safety_margin,
           "max_estimated_peak_bytes": max(row["estimated_peak_bytes"] for row in rows), "micro_batches": rows}
    if measure:
        meter = MemoryMeter(device)
        meter.track(model, optimizer)
        peaks = measured(meter)
        for row, peak in zip(rows, peaks):
            row["measured_peak_bytes"] = peak
            row["relative_error"] = None if not peak else (row["estimated_peak_bytes"] - peak) / peak
        errors = [abs(r["relative_error"]) for r in rows if r["relative_error"] is not None]
        out["max_measured_peak_bytes"] = max((p for p in peaks if p), default=None)
        out["max_abs_relative_error"] = max(errors, default=None)
    return out


@cli_errors
def estimate(spec: SpecArg,
             k: Annotated[Optional[str], typer.Option("--k", help="Micro-batches, an integer or 'auto' (default: the spec's).")] = None,
             measure: Annotated[bool, typer.Option("--measure", help="Also run forward+backward of every micro-batch once and report the measured peak and the relative error.")] = False,
             set_: SetOpt = None, json_: JsonOpt = False,
             pieces: Annotated[bool, typer.Option("--pieces", help="Also print one line per micro-batch (revgnn: per part).")] = False) -> None:
    """Estimate the peak memory of every micro-batch of the spec's first sampled batch
    (revgnn: of every cluster part), per component, before running anything (k: auto
    searches K for the spec's memory_budget). With --measure, train one step to reach the
    optimizer's steady state, then measure every micro-batch once with the memory meter.
    Prints a summary (budget, the Ks tried, the chosen K, the largest piece); --pieces adds
    one line per piece, --json gives everything."""
    from workflow.components import load_data, make_trainer, resolve_device

    overrides = list(set_ or [])
    k_value = _parse_k(k)
    if k_value is not None:
        overrides.append(f"partition.k={k_value}")
    rspec = load(spec, overrides)
    ds = load_data(rspec)
    device = resolve_device(rspec.spec.train.device)
    searches = []
    trainer, model, optimizer = make_trainer(rspec, ds, device, on_search=searches.append)
    out = {"spec": rspec.name, **_report(rspec, ds, device, trainer, model, optimizer, measure)}
    if searches:
        out["k_tried"] = searches[-1].to_dict()["tried"]
    if json_:
        emit_json(out)
        return
    for line in summary_lines(out):
        typer.echo(line)
    if pieces:
        for line in piece_lines(out):
            typer.echo(line)


def _mib(n: int | float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _tried_pairs(tried) -> list[tuple[int, int]]:
    """``(K, max estimated peak)`` from a K search record (a list of rows or a dict)."""
    if isinstance(tried, dict):
        return [(int(k), int(v)) for k, v in tried.items()]
    return [(int(r["k"]), int(r["max_estimated_peak_bytes"])) for r in tried or []]


def summary_lines(out: dict) -> list[str]:
    """What ``betty estimate`` prints without ``--pieces``: method and K, the budget and
    how the K search went, the largest piece (measured too with ``--measure``) and its
    components."""
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
    rows = out["micro_batches"]
    worst = max(rows, key=lambda r: r["estimated_peak_bytes"])
    line = f"  largest piece: {worst['index']} of {len(rows)}, estimated {_mib(worst['estimated_peak_bytes'])}"
    if worst.get("measured_peak_bytes"):
        line += f", measured {_mib(worst['measured_peak_bytes'])} ({100 * worst['relative_error']:+.2f}%)"
    if out.get("max_abs_relative_error") is not None:
        line += f"; worst error over pieces {100 * out['max_abs_relative_error']:.2f}%"
    lines.append(line)
    parts = ", ".join(f"{c} {b / 2**20:.1f}" for c, b in
                      sorted(worst["components"].items(), key=lambda kv: -kv[1]) if b)
    lines.append(f"  largest piece by component (MiB): {parts}")
    if len(rows) > 1:
        lines.append(f"  (--pieces lists all {len(rows)} pieces)")
    return lines


def piece_lines(out: dict) -> list[str]:
    """One line per piece: estimated peak (and measured peak and error with ``--measure``)."""
    lines = []
    for row in out["micro_batches"]:
        line = f"  piece {row['index']:<3} estimated {row['estimated_peak_bytes'] / 2**20:10.2f} MiB"
        if row.get("measured_peak_bytes"):
            line += (f"  measured {row['measured_peak_bytes'] / 2**20:10.2f} MiB"
                     f"  error {100 * row['relative_error']:+.2f}%")
        lines.append(line)
    return lines


def register(app: typer.Typer) -> None:
    app.command("estimate")(estimate)
