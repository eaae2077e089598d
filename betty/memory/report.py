"""JSON-ready summaries for the ``betty estimate`` command."""

from __future__ import annotations

import torch

from betty.batch import SampledBatch
from betty.memory.estimator import estimate_pieces
from betty.memory.ksearch import DEFAULT_SAFETY_MARGIN, search_k

__all__ = ["estimate_report"]


def estimate_report(batch: SampledBatch, model, optimizer="adam", *, k: int | str = 1,
                    method: str = "random", memory_budget: int | None = None,
                    safety_margin: float = DEFAULT_SAFETY_MARGIN, balance: str = "nodes", seed: int = 0,
                    graph=None, dtype: torch.dtype | None = None, backend: str = "cpu") -> dict:
    """Estimate a batch split ``k`` ways (``k="auto"``: :func:`~betty.memory.ksearch.
    search_k` with ``memory_budget``) and return a JSON-ready dict: ``k``, ``method``,
    per-piece peaks, the worst piece's breakdown and, for ``auto``, every K tried."""
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
    ests = estimate_pieces(batch, part.groups, part.k, model, optimizer, dtype, backend)
    worst = max(ests, key=lambda e: e.peak)
    out = {"mode": "fixed", "k": part.k, "method": method, "backend": backend,
           "max_estimated_peak_bytes": int(worst.peak),
           "estimated_peak_bytes_per_piece": [int(e.peak) for e in ests],
           "worst_piece": worst.to_dict()}
    if memory_budget is not None:
        out["memory_budget_bytes"] = int(memory_budget)
        out["fits"] = worst.peak <= memory_budget * (1 - safety_margin)
    return out
