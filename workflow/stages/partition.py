"""Stage ``partition``: split the first epoch's work exactly as training will
(:func:`batch_split` for sampled batches, :func:`cluster_split` for ``revgnn``) and
compare partitioners over ``partition.sweep``.

Metrics and artifacts: docs/workflow.md, *Stages* (``revgnn``: *Reversible deep GNNs*).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import mlflow
import numpy as np

from betty.batchfile import load_batch
from betty.catalog import CLUSTER_METHODS
from workflow.artifacts import write_csv, write_json
from workflow.checksums import log_artifact
from workflow.components import make_trainer, uses_revgnn
from workflow.plots import sweep_figure
from workflow.runs import log_metrics
from workflow.stages.base import StageContext, sweep_grid

__all__ = ["Split", "batch_split", "cluster_split", "sweep", "cluster_sweep", "run"]


@dataclass
class Split:
    """The first epoch's split, measured: what ``betty partition`` prints and this
    stage logs.

    Attributes:
        report: the figures by name (``method``, ``k``, ``imbalance``, the timers,
            ``peak_mem_estimated_bytes`` when estimated, and the engine's own); its
            numbers are the stage's metrics, a ``<name>_per_layer`` list is logged as
            ``<name>_layer<l>``.
        rows: one per piece, its index (``piece``) first, then its sizes (``num_*``) and
            ``estimated_bytes``; logged per piece as ``<piece>_<size>`` (step = index).
        piece: ``micro`` (a micro-batch) or ``part`` (a RevGNN cluster part).
        table: the rows' CSV name (``microbatches``, ``parts``).
        arrays: the split itself (``partition.npz``).
        note: the summary line.
    """

    report: dict
    rows: list[dict]
    piece: str
    table: str
    arrays: dict[str, np.ndarray]
    note: str

    def metrics(self) -> dict[str, float]:
        out = {}
        for key, value in self.report.items():
            if key.endswith("_per_layer"):
                out.update({f"{key.removesuffix('_per_layer')}_layer{l}": v for l, v in enumerate(value)})
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = value
        return out


def batch_split(trainer, batch) -> Split:
    """Split ``batch`` as the trainer's first epoch does and carve its micro-batches,
    timing each step (``report``: ``method``, ``k``, ``redundancy``,
    ``redundancy_per_layer``, ``imbalance``, ``time_build_s``, ``time_partition_s``,
    ``time_block_s``; ``fallback_from``/``fallback_reason`` when a time-limited
    partitioner fell back, ``time_ksearch_s`` with ``k: auto``)."""
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
    report = {"method": result.method, "k": result.k, "redundancy": stats["redundancy"],
              "redundancy_per_layer": stats["redundancy_per_layer"], "imbalance": stats["imbalance"],
              "time_build_s": result.time_build_s, "time_partition_s": result.time_partition_s,
              "time_block_s": time_blocks}
    if result.info.get("fallback_from"):  # e.g. hypergraph hit partition.time_limit_s
        report.update(fallback_from=result.info["fallback_from"], fallback_reason=result.info["fallback_reason"])
    if trainer.plan.k == "auto":
        report["time_ksearch_s"] = took
    if estimates:
        report["peak_mem_estimated_bytes"] = max(estimates)
    rows = [{"micro": i, "num_outputs": mb.num_outputs, "num_inputs": mb.layers[0].num_src,
             "num_edges": sum(layer.num_edges for layer in mb.layers),
             "estimated_bytes": estimates[i] if estimates else None} for i, mb in enumerate(micro)]
    return Split(report, rows, "micro", "microbatches",
                 {"outputs": batch.output_nid.numpy(), "groups": result.groups.numpy()},
                 f"{result.method} K={result.k}: redundancy {stats['redundancy']:.3f}, "
                 f"imbalance {stats['imbalance']:.3f}")


def _cluster_figures(parts, estimates, num_edges: int) -> dict:
    """Part sizes, the share of edges the parts keep, imbalance, estimated peaks."""
    from betty.rev.engine import edges_kept_fraction

    nodes = [int(p.graph.num_nodes()) for p in parts]
    kept = edges_kept_fraction(parts, num_edges)
    return {"part_nodes": nodes, "part_edges": [int(p.graph.num_edges()) for p in parts],
            "edges_kept_fraction": kept, "edges_dropped_fraction": 1.0 - kept,
            "imbalance": max(nodes) / (sum(nodes) / len(nodes)), "estimated_bytes": estimates}


def cluster_split(trainer) -> Split:
    """Split the graph as the RevGNN trainer's first epoch does, with timings
    (``report``: ``method``, ``k``, ``part_nodes``, ``part_edges``, ``part_train``,
    ``edges_kept_fraction``, ``edges_dropped_fraction``, ``imbalance``,
    ``time_partition_s``, ``time_estimate_s``; ``time_ksearch_s`` with ``k: auto``)."""
    parts, estimates, _ = trainer.split(0)
    times = trainer.last_split_times
    figures = _cluster_figures(parts, estimates, trainer.dataset.num_edges)
    train = [int(trainer.train_mask[p.node_ids].sum()) for p in parts]
    report = {"method": trainer.plan.method, "k": len(parts), "part_nodes": figures["part_nodes"],
              "part_edges": figures["part_edges"], "part_train": train,
              **{key: figures[key] for key in ("edges_kept_fraction", "edges_dropped_fraction", "imbalance")},
              "time_partition_s": times["partition_s"], "time_estimate_s": times["estimate_s"]}
    if times["ksearch_s"] is not None:
        report["time_ksearch_s"] = times["ksearch_s"]
    if estimates:
        report["peak_mem_estimated_bytes"] = max(estimates)
    rows = [{"part": i, "num_nodes": n, "num_edges": e, "num_train": t,
             "estimated_bytes": estimates[i] if estimates else None}
            for i, (n, e, t) in enumerate(zip(figures["part_nodes"], figures["part_edges"], train))]
    labels = np.empty(trainer.dataset.num_nodes, dtype=np.int64)
    for i, part in enumerate(parts):
        labels[part.node_ids.cpu().numpy()] = i
    regime = "full graph" if len(parts) == 1 else f"{trainer.plan.method} clusters"
    return Split(report, rows, "part", "parts", {"part": labels},
                 f"{regime} K={len(parts)}: {min(figures['part_nodes']):,}-{max(figures['part_nodes']):,} "
                 f"nodes per part, {figures['edges_kept_fraction']:.1%} of the edges kept")


def sweep(batch, ks, methods, *, seed: int, graph=None, time_limit_s: float | None = None,
          max_k: Mapping[str, int] | None = None, reporter=None,
          options: dict | None = None) -> tuple[list[dict], dict[str, str]]:
    """Every method at every K (``<= batch.num_outputs``, ``<= max_k[method]``) on a
    sampled batch; ``options`` go to ``partition_batch`` (``partition.time_limit_s`` etc.).

    Returns:
        ``(rows, skipped)``: one row per (method, K) tried (with ``error`` set when it
        failed) and ``{method: reason}`` naming the Ks not tried and why.
    """
    from betty.partition import partition_batch, split_metrics

    def measure(method: str, k: int) -> dict:
        result = partition_batch(batch, k, method, seed=seed, graph=graph, options=options)
        stats = split_metrics(batch, result.groups, k)
        return {"redundancy": stats["redundancy"], "imbalance": stats["imbalance"],
                "time_build_s": result.time_build_s, "time_partition_s": result.time_partition_s,
                "max_inputs_per_piece": max(stats["input_nodes_per_piece"])}

    ks = sorted({int(k) for k in ks if int(k) <= batch.num_outputs})
    return sweep_grid(methods, ks, measure, time_limit_s=time_limit_s, max_k=max_k, reporter=reporter)


def cluster_sweep(trainer, ks, methods, *, seed: int, time_limit_s: float | None = None,
                  max_k: Mapping[str, int] | None = None, reporter=None) -> tuple[list[dict], dict[str, str]]:
    """Every method at every K (``<= num_nodes``, ``<= max_k[method]``) on the RevGNN
    trainer's graph: edges kept, part sizes and (when the trainer estimates memory) the
    largest part's estimated peak; returns ``(rows, skipped)`` as :func:`sweep`."""
    from betty.rev.training import backend_graph, cluster_partition

    graph = backend_graph(trainer.model, trainer.dataset.graph)  # parts: subgraphs of the model's backend

    def measure(method: str, k: int) -> dict:
        start = time.perf_counter()
        parts = cluster_partition(graph, k, method, seed)
        took = time.perf_counter() - start
        figures = _cluster_figures(parts, trainer.estimate(parts), graph.num_edges())
        return {"num_parts": len(parts), "edges_kept_fraction": figures["edges_kept_fraction"],
                "max_part_nodes": max(figures["part_nodes"]), "max_part_edges": max(figures["part_edges"]),
                "imbalance": figures["imbalance"], "time_partition_s": took,
                "peak_estimated_bytes": max(figures["estimated_bytes"]) if figures["estimated_bytes"] else None}

    ks = sorted({int(k) for k in ks if int(k) <= graph.num_nodes()})
    return sweep_grid(methods, ks, measure, time_limit_s=time_limit_s, max_k=max_k, reporter=reporter)


@dataclass(frozen=True)
class _SweepLog:
    """How one engine's sweep is logged: its table's columns, the per-method metrics
    (``{row key: metric prefix}``, step K), the figure's panels (``(row key, axis
    label)``), its file name and what its title says."""

    columns: tuple[str, ...]
    metrics: Mapping[str, str]
    panels: tuple[tuple[str, str], ...]
    figure: str
    what: str


BATCH_SWEEP = _SweepLog(
    ("method", "k", "redundancy", "imbalance", "time_build_s", "time_partition_s", "max_inputs_per_piece",
     "error"),
    {"redundancy": "sweep_redundancy"}, (("redundancy", "redundancy (input loads / inputs)"),),
    "redundancy_vs_k", "redundancy vs K")
CLUSTER_SWEEP = _SweepLog(
    ("method", "k", "num_parts", "edges_kept_fraction", "max_part_nodes", "max_part_edges", "imbalance",
     "peak_estimated_bytes", "time_partition_s", "error"),
    {"edges_kept_fraction": "sweep_edges_kept", "peak_estimated_bytes": "sweep_peak_estimated_bytes"},
    (("edges_kept_fraction", "edges kept (fraction)"), ("peak_estimated_bytes", "largest part, estimated peak")),
    "cluster_sweep", "cluster splits vs K")


def run(ctx: StageContext) -> dict[str, float]:
    from betty.partition import PARTITIONERS

    spec = ctx.rspec.spec
    p = spec.partition
    searches: list = []
    trainer, _, _ = make_trainer(ctx.rspec, ctx.dataset(), ctx.device, on_search=searches.append)
    revgnn = uses_revgnn(ctx.rspec)
    if revgnn:
        split = cluster_split(trainer)
    else:
        path = ctx.upstream_file("sample", "batch.npz")
        batch = load_batch(path)[0] if path is not None else trainer.sample(0, 0)
        split = batch_split(trainer, batch)  # exactly the first epoch's split
    log_metrics(split.metrics())
    for i, row in enumerate(split.rows):
        log_metrics({f"{split.piece}_{key.removeprefix('num_')}": value for key, value in row.items()
                     if key != split.piece}, step=i)
    log_artifact(write_csv(ctx.workdir / f"{split.table}.csv", split.rows))
    path = ctx.workdir / "partition.npz"
    np.savez_compressed(path, **split.arrays)
    log_artifact(path)
    if searches:
        log_artifact(write_json(ctx.workdir / "ksearch.json", [r.to_dict() for r in searches]))
    ctx.reporter.note(split.note)

    if p.sweep.k:
        options = dict(time_limit_s=p.sweep.time_limit_s, max_k=p.sweep.max_k, reporter=ctx.reporter)
        if revgnn:
            kind, table, skipped = CLUSTER_SWEEP, *cluster_sweep(
                trainer, p.sweep.k, p.sweep.methods or list(CLUSTER_METHODS), seed=spec.sampling.seed, **options)
        else:
            kind, table, skipped = BATCH_SWEEP, *sweep(
                batch, p.sweep.k, p.sweep.methods or sorted(PARTITIONERS), seed=spec.sampling.seed,
                graph=trainer.dataset.graph, options=trainer.plan.options, **options)
        _log_sweep(ctx, kind, table, skipped)
    return {key: split.report[key] for key in ("k", "redundancy", "edges_kept_fraction", "imbalance")
            if key in split.report}


def _log_sweep(ctx: StageContext, kind: _SweepLog, table: list[dict], skipped: dict[str, str]) -> None:
    """The sweep's per-method metrics (step K), ``partition_sweep.csv`` (``kind``'s
    columns) and ``.json``, the ``sweep_skipped`` tag and, when a row has figures, the
    figure (docs/workflow.md, *Stages*)."""
    for row in table:
        log_metrics({f"{prefix}.{row['method']}": row.get(key) for key, prefix in kind.metrics.items()},
                    step=row["k"])
    log_artifact(write_csv(ctx.workdir / "partition_sweep.csv", table, kind.columns))
    log_artifact(write_json(ctx.workdir / "partition_sweep.json", {"rows": table, "skipped": skipped}))
    if skipped:
        mlflow.set_tag("sweep_skipped", "; ".join(f"{m}: {r}" for m, r in skipped.items())[:500])
    first = kind.panels[0][0]
    if any(r.get(first) is not None for r in table):
        import matplotlib.pyplot as plt

        fig = sweep_figure(table, kind.panels, title=f"{ctx.rspec.name}: {kind.what}")
        mlflow.log_figure(fig, f"plots/{kind.figure}.png")
        plt.close(fig)
