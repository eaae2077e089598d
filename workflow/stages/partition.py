"""Stage ``partition``: split the sampled batch and compare partitioners.

The batch comes from the ``sample`` run's ``batch.npz`` (sampled afresh from the spec
when the stage runs alone). It is split by ``betty.engine.Trainer.partition`` exactly as
the first epoch will be (same method, K or K search, balance, seed), and measured:

* metrics ``k``, ``redundancy`` (layer-0 input loads / distinct inputs),
  ``redundancy_layer{l}``, ``imbalance`` (max / mean inputs per piece),
  ``time_build_s``, ``time_partition_s``, ``time_block_s`` (carving the micro-batch
  blocks with ``betty.microbatch.split``), ``peak_mem_estimated_bytes`` (the memory
  model's largest piece) and, for ``k: auto``, ``time_ksearch_s``; per micro-batch ``i``
  (as the metric step): ``micro_outputs``, ``micro_inputs``, ``micro_edges``,
  ``micro_estimated_bytes``;
* artifacts ``partition.npz`` (``outputs``, ``groups``), ``microbatches.csv`` and, for
  ``k: auto``, ``ksearch.json`` (every K tried with its largest estimated piece).

The sweep then splits the same batch with every method at every K of
``partition.sweep.k`` that is at most the number of outputs, and logs
``partition_sweep.csv`` / ``.json`` (method, k, redundancy, imbalance, times, error),
``plots/redundancy_vs_k.png`` and the metric ``sweep_redundancy.<method>`` with step K.
A method that raises (e.g. METIS on a graph it cannot cut) is skipped for the remaining
Ks with the reason in the table, a note and the ``sweep_skipped`` tag.

``revgnn`` splits the whole graph into K induced subgraphs instead
(:func:`workflow.revgnn.partition_stage`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import mlflow
import numpy as np

from workflow.artifacts import ksearch_records, load_batch, write_csv, write_json
from workflow.checksums import log_artifact
from workflow.components import make_trainer, partition_options, uses_revgnn
from workflow.plots import redundancy_figure
from workflow.runs import log_metrics
from workflow.stages.base import StageContext, log_sweep_artifacts, sweep_grid

__all__ = ["run", "measure_split", "sweep"]

SWEEP_COLUMNS = ("method", "k", "redundancy", "imbalance", "time_build_s", "time_partition_s",
                 "max_inputs_per_piece", "error")


def measure_split(trainer, batch) -> tuple[dict, object, list]:
    """Split ``batch`` as the trainer's first epoch does and carve its micro-batches,
    timing each step.

    Returns:
        ``(report, partition_result, micro_batches)`` with ``report`` =
        ``{"method", "k", "redundancy", "redundancy_per_layer", "imbalance",
        "time_build_s", "time_partition_s", "time_block_s", "time_ksearch_s" (k: auto,
        else None), "outputs_per_piece", "input_nodes_per_piece", "estimated_bytes"
        (per piece, None without an estimator)}``.
    """
    from betty.microbatch import split
    from betty.partition import split_metrics

    start = time.perf_counter()
    result, estimates, _ = trainer.partition(batch, 0, 0)
    took = time.perf_counter() - start
    if estimates is None and trainer.estimator is not None:
        estimates = trainer.estimator(batch, result.groups, result.k)
    start = time.perf_counter()
    micro = split(batch, result.groups, result.k)
    time_blocks = time.perf_counter() - start
    stats = split_metrics(batch, result.groups, result.k)
    report = {
        "method": result.method, "k": result.k,
        "redundancy": stats["redundancy"], "redundancy_per_layer": stats["redundancy_per_layer"],
        "imbalance": stats["imbalance"],
        "time_build_s": result.time_build_s, "time_partition_s": result.time_partition_s,
        "time_block_s": time_blocks,
        "time_ksearch_s": took if trainer.plan.k == "auto" else None,
        "outputs_per_piece": stats["outputs_per_piece"],
        "input_nodes_per_piece": stats["input_nodes_per_piece"],
        "estimated_bytes": list(estimates) if estimates else None,
    }
    return report, result, micro


def sweep(batch, ks, methods, *, seed: int, graph=None, time_limit_s: float | None = None,
          max_k: Mapping[str, int] | None = None, reporter=None,
          options: dict | None = None) -> tuple[list[dict], dict[str, str]]:
    """Every method at every K (``<= batch.num_outputs``, ``<= max_k[method]``);
    ``options`` go to ``partition_batch`` (``partition.time_limit_s`` etc.).

    Returns:
        ``(rows, skipped)``: one row per (method, K) tried (with ``error`` set when it
        failed) and ``{method: reason}`` naming the Ks not tried and why.
    """
    from betty.partition import partition_batch, split_metrics

    ks = sorted({int(k) for k in ks if int(k) <= batch.num_outputs})

    def measure(method: str, k: int) -> dict:
        result = partition_batch(batch, k, method, seed=seed, graph=graph, options=options)
        stats = split_metrics(batch, result.groups, k)
        return {"redundancy": stats["redundancy"], "imbalance": stats["imbalance"],
                "time_build_s": result.time_build_s, "time_partition_s": result.time_partition_s,
                "max_inputs_per_piece": max(stats["input_nodes_per_piece"])}

    return sweep_grid(methods, ks, measure, time_limit_s=time_limit_s, max_k=max_k,
                      reporter=reporter)


def run(ctx: StageContext) -> dict[str, float]:
    if uses_revgnn(ctx.rspec):
        from workflow.revgnn import partition_stage

        return partition_stage(ctx)
    from betty.partition import PARTITIONERS

    spec = ctx.rspec.spec
    p = spec.partition
    ds = ctx.dataset()
    searches: list = []
    trainer, _, _ = make_trainer(ctx.rspec, ds, ctx.device, on_search=searches.append)
    path = ctx.upstream_file("sample", "batch.npz")
    batch = load_batch(path)[0] if path is not None else trainer.sample(0, 0)

    report, result, micro = measure_split(trainer, batch)  # exactly the first epoch's split
    estimates = report["estimated_bytes"]
    log_metrics({key: report[key] for key in ("k", "redundancy", "imbalance", "time_build_s",
                                               "time_partition_s", "time_block_s", "time_ksearch_s")})
    log_metrics({"peak_mem_estimated_bytes": max(estimates) if estimates else None})
    log_metrics({f"redundancy_layer{l}": r for l, r in enumerate(report["redundancy_per_layer"])})
    rows = []
    for i, mb in enumerate(micro):
        row = {"micro": i, "num_outputs": mb.num_outputs, "num_inputs": mb.layers[0].num_src,
               "num_edges": sum(layer.num_edges for layer in mb.layers),
               "estimated_bytes": estimates[i] if estimates else None}
        rows.append(row)
        log_metrics({"micro_outputs": row["num_outputs"], "micro_inputs": row["num_inputs"],
                     "micro_edges": row["num_edges"], "micro_estimated_bytes": row["estimated_bytes"]}, step=i)
    log_artifact(write_csv(ctx.workdir / "microbatches.csv", rows))
    path = ctx.workdir / "partition.npz"
    np.savez_compressed(path, outputs=batch.output_nid.numpy(), groups=result.groups.numpy())
    log_artifact(path)
    if searches:
        log_artifact(write_json(ctx.workdir / "ksearch.json", ksearch_records(searches)))
    ctx.reporter.note(f"{result.method} K={result.k}: redundancy {report['redundancy']:.3f}, "
                      f"imbalance {report['imbalance']:.3f}")

    if p.sweep.k:
        methods = p.sweep.methods or sorted(PARTITIONERS)
        table, skipped = sweep(batch, p.sweep.k, methods, seed=spec.sampling.seed, graph=ds.graph,
                               time_limit_s=p.sweep.time_limit_s, max_k=p.sweep.max_k, reporter=ctx.reporter,
                               options=partition_options(ctx.rspec))
        for row in table:
            if row.get("redundancy") is not None:
                log_metrics({f"sweep_redundancy.{row['method']}": row["redundancy"]}, step=row["k"])
        log_sweep_artifacts(ctx, table, skipped, SWEEP_COLUMNS)
        if any(r.get("redundancy") is not None for r in table):
            import matplotlib.pyplot as plt

            fig = redundancy_figure(table, title=f"{ctx.rspec.name}: redundancy vs K")
            mlflow.log_figure(fig, "plots/redundancy_vs_k.png")
            plt.close(fig)
    return {"k": result.k, "redundancy": report["redundancy"], "imbalance": report["imbalance"]}
