"""What the stages do for ``model.arch: revgnn`` (reversible deep GNNs).

RevGNN trains on the whole graph (K = 1) or on K induced subgraphs per step
(:class:`betty.rev.engine.RevTrainer`), never on sampled blocks, so:

* ``sample`` samples nothing: it logs the "batch" every step covers (``num_outputs`` =
  training nodes, ``num_inputs`` = every node), the tag ``sampling = none (revgnn)`` and
  a note; ignored ``sampling.fanouts`` are noted and tagged (``spec_notes``);
* ``partition`` splits the graph exactly as the first epoch will (``RevTrainer.split(0)``:
  method, K or K search, seed) and logs the split: ``k``, ``imbalance`` (max / mean
  nodes per part), ``edges_kept_fraction`` and ``edges_dropped_fraction`` (edges inside
  parts / between parts, over all edges), ``time_partition_s``, ``time_estimate_s``,
  ``time_ksearch_s`` (auto), ``peak_mem_estimated_bytes`` (largest part); per part ``i``
  (metric step ``i``): ``part_nodes``, ``part_edges``, ``part_train``,
  ``part_estimated_bytes``; artifacts ``parts.csv``, ``partition.npz`` (``part`` of every
  node), ``ksearch.json`` (auto). Its sweep splits the graph with each method of
  ``partition.sweep.methods`` (default ``random``, ``metis``) at each K of
  ``partition.sweep.k`` and logs ``partition_sweep.csv``/``.json``,
  ``plots/cluster_sweep.png`` and the metrics ``sweep_edges_kept.<method>`` and
  ``sweep_peak_estimated_bytes.<method>`` (step K);
* ``train`` and ``evaluate`` use the generic stage code with the reversible trainer and
  :func:`workflow.evaluation.rev_predictions`; the per-part memory table is
  ``memory_per_part.csv`` (:meth:`betty.rev.engine.RevEpochRecord.rows`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import mlflow
import numpy as np

from workflow.artifacts import ksearch_records, write_csv, write_json
from workflow.checksums import log_artifact
from workflow.components import make_trainer
from workflow.runs import log_metrics
from workflow.stages.base import StageContext, log_sweep_artifacts, sweep_grid

__all__ = ["SWEEP_COLUMNS", "sample_stage", "measure_cluster_split", "cluster_sweep",
           "partition_stage"]

SWEEP_COLUMNS = ("method", "k", "num_parts", "edges_kept_fraction", "max_part_nodes", "max_part_edges",
                 "imbalance", "peak_estimated_bytes", "time_partition_s", "error")
DEFAULT_SWEEP_METHODS = ("random", "metis")


def sample_stage(ctx: StageContext) -> dict[str, float]:
    """The ``sample`` stage for ``revgnn``: nothing is sampled (see the module docstring)."""
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


def _split_report(parts, estimates, num_edges: int) -> dict:
    from betty.rev.engine import edges_kept_fraction

    nodes = [int(p.graph.num_nodes()) for p in parts]
    kept = edges_kept_fraction(parts, num_edges)
    return {"num_parts": len(parts), "part_nodes": nodes,
            "part_edges": [int(p.graph.num_edges()) for p in parts],
            "edges_kept_fraction": kept, "edges_dropped_fraction": 1.0 - kept,
            "imbalance": max(nodes) / (sum(nodes) / len(nodes)),
            "estimated_bytes": list(estimates) if estimates else None}


def measure_cluster_split(trainer) -> tuple[dict, list]:
    """Split the graph as the trainer's first epoch does, with timings.

    Returns:
        ``(report, parts)`` with ``report`` = ``{"method", "k", "num_parts",
        "part_nodes", "part_edges", "part_train", "edges_kept_fraction",
        "edges_dropped_fraction", "imbalance", "estimated_bytes" (per part or None),
        "time_partition_s", "time_estimate_s", "time_ksearch_s" (None without a K
        search)}``.
    """
    parts, estimates, _ = trainer.split(0)
    times = trainer.last_split_times
    mask = trainer.train_mask
    report = {"method": trainer.plan.method, "k": len(parts),
              **_split_report(parts, estimates, trainer.dataset.num_edges),
              "part_train": [int(mask[p.node_ids].sum()) for p in parts],
              "time_partition_s": times["partition_s"], "time_estimate_s": times["estimate_s"],
              "time_ksearch_s": times["ksearch_s"]}
    return report, parts


def cluster_sweep(trainer, ks, methods, *, seed: int, time_limit_s: float | None = None,
                  max_k: Mapping[str, int] | None = None, reporter=None) -> tuple[list[dict], dict[str, str]]:
    """Every method at every K (``<= num_nodes``, ``<= max_k[method]``): edges kept, part
    sizes and (when the trainer estimates memory) the largest part's estimated peak.

    Returns:
        ``(rows, skipped)``: one row per (method, K) tried (``error`` set when it
        failed) and ``{method: reason}`` naming the Ks not tried and why.
    """
    from betty.rev.training import backend_graph, cluster_partition

    graph = backend_graph(trainer.model, trainer.dataset.graph)  # parts: subgraphs of the model's backend
    ks = sorted({int(k) for k in ks if int(k) <= graph.num_nodes()})

    def measure(method: str, k: int) -> dict:
        start = time.perf_counter()
        parts = cluster_partition(graph, k, method, seed)
        took = time.perf_counter() - start
        report = _split_report(parts, trainer.estimate(parts), graph.num_edges())
        est = report["estimated_bytes"]
        return {"num_parts": report["num_parts"],
                "edges_kept_fraction": report["edges_kept_fraction"],
                "max_part_nodes": max(report["part_nodes"]),
                "max_part_edges": max(report["part_edges"]),
                "imbalance": report["imbalance"],
                "peak_estimated_bytes": max(est) if est else None, "time_partition_s": took}

    return sweep_grid(methods, ks, measure, time_limit_s=time_limit_s, max_k=max_k,
                      reporter=reporter)


def partition_stage(ctx: StageContext) -> dict[str, float]:
    """The ``partition`` stage for ``revgnn`` (see the module docstring)."""
    spec = ctx.rspec.spec
    p = spec.partition
    ds = ctx.dataset()
    searches: list = []
    trainer, _, _ = make_trainer(ctx.rspec, ds, ctx.device, on_search=searches.append)
    report, parts = measure_cluster_split(trainer)
    estimates = report["estimated_bytes"]
    log_metrics({key: report[key] for key in ("k", "imbalance", "edges_kept_fraction", "edges_dropped_fraction",
                                               "time_partition_s", "time_estimate_s", "time_ksearch_s")})
    log_metrics({"peak_mem_estimated_bytes": max(estimates) if estimates else None})
    rows = []
    for i in range(len(parts)):
        row = {"part": i, "num_nodes": report["part_nodes"][i], "num_edges": report["part_edges"][i],
               "num_train": report["part_train"][i], "estimated_bytes": estimates[i] if estimates else None}
        rows.append(row)
        log_metrics({"part_nodes": row["num_nodes"], "part_edges": row["num_edges"],
                     "part_train": row["num_train"], "part_estimated_bytes": row["estimated_bytes"]}, step=i)
    log_artifact(write_csv(ctx.workdir / "parts.csv", rows))
    labels = np.empty(ds.num_nodes, dtype=np.int64)
    for i, part in enumerate(parts):
        labels[part.node_ids.cpu().numpy()] = i
    path = ctx.workdir / "partition.npz"
    np.savez_compressed(path, part=labels)
    log_artifact(path)
    if searches:
        log_artifact(write_json(ctx.workdir / "ksearch.json", ksearch_records(searches)))
    regime = "full graph" if len(parts) == 1 else f"{report['method']} clusters"
    ctx.reporter.note(f"{regime} K={len(parts)}: {min(report['part_nodes']):,}-{max(report['part_nodes']):,} "
                      f"nodes per part, {report['edges_kept_fraction']:.1%} of the edges kept")
    if p.sweep.k:
        methods = p.sweep.methods or list(DEFAULT_SWEEP_METHODS)
        table, skipped = cluster_sweep(trainer, p.sweep.k, methods, seed=spec.sampling.seed,
                                       time_limit_s=p.sweep.time_limit_s, max_k=p.sweep.max_k,
                                       reporter=ctx.reporter)
        for row in table:
            if row.get("edges_kept_fraction") is not None:
                log_metrics({f"sweep_edges_kept.{row['method']}": row["edges_kept_fraction"],
                             f"sweep_peak_estimated_bytes.{row['method']}": row.get("peak_estimated_bytes")},
                            step=row["k"])
        log_sweep_artifacts(ctx, table, skipped, SWEEP_COLUMNS)
        if any(r.get("edges_kept_fraction") is not None for r in table):
            import matplotlib.pyplot as plt

            from workflow.plots import cluster_sweep_figure

            fig = cluster_sweep_figure(table, title=f"{ctx.rspec.name}: cluster splits vs K")
            mlflow.log_figure(fig, "plots/cluster_sweep.png")
            plt.close(fig)
    return {"k": len(parts), "edges_kept_fraction": report["edges_kept_fraction"],
            "imbalance": report["imbalance"]}
