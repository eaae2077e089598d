"""Baseline partitioners that ignore the graph: ``range`` and ``random``."""

from __future__ import annotations

import torch

from betty.batch import SampledBatch
from betty.partition.base import PartitionResult, register

__all__ = ["range_partition", "random_partition"]


def _balanced_cuts(order: torch.Tensor, k: int, weights: torch.Tensor | None) -> torch.Tensor:
    """Assign ``order``'s ``n`` nodes to ``k <= n`` contiguous, non-empty runs of (about)
    equal total weight.

    Unweighted: node at position ``i`` goes to micro-batch ``floor(i k / n)`` (sizes differ by
    at most one). Weighted (``w`` in ``order``): with the weight midpoints
    ``m_i = Σ_{i' < i} w_{i'} + w_i / 2`` and ``W = Σ w``, micro-batch ``j`` ideally starts at
    ``b_j = #{i : m_i k / W < j}`` (``j = 1..k-1``). A heavy node can make two ``b_j``
    coincide (an empty micro-batch), so the starts are repaired to the nearest strictly
    increasing sequence with ``j <= b_j <= n - k + j``: ``c_j = b_j - j`` clamped to
    ``[0, n - k]`` and made non-decreasing (running maximum), ``b_j = c_j + j``. Every
    micro-batch then has at least one node; ideal starts that are already strictly increasing
    and within bounds are kept as they are.

    Returns:
        ``(n,)`` int64 micro-batch of each node (indexed like ``order``'s values).
    """
    n = order.numel()
    groups = torch.empty(n, dtype=torch.int64)
    if weights is None:
        groups[order] = torch.arange(n, dtype=torch.int64) * k // n
        return groups
    w = torch.as_tensor(weights, dtype=torch.float64)[order]
    total = float(w.sum())
    if total <= 0.0:  # all-zero weights: balance the number of nodes
        return _balanced_cuts(order, k, None)
    mid = (torch.cumsum(w, 0) - w / 2) * (k / total)  # non-decreasing, in [0, k]
    j = torch.arange(1, k, dtype=torch.int64)
    starts = torch.searchsorted(mid, j.to(torch.float64), right=False)  # #{i: mid_i < j}
    shifted = torch.clamp(starts - j, 0, n - k)
    if k > 1:
        starts = torch.cummax(shifted, 0).values + j
    groups[order] = torch.searchsorted(starts, torch.arange(n, dtype=torch.int64), right=True)
    return groups


@register("range")
def range_partition(batch: SampledBatch, k: int, *, seed: int = 0, weights=None, graph=None) -> PartitionResult:
    """Contiguous runs of output nodes in ascending global-ID order."""
    order = torch.argsort(batch.output_nid, stable=True)
    return PartitionResult(_balanced_cuts(order, k, weights), k, "range")


@register("random")
def random_partition(batch: SampledBatch, k: int, *, seed: int = 0, weights=None, graph=None) -> PartitionResult:
    """A seeded random permutation cut into k runs."""
    gen = torch.Generator().manual_seed(int(seed))
    order = torch.randperm(batch.num_outputs, generator=gen)
    return PartitionResult(_balanced_cuts(order, k, weights), k, "random")
