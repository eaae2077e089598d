"""Baseline partitioners that ignore the graph: ``range`` and ``random``."""

from __future__ import annotations

import torch

from betty.batch import SampledBatch
from betty.partition.base import PartitionResult, register

__all__ = ["range_partition", "random_partition"]


def _balanced_cuts(order: torch.Tensor, k: int, weights: torch.Tensor | None) -> torch.Tensor:
    """Assign ``order``'s nodes to k contiguous runs of (about) equal total weight."""
    n = order.numel()
    groups = torch.empty(n, dtype=torch.int64)
    if weights is None:
        # sizes differ by at most one: piece i gets floor/ceil of n / k
        groups[order] = torch.arange(n, dtype=torch.int64) * k // n
        return groups
    w = torch.as_tensor(weights, dtype=torch.float64)[order]
    cum = torch.cumsum(w, 0) - w / 2  # each node's weight midpoint
    piece = torch.clamp((cum / w.sum() * k).long(), 0, k - 1)
    # keep every piece non-empty even with extreme weights
    piece = torch.maximum(piece, torch.arange(n) - (n - k))
    piece = torch.minimum(piece, torch.arange(n))
    piece = torch.cummax(piece, 0).values
    groups[order] = piece
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
