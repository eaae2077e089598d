"""Exact data-parallel micro-batching: the K micro-batches of one batch spread over R ranks.

One optimizer step on every rank r:

1. ``zero_grad``; run the micro-batches ``P_r`` that :func:`betty.distributed.assign.lpt_assign`
   gives r (every rank holds the same sampled batch and partition, so all compute the
   same assignment), accumulating ``g_r = Σ_{k in P_r} ∇L_k`` with the *global*
   normalisation ``L_k = (1/|V|) Σ_{v in V_k} ℓ(v)``;
2. one bucketed ``all_reduce(SUM)`` of the gradients: every rank now holds
   ``Σ_r g_r = ∇L``, the full-batch gradient;
3. the same ``optimizer.step()`` on every rank, so parameters stay bit-identical
   (checked every ``check_every`` steps by :func:`check_parameters_in_sync`).

Every rank computes the partition itself, and :meth:`DataParallel.agree` then gives every
rank rank 0's: a multi-threaded partitioner (Mt-KaHyPar's default preset, KaMinPar on
several threads) or a time limit that falls back on one rank only may split differently
in different processes, and micro-batches of two different splits would not cover the
batch once.

This module only deals with micro-batches, gradients and parameters: running a micro-batch is the
caller's ``run_micro_batches`` callback (the sampled-block engine, RevGNN parts, any backend).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from betty.distributed.assign import lpt_assign
from betty.distributed.collective import (DEFAULT_BUCKET_BYTES, ReduceStats, allreduce_gradients,
                                          check_parameters_in_sync)

__all__ = ["DataParallel", "RankStepStats"]

T = TypeVar("T")


@dataclass
class RankStepStats:
    """This rank's share of one step: the ``indices`` of the micro-batches it ran, its
    gradient all-reduce and the parameter checksum (``None`` when not checked)."""

    indices: list[int]
    reduce: ReduceStats
    checksum: int | None = None


@dataclass
class DataParallel:
    """The process group a trainer spreads its micro-batches over.

    Attributes:
        group: a ``torch.distributed`` group (``None``: the default, initialised one).
        check_every: verify parameter checksums every this many steps (0: never).
        bucket_bytes: gradient all-reduce bucket size.
        steps: optimizer steps taken so far.
        last_step: this rank's share of the latest step.
        reduce_bytes, reduce_wait_s: the gradient all-reduces of every step so far,
            summed (a running total: the state does not grow with the steps).
    """

    group: Any = None
    check_every: int = 5
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    steps: int = 0
    last_step: RankStepStats | None = None
    reduce_bytes: int = 0
    reduce_wait_s: float = 0.0
    _agree_group: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # agree() runs on a gloo group of its own: it may be called from a preparation
        # thread while the step's collectives run on ``group`` (collectives of one group
        # must come in the same order on every rank; two threads would not keep it).
        # The ranks of ``group`` create it here, together (local synchronisation: ranks
        # outside a subgroup take no part).
        ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
        self._agree_group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=ranks is not None)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def assign(self, costs: Sequence[float]) -> list[int]:
        """This rank's micro-batches under longest-estimated-first assignment."""
        return lpt_assign(costs, self.world_size)[self.rank]

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             costs: Sequence[float], run_micro_batches: Callable[[list[int]], T], scaler=None) -> T:
        """zero_grad -> ``run_micro_batches(mine)`` -> gradient all-reduce -> ``optimizer.step()``
        (-> checksum check every ``check_every`` steps). Returns ``run_micro_batches``' result.
        ``scaler``: a :class:`betty.precision.LossScaler`: after the all-reduce the
        gradients are unscaled once and the step is taken only if no rank found an inf
        or NaN (the flag is all-reduced, so every rank decides alike)."""
        model.train()
        optimizer.zero_grad(set_to_none=True)
        mine = self.assign(costs)
        result = run_micro_batches(mine)
        params = list(model.parameters())
        stats = allreduce_gradients(params, self.group, self.bucket_bytes)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer, params, all_ranks=True, group=self.group)
        self.steps += 1
        checksum = None
        if self.check_every and self.steps % self.check_every == 0:
            checksum = check_parameters_in_sync(params, self.steps, self.group)
        self.last_step = RankStepStats(mine, stats, checksum)
        self.reduce_bytes += stats.bytes
        self.reduce_wait_s += stats.wait_s
        return result

    @property
    def _source(self) -> int:
        """The global rank of ``group``'s rank 0."""
        return 0 if self.group is None else dist.get_process_group_ranks(self.group)[0]

    def agree(self, value: T) -> T:
        """Rank 0's ``value`` (any picklable object, e.g. a batch's partition) on every
        rank; for the preparation thread: thread-safe beside :meth:`step` (a group of its
        own, which the training thread never uses)."""
        box = [value]
        dist.broadcast_object_list(box, src=self._source, group=self._agree_group)
        return box[0]

    def share_scalars(self, *values: float) -> list[float]:
        """Rank 0's float64 scalars on every rank, for the training thread (e.g. a
        validation score): on ``group``, in order with the step's collectives, so that it
        never pairs with a preparation thread's :meth:`agree` on another rank."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.broadcast(t, src=self._source, group=self.group)
        return t.tolist()

    def sum_scalars(self, *values: float) -> list[float]:
        """Sum a few float64 scalars over the ranks (losses, correct counts)."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t.tolist()
