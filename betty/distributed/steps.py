"""Data-parallel versions of betty's two training steps (sampled blocks, RevGNN parts).

Both run this rank's pieces through the single-process code with the global
normalisation, then let :class:`betty.distributed.parallel.DataParallel` sum the
gradients and step; the returned loss and accuracy are summed over the ranks, so they
equal the single-process step's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from betty.distributed.parallel import DataParallel

__all__ = ["train_step_parallel", "train_step_parts_parallel", "piece_output_costs"]


def piece_output_costs(groups: torch.Tensor, k: int) -> list[float]:
    """Fallback cost of each piece: its number of output nodes."""
    return torch.bincount(torch.as_tensor(groups, dtype=torch.int64), minlength=k).double().tolist()


def train_step_parallel(dp: DataParallel, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        batch, groups: torch.Tensor, feat: torch.Tensor, label: torch.Tensor, *,
                        k: int, costs: Sequence[float] | None = None, **kwargs: Any):
    """:func:`betty.train.train_step` over ``dp``'s ranks (``parallel=dp``).

    ``costs`` (K,): estimated cost of each piece for the assignment (e.g. estimated
    peak bytes); default :func:`piece_output_costs`. ``kwargs``: those of
    :func:`betty.train.accumulate_gradients`. Returns a
    :class:`betty.train.StepResult` whose ``micro`` lists only this rank's pieces.
    """
    from betty.train import train_step

    return train_step(model, optimizer, batch, groups, feat, label, k=k, parallel=dp,
                      costs=costs, **kwargs)


def train_step_parts_parallel(dp: DataParallel, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              parts: Sequence, feat: torch.Tensor, label: torch.Tensor,
                              train_mask: torch.Tensor, *, costs: Sequence[float] | None = None,
                              **kwargs: Any):
    """:func:`betty.rev.engine.train_step_parts` over ``dp``'s ranks (``parallel=dp``).

    ``costs`` (K,): default, each part's nodes + edges. ``kwargs``: those of
    :func:`betty.rev.engine.backward_parts` (``after_last`` excepted). Returns a
    :class:`betty.rev.engine.RevStepResult` whose ``parts`` are this rank's.
    """
    from betty.rev.engine import train_step_parts

    return train_step_parts(model, optimizer, parts, feat, label, train_mask, parallel=dp,
                            costs=costs, **kwargs)
