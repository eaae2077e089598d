"""JSON-ready memory reports: of a batch split K ways (:func:`estimate_report`) and of
a trainer's first split, estimated and measured micro-batch by micro-batch (:func:`split_report`,
what ``Trainer.memory_report`` and ``RevTrainer.memory_report`` return and
``betty estimate`` prints)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from betty.batch import SampledBatch
from betty.memory.estimator import estimate_micro_batches
from betty.memory.ksearch import DEFAULT_SAFETY_MARGIN, search_k
from betty.records import estimate_error

__all__ = ["estimate_report", "split_report"]


def estimate_report(batch: SampledBatch, model, optimizer="adam", *, k: int | str = 1,
                    method: str = "random", memory_budget: int | None = None,
                    safety_margin: float = DEFAULT_SAFETY_MARGIN, balance: str = "nodes", seed: int = 0,
                    graph=None, dtype: torch.dtype | None = None, backend: str = "cpu") -> dict:
    """Estimate a batch split ``k`` ways (``k="auto"``: :func:`~betty.memory.ksearch.
    search_k` with ``memory_budget``) and return a JSON-ready dict: ``k``, ``method``,
    per-micro-batch peaks, the worst micro-batch's breakdown and, for ``auto``, every K tried."""
    if k == "auto":
        if memory_budget is None:
            raise ValueError("k='auto' needs memory_budget (bytes)")
        result = search_k(batch, model, optimizer, memory_budget=memory_budget,
                          safety_margin=safety_margin, method=method, balance=balance,
                          seed=seed, graph=graph, dtype=dtype, backend=backend)
        return {"mode": "auto", "memory_budget_bytes": int(memory_budget),
                "safety_margin": safety_margin, "backend": backend, **result.to_dict()}
    from betty.partition import partition_batch
    from betty.memory.ksearch import memory_balance_weights

    weights = memory_balance_weights(batch, model) if balance == "memory" else None
    part = partition_batch(batch, int(k), method, seed=seed, weights=weights, graph=graph)
    ests = estimate_micro_batches(batch, part.groups, part.k, model, optimizer, dtype, backend)
    worst = max(ests, key=lambda e: e.peak)
    out = {"mode": "fixed", "k": part.k, "method": method, "backend": backend,
           "max_estimated_peak_bytes": int(worst.peak),
           "estimated_peak_bytes_per_micro_batch": [int(e.peak) for e in ests],
           "worst_micro_batch": worst.to_dict()}
    if memory_budget is not None:
        out["memory_budget_bytes"] = int(memory_budget)
        out["fits"] = worst.peak <= memory_budget * (1 - safety_margin)
    return out


def split_report(estimates: Sequence[Any], *, method: str, k: int, backend: str,
                 memory_budget: int | None, safety_margin: float, sizes: dict | None = None,
                 measured: Sequence[int | None] | None = None, search: Any = None,
                 micro_batch_name: str = "micro-batch") -> dict:
    """One split's memory report, JSON-ready (bytes as ints, errors as fractions).

    Args:
        estimates: every micro-batch's estimate, in micro-batch order (``peak`` and ``breakdown``:
            a :class:`~betty.memory.MemoryEstimate` or a RevGNN part's estimate).
        method, k, backend: the split's partitioner, its number of micro-batches and the
            memory model's constants.
        memory_budget, safety_margin: the plan's (``None``: no budget).
        sizes: further figures of the split, placed after ``backend`` (e.g.
            ``num_outputs``).
        measured: every micro-batch's measured peak bytes (``None`` for a micro-batch that did not
            run); ``None``: not measured.
        search: the K search that chose the split (its ``to_dict()["tried"]``), if any.
        micro_batch_name: what a row is (``"micro-batch"``, or RevGNN's ``"part"``).

    Returns:
        ``method``, ``k``, ``backend``, ``micro_batch_name``, the ``sizes``, ``memory_budget_bytes``,
        ``safety_margin``, ``max_estimated_peak_bytes`` and ``micro_batches``: one row
        per micro-batch with ``index``, ``estimated_peak_bytes`` and ``components``
        (``{component: bytes}``, summing to the estimate). With ``measured`` each row
        adds ``measured_peak_bytes`` and ``relative_error`` ((estimated - measured) /
        measured; ``None`` where nothing was measured), and the report
        ``max_measured_peak_bytes`` and ``max_abs_relative_error`` (``None`` when no
        micro-batch was measured). With ``search``, ``k_tried``: every K tried with its
        largest estimated micro-batch (as the search's ``to_dict`` gives it).
    """
    rows = [{"index": i, "estimated_peak_bytes": int(e.peak),
             "components": {c: int(b) for c, b in e.breakdown.items()}} for i, e in enumerate(estimates)]
    out = {"method": method, "k": k, "backend": backend, "micro_batch_name": micro_batch_name, **(sizes or {}),
           "memory_budget_bytes": memory_budget, "safety_margin": safety_margin,
           "max_estimated_peak_bytes": max(row["estimated_peak_bytes"] for row in rows), "micro_batches": rows}
    if measured is not None:
        for row, peak in zip(rows, measured):
            row["measured_peak_bytes"] = peak
            row["relative_error"] = None if not peak else (row["estimated_peak_bytes"] - peak) / peak
        out["max_measured_peak_bytes"] = max((p for p in measured if p), default=None)
        out["max_abs_relative_error"] = estimate_error((row["estimated_peak_bytes"], peak)
                                                       for row, peak in zip(rows, measured))
    if search is not None:
        out["k_tried"] = search.to_dict()["tried"]
    return out
