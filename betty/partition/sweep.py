"""Measure splits of a sampled batch: the split a trainer's first epoch makes
(:func:`measure_batch_split`) and every partition method at every K (:func:`sweep_batch`).

Both report the figures of :func:`betty.partition.split_metrics`: with ``I_k`` the
layer-0 input nodes of micro-batch ``k`` and ``I`` those of the whole batch,

    redundancy = Σ_k |I_k| / |I|   (>= 1),      imbalance = max_k |I_k| / mean_k |I_k|.

:func:`sweep_grid` is the loop of every sweep, the RevGNN cluster sweep
(:func:`betty.rev.sweep.sweep_clusters`) included: methods × Ks with a per-method K cap
(``max_k``), a wall-time cut (``time_limit_s``), a failing method cut short, and the
reason for every K not tried.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from betty.checks import is_integer
from betty.partition.base import PARTITIONERS, partition_batch
from betty.partition.metrics import split_metrics

__all__ = ["Split", "measure_batch_split", "SWEEP_COLUMNS", "sweep_batch", "sweep_grid", "sweep_ks", "sweep_plan",
           "time_limit_reason"]

Progress = Callable[[int, int], None]
"""``progress(done, total)``: ``(0, total)`` first, then after each step."""
OnSkip = Callable[[str, str], None]
"""``on_skip(method, reason)``: a method's Ks were cut short (the reason of ``skipped``)."""

SWEEP_COLUMNS = ("method", "k", "redundancy", "imbalance", "time_build_s", "time_partition_s",
                 "max_inputs_per_micro_batch", "fallback", "error")
"""The keys of a :func:`sweep_batch` row, in table order: ``fallback`` only on a row whose
split another method made (``hypergraph`` past its ``time_limit_s``: ``"reg: <why>"``),
``error`` only on a failed row."""


@dataclass
class Split:
    """One split, measured (:func:`measure_batch_split`,
    :func:`betty.rev.sweep.measure_cluster_split`).

    Attributes:
        report: the figures by name (``method``, ``k``, ``imbalance``, the timers,
            ``peak_mem_estimated_bytes`` when estimated, and the engine's own); a
            ``<name>_per_layer`` value is a list with one figure per layer.
        rows: one dict per micro-batch, its index first (key :attr:`micro_batch_key`),
            then its sizes (``num_*``) and ``estimated_bytes`` (``None`` when not
            estimated).
        micro_batch_key: the index's key in ``rows``: ``"micro"`` (a sampled
            micro-batch) or ``"part"`` (a RevGNN cluster part).
        arrays: the split itself, as numpy arrays (sampled batch: ``outputs`` ``(n_out,)``
            output node IDs and ``groups`` ``(n_out,)`` their micro-batches; clusters: ``part``
            ``(N,)``, the part of every node).
        summary: a one-line summary.
        batch: the sampled batch that was split (``None`` for cluster parts).
    """

    report: dict
    rows: list[dict]
    micro_batch_key: str
    arrays: dict[str, np.ndarray]
    summary: str
    batch: Any = None

    def metrics(self) -> dict[str, float]:
        """The report's numbers as scalars by name: a ``<name>_per_layer`` list becomes
        ``<name>_layer<l>`` for every layer ``l``; strings and booleans are left out."""
        out = {}
        for key, value in self.report.items():
            if key.endswith("_per_layer"):
                out.update({f"{key.removesuffix('_per_layer')}_layer{l}": v for l, v in enumerate(value)})
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = value
        return out


def measure_batch_split(trainer, batch) -> Split:
    """Split ``batch`` exactly as ``trainer``'s first epoch does (epoch 0, batch 0: its
    method, K or K search, balance) and carve its micro-batches as a prepared batch's are
    (:func:`betty.train.carve_all`, on the preparation threads), timing each step.

    Args:
        trainer: a :class:`betty.engine.Trainer` (its ``partition``, ``estimator`` and
            ``plan``).
        batch: the sampled batch (:class:`betty.batch.SampledBatch`) with ``n_out``
            output nodes.

    Returns:
        A :class:`Split` with ``micro_batch_key="micro"``. ``report``: ``method``, ``k``,
        ``redundancy``, ``redundancy_per_layer`` (L floats), ``imbalance``,
        ``time_build_s``, ``time_partition_s``, ``time_block_s`` (the wall time of
        carving the K micro-batches on the preparation threads; an epoch record's sums
        each micro-batch's carve and its blocks' build on the device); ``fallback_from`` / ``fallback_reason`` when a time-limited
        partitioner fell back; ``time_ksearch_s`` with ``k="auto"``;
        ``peak_mem_estimated_bytes`` (the largest micro-batch's) when the trainer estimates.
        ``rows``: K dicts ``micro``, ``num_outputs``, ``num_inputs`` (layer 0),
        ``num_edges`` (all layers), ``estimated_bytes``.
    """
    from betty.train import carve_all

    start = time.perf_counter()
    result, estimates, _ = trainer.partition(batch, 0, 0)
    took = time.perf_counter() - start
    if estimates is None and trainer.estimator is not None:
        estimates = trainer.estimator(batch, result.groups, result.k)
    start = time.perf_counter()
    micro = [mb for _, mb, _ in carve_all(batch, result.groups, result.k, torch_ops=trainer.torch_ops)]
    time_blocks = time.perf_counter() - start
    stats = split_metrics(batch, result.groups, result.k)
    report = {"method": result.method, "k": result.k, "redundancy": stats["redundancy"],
              "redundancy_per_layer": stats["redundancy_per_layer"], "imbalance": stats["imbalance"],
              "time_build_s": result.time_build_s, "time_partition_s": result.time_partition_s,
              "time_block_s": time_blocks}
    if result.info.get("fallback_from"):  # e.g. hypergraph hit its time_limit_s
        report.update(fallback_from=result.info["fallback_from"], fallback_reason=result.info["fallback_reason"])
    if trainer.plan.k == "auto":
        report["time_ksearch_s"] = took
    if estimates:
        report["peak_mem_estimated_bytes"] = max(estimates)
    rows = [{"micro": i, "num_outputs": mb.num_outputs, "num_inputs": mb.layers[0].num_src,
             "num_edges": sum(layer.num_edges for layer in mb.layers),
             "estimated_bytes": estimates[i] if estimates else None} for i, mb in enumerate(micro)]
    return Split(report, rows, "micro", {"outputs": batch.output_nid.numpy(), "groups": result.groups.numpy()},
                 f"{result.method} K={result.k}: redundancy {stats['redundancy']:.3f}, "
                 f"imbalance {stats['imbalance']:.3f}", batch)


def sweep_plan(ks: list[int], method: str, max_k: Mapping[str, int] | None) -> tuple[list[int], str | None]:
    """The Ks a sweep tries for ``method``: ``ks`` up to ``max_k[method]`` (all of them
    when ``max_k`` has no entry for it), the same on every machine.

    Returns:
        ``(Ks to try, reason)``: the reason names the Ks dropped
        (``"K=8,16 skipped: above sweep.max_k.range=4"``), ``None`` when none was.
    """
    cap = (max_k or {}).get(method)
    if cap is None:
        return list(ks), None
    dropped = [k for k in ks if k > cap]
    reason = f"K={','.join(map(str, dropped))} skipped: above sweep.max_k.{method}={cap}" if dropped else None
    return [k for k in ks if k <= cap], reason


def time_limit_reason(k: int, took: float, limit: float, rest: list[int]) -> str:
    """Why a method's Ks ``rest`` were skipped: its split at ``k`` took ``took`` seconds,
    more than the sweep's ``time_limit_s`` = ``limit``."""
    return (f"K={k} took {took:.1f}s > sweep.time_limit_s={limit} (machine-dependent); "
            f"K={','.join(map(str, rest))} skipped")


def sweep_ks(ks: Sequence[int], most: int) -> list[int]:
    """The Ks a sweep tries: those of ``ks`` up to ``most`` (the outputs or nodes there
    are to split), increasing, each once.

    Raises:
        ValueError: a K that is not an integer >= 1 (it would fail every method).
    """
    if any(not is_integer(k) or k < 1 for k in ks):
        raise ValueError(f"ks must be integers >= 1, got {list(ks)!r}")
    return sorted({int(k) for k in ks if k <= most})


def sweep_grid(methods: Sequence[str], ks: Sequence[int], measure: Callable[[str, int], dict], *,
               time_limit_s: float | None = None, max_k: Mapping[str, int] | None = None,
               progress: Progress | None = None,
               on_skip: OnSkip | None = None) -> tuple[list[dict], dict[str, str]]:
    """Every method at every K: ``measure(method, k)`` for each of ``methods`` and each K
    of ``ks`` (increasing) up to ``max_k[method]`` (:func:`sweep_plan`).

    A method is cut short, its larger Ks not tried, when ``measure`` raises (its row then
    holds ``error``, ``"<exception type>: <message>"``) or when one K took longer than
    ``time_limit_s`` seconds (:func:`time_limit_reason`; it depends on the machine and
    its load, ``max_k`` does not).

    Args:
        methods: the methods, in row order.
        ks: the Ks, increasing.
        measure: ``measure(method, k) -> dict`` of the row's figures.
        time_limit_s: the seconds one K may take before the method's larger Ks are
            skipped (``None``: no limit).
        max_k: ``{method: largest K}``.
        progress: ``progress(done, total)``, ``total = len(methods) * len(ks)``; a K
            skipped counts as done.
        on_skip: ``on_skip(method, reason)`` once a method's Ks were cut short.

    Returns:
        ``(rows, skipped)``: one row per (method, K) tried, ``{"method", "k", **figures}``
        in the order tried, and ``{method: reason}`` naming the Ks not tried and why
        (reasons joined by ``"; "``, the cut short first).
    """
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    total, done = len(ks) * len(methods), 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress(done, total)

    if progress:
        progress(0, total)
    for method in methods:
        planned, capped = sweep_plan(list(ks), method, max_k)
        reasons = [capped] if capped else []
        for i, k in enumerate(planned):
            start = time.perf_counter()
            stop = None
            try:
                row = measure(method, k)
            except Exception as err:  # noqa: BLE001  (a method unsuited to this graph)
                reason = f"{type(err).__name__}: {err}"
                rows.append({"method": method, "k": k, "error": reason})
                stop = f"failed at K={k}: {reason}"
            else:
                rows.append({"method": method, "k": k, **row})
                took = time.perf_counter() - start
                if time_limit_s is not None and took > time_limit_s and i + 1 < len(planned):
                    stop = time_limit_reason(k, took, time_limit_s, planned[i + 1:])
            advance(1)
            if stop:
                reasons.insert(0, stop)
                if len(planned) - i - 1:
                    advance(len(planned) - i - 1)
                break
        if len(ks) > len(planned):
            advance(len(ks) - len(planned))
        if reasons:
            skipped[method] = "; ".join(reasons)
            if on_skip:
                on_skip(method, skipped[method])
    return rows, skipped


def sweep_batch(batch, ks: Sequence[int], methods: Sequence[str] | None = None, *, seed: int = 0, graph=None,
                options: Mapping[str, Any] | None = None, time_limit_s: float | None = None,
                max_k: Mapping[str, int] | None = None, progress: Progress | None = None,
                on_skip: OnSkip | None = None) -> tuple[list[dict], dict[str, str]]:
    """Split ``batch`` with every method at every K (:func:`betty.partition.partition_batch`)
    and measure each split: the loop and its skip rules are :func:`sweep_grid`'s.

    Args:
        batch: the sampled batch (:class:`betty.batch.SampledBatch`), ``n_out`` outputs.
        ks: the Ks to try; those above ``n_out`` are left out, the rest tried in
            increasing order, each once.
        methods: keys of :data:`betty.partition.PARTITIONERS` (default: all, sorted).
        seed: the partitioners' seed.
        graph: the original graph (needed by ``metis``).
        options: partitioner options, as :func:`~betty.partition.partition_batch`'s (e.g.
            ``time_limit_s``, ``deterministic``, ``partitioner``).
        time_limit_s, max_k, progress, on_skip: as :func:`sweep_grid`.

    Returns:
        ``(rows, skipped)`` as :func:`sweep_grid`; a row's figures (:data:`SWEEP_COLUMNS`):
        ``redundancy``, ``imbalance``, ``time_build_s``, ``time_partition_s`` and
        ``max_inputs_per_micro_batch`` (max_k |I_k|), ``fallback`` when another method
        made the split, or ``error`` when the method failed. ``time_build_s`` is what
        the row built itself: a structure an earlier row left on the batch (the REG, the
        multi-hop incidence) is reused at no cost, so the first row of a method pays it.
    """

    def measure(method: str, k: int) -> dict:
        result = partition_batch(batch, k, method, seed=seed, graph=graph, options=options)
        stats = split_metrics(batch, result.groups, k)
        row = {"redundancy": stats["redundancy"], "imbalance": stats["imbalance"],
               "time_build_s": result.time_build_s, "time_partition_s": result.time_partition_s,
               "max_inputs_per_micro_batch": max(stats["input_nodes_per_micro_batch"])}
        if result.method != method:  # its figures are the fallback's
            row["fallback"] = f"{result.method}: {result.info.get('fallback_reason', 'fallback')}"
        return row

    ks = sweep_ks(ks, batch.num_outputs)
    return sweep_grid(sorted(PARTITIONERS) if methods is None else list(methods), ks, measure,
                      time_limit_s=time_limit_s, max_k=max_k, progress=progress, on_skip=on_skip)
