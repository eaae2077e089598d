"""Measure RevGNN cluster splits: the split a :class:`betty.rev.engine.RevTrainer`'s
first epoch makes (:func:`measure_cluster_split`) and every cluster method at every K
(:func:`sweep_clusters`, through :func:`betty.partition.sweep.sweep_grid`'s loop and skip
rules).

A K-way cluster split keeps only the edges inside its parts (the induced subgraphs of
:func:`betty.rev.training.cluster_partition`). With ``E`` the graph's edges, ``E(P)``
those of part ``P`` and ``n_P`` its nodes,

    edges_kept_fraction = Σ_P |E(P)| / |E|,      imbalance = max_P n_P / mean_P n_P.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np

from betty.catalog import CLUSTER_METHODS
from betty.partition.sweep import OnSkip, Progress, Split, sweep_grid, sweep_ks
from betty.rev.training import backend_graph, cluster_partition, edges_kept_fraction

__all__ = ["CLUSTER_SWEEP_COLUMNS", "cluster_figures", "measure_cluster_split", "sweep_clusters"]

#: The keys of a :func:`sweep_clusters` row, in table order (``error`` only on a failed row).
CLUSTER_SWEEP_COLUMNS = ("method", "k", "num_parts", "edges_kept_fraction", "max_part_nodes", "max_part_edges",
                         "imbalance", "peak_estimated_bytes", "time_partition_s", "error")


def cluster_figures(parts, estimates: list[int] | None, num_edges: int) -> dict:
    """Sizes and edge share of a cluster split.

    Args:
        parts: the P parts (:class:`betty.rev.training.GraphPart`).
        estimates: per-part estimated peak bytes (P ints), or ``None``.
        num_edges: ``|E|``, the whole graph's edges.

    Returns:
        ``part_nodes`` and ``part_edges`` (P ints each), ``edges_kept_fraction``,
        ``edges_dropped_fraction`` (1 - kept), ``imbalance`` and ``estimated_bytes``
        (``estimates`` as given).
    """
    nodes = [int(p.graph.num_nodes()) for p in parts]
    kept = edges_kept_fraction(parts, num_edges)
    return {"part_nodes": nodes, "part_edges": [int(p.graph.num_edges()) for p in parts],
            "edges_kept_fraction": kept, "edges_dropped_fraction": 1.0 - kept,
            "imbalance": max(nodes) / (sum(nodes) / len(nodes)), "estimated_bytes": estimates}


def measure_cluster_split(trainer) -> Split:
    """Split the graph exactly as ``trainer``'s first epoch does (epoch 0: its method, K
    or K search, seed), with the timings and, when it estimates memory, each part's
    estimated peak.

    Args:
        trainer: a :class:`betty.rev.engine.RevTrainer` over a graph of ``N`` nodes.

    Returns:
        A :class:`~betty.partition.sweep.Split` with ``micro_batch_key="part"``. ``report``:
        ``method``, ``k`` (P, the parts made), ``part_nodes``, ``part_edges``,
        ``part_train`` (P ints each: nodes, edges, training nodes), ``edges_kept_fraction``,
        ``edges_dropped_fraction``, ``imbalance``, ``time_partition_s``,
        ``time_estimate_s``; ``time_ksearch_s`` with ``k="auto"``;
        ``peak_mem_estimated_bytes`` (the largest part's) when estimated. ``rows``: P
        dicts ``part``, ``num_nodes``, ``num_edges``, ``num_train``, ``estimated_bytes``.
        ``arrays``: ``part`` ``(N,)`` int64, the part of every node.
    """
    parts, estimates, _ = trainer.split(0)
    times = trainer.last_split_times
    figures = cluster_figures(parts, estimates, trainer.dataset.num_edges)
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
    return Split(report, rows, "part", {"part": labels},
                 f"{regime} K={len(parts)}: {min(figures['part_nodes']):,}-{max(figures['part_nodes']):,} "
                 f"nodes per part, {figures['edges_kept_fraction']:.1%} of the edges kept")


def sweep_clusters(trainer, ks: Sequence[int], methods: Sequence[str] | None = None, *, seed: int = 0,
                   time_limit_s: float | None = None, max_k: Mapping[str, int] | None = None,
                   progress: Progress | None = None,
                   on_skip: OnSkip | None = None) -> tuple[list[dict], dict[str, str]]:
    """Split ``trainer``'s graph with every cluster method at every K
    (:func:`betty.rev.training.cluster_partition`, on the graph of the model's backend)
    and measure each split; the loop and its skip rules are
    :func:`betty.partition.sweep.sweep_grid`'s.

    Args:
        trainer: a :class:`betty.rev.engine.RevTrainer` over a graph of ``N`` nodes (its
            ``estimate`` gives the parts' estimated peaks, or ``None``).
        ks: the Ks to try; those above ``N`` are left out, the rest tried in increasing
            order, each once.
        methods: :data:`betty.catalog.CLUSTER_METHODS` entries (default: all of them).
        seed: the split's seed.
        time_limit_s, max_k, progress, on_skip: as :func:`~betty.partition.sweep.sweep_grid`.

    Returns:
        ``(rows, skipped)`` as :func:`~betty.partition.sweep.sweep_grid`; a row's figures
        (:data:`CLUSTER_SWEEP_COLUMNS`): ``num_parts``, ``edges_kept_fraction``,
        ``max_part_nodes``, ``max_part_edges``, ``imbalance``, ``time_partition_s`` and
        ``peak_estimated_bytes`` (the largest part's, ``None`` when not estimated), or
        ``error`` when the method failed.
    """
    graph = backend_graph(trainer.model, trainer.dataset.graph)  # parts: subgraphs of the model's backend

    def measure(method: str, k: int) -> dict:
        start = time.perf_counter()
        parts = cluster_partition(graph, k, method, seed)
        took = time.perf_counter() - start
        figures = cluster_figures(parts, trainer.estimate(parts), graph.num_edges())
        return {"num_parts": len(parts), "edges_kept_fraction": figures["edges_kept_fraction"],
                "max_part_nodes": max(figures["part_nodes"]), "max_part_edges": max(figures["part_edges"]),
                "imbalance": figures["imbalance"], "time_partition_s": took,
                "peak_estimated_bytes": max(figures["estimated_bytes"]) if figures["estimated_bytes"] else None}

    ks = sweep_ks(ks, graph.num_nodes())
    return sweep_grid(list(CLUSTER_METHODS) if methods is None else list(methods), ks, measure,
                      time_limit_s=time_limit_s, max_k=max_k, progress=progress, on_skip=on_skip)
