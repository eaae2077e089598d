"""Stage ``sample``: the first epoch's full batch, as the trainer will sample it
(``revgnn`` samples nothing and logs the graph every step covers).

Metrics and ``batch.npz``: docs/workflow.md, *Stages* (``revgnn``: *Reversible deep GNNs*).
"""

from __future__ import annotations

import time

import mlflow

from betty.batchfile import save_batch
from workflow.checksums import log_artifact
from workflow.components import first_batch, uses_revgnn
from workflow.runs import log_metrics
from workflow.stages.base import StageContext

__all__ = ["run", "block_sizes"]


def block_sizes(batch) -> dict[str, int]:
    """``block{l}_num_src/_num_dst/_num_edges`` for every layer."""
    out = {}
    for l, layer in enumerate(batch.layers):
        out[f"block{l}_num_src"] = layer.num_src
        out[f"block{l}_num_dst"] = layer.num_dst
        out[f"block{l}_num_edges"] = layer.num_edges
    return out


def _nothing_to_sample(ctx: StageContext) -> dict[str, float]:
    """The ``sample`` stage for ``revgnn``: training and total node counts, a tag and notes."""
    from workflow.spec import spec_notes

    ds = ctx.dataset()
    mlflow.set_tag("sampling", "none (revgnn)")
    notes = spec_notes(ctx.rspec.spec)
    if notes:
        mlflow.set_tag("spec_notes", "; ".join(notes)[:500])
    metrics = {"num_outputs": int(ds.train_idx.numel()), "num_inputs": ds.num_nodes}
    log_metrics(metrics)
    ctx.reporter.note("revgnn samples nothing: every step runs on the whole graph or on "
                      "partition.k cluster parts (see the partition stage)")
    for note in notes:
        ctx.reporter.note(note)
    return metrics


def run(ctx: StageContext) -> dict[str, float]:
    if uses_revgnn(ctx.rspec):
        return _nothing_to_sample(ctx)
    ds = ctx.dataset()
    start = time.perf_counter()
    batch = first_batch(ctx.rspec, ds)
    took = time.perf_counter() - start
    metrics = {"time_sample_s": took, "num_outputs": batch.num_outputs,
               "num_inputs": batch.layers[0].num_src, **block_sizes(batch)}
    log_metrics(metrics)
    log_artifact(save_batch(ctx.workdir / "batch.npz", batch))
    ctx.reporter.note(f"batch: {batch.num_outputs:,} outputs, {batch.layers[0].num_src:,} inputs, "
                      f"{sum(l.num_edges for l in batch.layers):,} edges")
    return {"num_outputs": batch.num_outputs, "num_inputs": batch.layers[0].num_src}
