"""Assignment of micro-batches to ranks: longest estimated first (LPT).

Micro-batches are sorted by estimated cost ``c_k`` (descending, ties by micro-batch index) and each
is given to the rank with the smallest load so far (ties: lowest rank). LPT's makespan
is at most ``4/3 - 1/(3R)`` times the optimum for R ranks (Graham, 1969). The result is
a pure function of ``(costs, world_size)``, so every rank computes the same assignment
without communicating.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["lpt_assign", "micro_batches_of_rank", "micro_batch_output_costs"]


def micro_batch_output_costs(groups: torch.Tensor, k: int) -> list[float]:
    """The fallback cost of each of the ``k`` micro-batches when no estimate is given: its
    number of output nodes (``groups (n_out,)``: each output's micro-batch)."""
    return torch.bincount(torch.as_tensor(groups, dtype=torch.int64), minlength=k).double().tolist()


def lpt_assign(costs: Sequence[float], world_size: int) -> list[list[int]]:
    """``costs (K,)`` -> for each of the ``world_size`` ranks, its micro-batch indices (increasing).

    Raises:
        ValueError: ``world_size < 1`` or a negative cost.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if any(c < 0 for c in costs):
        raise ValueError(f"micro-batch costs must be non-negative, got {list(costs)}")
    order = sorted(range(len(costs)), key=lambda k: (-float(costs[k]), k))
    load = [0.0] * world_size
    owned: list[list[int]] = [[] for _ in range(world_size)]
    for k in order:
        r = min(range(world_size), key=lambda i: (load[i], i))
        load[r] += float(costs[k])
        owned[r].append(k)
    return [sorted(o) for o in owned]


def micro_batches_of_rank(costs: Sequence[float], world_size: int, rank: int) -> list[int]:
    """The micro-batches :func:`lpt_assign` gives to ``rank``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return lpt_assign(costs, world_size)[rank]
