"""``betty estimate SPEC [--k K] [--measure]``: the memory model's view of a batch."""

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


@cli_errors
def estimate(spec: SpecArg,
             k: Annotated[Optional[str], typer.Option("--k", help="Micro-batches, an integer or 'auto' (default: the spec's).")] = None,
             measure: Annotated[bool, typer.Option("--measure", help="Also run forward+backward of every micro-batch once and report the measured peak and the relative error.")] = False,
             set_: SetOpt = None, json_: JsonOpt = False) -> None:
    """Estimate the peak memory of every micro-batch of the spec's first sampled batch,
    per component, before running anything (k: auto searches K for the spec's
    memory_budget). With --measure, train one step to reach the optimizer's steady state,
    then measure every micro-batch once with the memory meter."""
    from betty.memory import MemoryMeter, default_backend, estimate_pieces
    from betty.models.dropout import dropout_key
    from betty.train import accumulate_gradients, train_step

    from workflow.components import load_data, make_trainer, resolve_device, torch_dtype

    overrides = list(set_ or [])
    k_value = _parse_k(k)
    if k_value is not None:
        overrides.append(f"partition.k={k_value}")
    rspec = load(spec, overrides)
    ds = load_data(rspec)
    device = resolve_device(rspec.spec.train.device)
    searches = []
    trainer, model, optimizer = make_trainer(rspec, ds, device, on_search=searches.append)
    batch = trainer.sample(0, 0)
    result, _, _ = trainer.partition(batch, 0, 0)
    dtype = torch_dtype(rspec)
    backend = default_backend(device)
    estimates = estimate_pieces(batch, result.groups, result.k, model, optimizer, dtype, backend,
                                feat_dtype=ds.feat.dtype,
                                label_columns=ds.num_classes if ds.multilabel else 0)
    plan = trainer.plan
    out = {
        "spec": rspec.name, "method": result.method, "k": result.k, "backend": backend,
        "num_outputs": batch.num_outputs,
        "memory_budget_bytes": plan.memory_budget, "safety_margin": plan.safety_margin,
        "max_estimated_peak_bytes": max(int(e.peak) for e in estimates),
        "micro_batches": [{"index": i, "estimated_peak_bytes": int(e.peak),
                           "components": {c: int(b) for c, b in e.breakdown.items()}}
                          for i, e in enumerate(estimates)],
    }
    if searches:
        out["k_tried"] = searches[-1].to_dict().get("tried")
    if measure:
        meter = MemoryMeter(device)
        meter.track(model, optimizer)
        key = dropout_key(rspec.spec.train.seed, 0)
        common = dict(k=result.k, device=device, dropout_key=key, multilabel=ds.multilabel, dtype=dtype)
        train_step(model, optimizer, batch, result.groups, ds.feat, ds.label, **common)  # Adam state
        optimizer.zero_grad(set_to_none=True)
        step = accumulate_gradients(model, batch, result.groups, ds.feat, ds.label, meter=meter, **common)
        for row, record in zip(out["micro_batches"], step.micro):
            row["measured_peak_bytes"] = int(record.peak_bytes)
            row["relative_error"] = (row["estimated_peak_bytes"] - record.peak_bytes) / record.peak_bytes
        out["max_measured_peak_bytes"] = max(int(r.peak_bytes) for r in step.micro)
        out["max_abs_relative_error"] = max(abs(r["relative_error"]) for r in out["micro_batches"])
        model.zero_grad(set_to_none=True)
    if json_:
        emit_json(out)
        return
    typer.echo(f"{out['spec']}: {out['method']} K={out['k']} ({backend} constants), "
               f"{out['num_outputs']} outputs")
    for row in out["micro_batches"]:
        line = f"  piece {row['index']:<3} estimated {row['estimated_peak_bytes'] / 2**20:10.2f} MiB"
        if measure:
            line += (f"  measured {row['measured_peak_bytes'] / 2**20:10.2f} MiB"
                     f"  error {100 * row['relative_error']:+.2f}%")
        typer.echo(line)
    worst = max(out["micro_batches"], key=lambda r: r["estimated_peak_bytes"])
    parts = ", ".join(f"{c} {b / 2**20:.1f}" for c, b in
                      sorted(worst["components"].items(), key=lambda kv: -kv[1]) if b)
    typer.echo(f"  largest piece by component (MiB): {parts}")


def register(app: typer.Typer) -> None:
    app.command("estimate")(estimate)
