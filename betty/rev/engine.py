"""The epoch loop of reversible deep GNNs (:class:`betty.rev.model.RevGNN`,
:class:`betty.rev.deq.RevGNNDEQ`): full graph or K cluster parts per step.

A reversible block maps a node set to *the same* node set, so these models cannot run
on Betty's shrinking sampled blocks (:mod:`betty.engine`). Each training step instead
runs the model on K node-disjoint induced subgraphs ("parts") of the whole graph and
accumulates their gradients into one optimizer step, as RevGNN does on ogbn-proteins
(10 random parts) and ogbn-products:

* K = 1: the full graph, an exact full-batch step;
* K > 1: :func:`betty.rev.training.cluster_partition` with ``method="random"``
  (a fresh uniform split every epoch, seeded by :func:`cluster_seed` ``(seed, epoch)``)
  or ``"metis"`` (computed once, kept for the run). Edges between parts are dropped,
  so a K-part step is the gradient of a *different* model (each node sees only its
  part's neighbours); it equals the full-graph gradient exactly only when no edge
  crosses parts (e.g. parts = unions of connected components).

Loss of one step, with T the training nodes and T_P those in part P:

    loss_P = sum_{v in T_P} l(v) / |T|,      loss = sum_P loss_P,    grad = sum_P d loss_P

``l`` = cross-entropy (single-label) or the mean over tasks of binary cross-entropy
(multi-label, ogbn-proteins), as :func:`betty.train.node_loss_sum`.

Dropout (``dropout_mode="deterministic"``): :class:`SharedHashMasks`, RevGNN's recipe
(one mask shared by every block, an independent one before the decoder) with the masks a
hash of (key, global node ID, column) (:func:`betty.models.dropout.hash_keep_mask`,
``key = dropout_key(dropout_seed, epoch)``), so a node draws the same mask whatever part
it lands in and K-part training is reproducible. ``"standard"`` leaves the masks to the
model (Bernoulli, per forward).

Memory: one :class:`betty.memory.MemoryMeter` region per part (forward + backward; the
first region also creates the gradients, the last one holds the optimizer step), and
per part the analytic estimate of :func:`betty.rev.memory.estimate_rev_parts` (RevGNN
only: the DEQ variant has no estimator). ``k="auto"`` picks the smallest K whose largest
part fits the budget (:func:`betty.rev.memory.search_k_rev`) at the first split; with
random parts every later epoch's fresh split is estimated against the budget too, and a
split that does not fit runs the search again for that epoch (as the sampled-batch
engine re-partitions a batch whose estimate grew past the budget).
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor, nn

from betty.catalog import CLUSTER_METHODS
from betty.memory.ksearch import check_k, check_safety_margin
from betty.memory.spec import as_optimizer_spec, report_optimizer_spec
from betty.models.dropout import check_dropout, dropout_key, hash_keep_mask
from betty.records import IdleTime, SearchReports, epoch_metrics, estimate_error
from betty.partition.sweep import Split
from betty.rev.sweep import measure_cluster_split, sweep_clusters
from betty.rev.training import GraphPart, backend_graph, cluster_partition, count_train_nodes, edges_kept_fraction
from betty.train import (MicroBatchForward, accumulate_micro_batches, count_correct, largest_peak,
                         locate_non_finite, node_loss_sum, step_over_micro_batches)

__all__ = [
    "CLUSTER_METHODS",
    "DROPOUT_MODES",
    "RevPlan",
    "PartRecord",
    "RevStepResult",
    "RevEpochRecord",
    "RevTrainer",
    "SharedHashMasks",
    "backward_parts",
    "cluster_seed",
    "edges_kept_fraction",
    "estimate_parts",
    "supports_estimate",
    "train_step_parts",
]

DROPOUT_MODES = ("deterministic", "standard")
_PARTITION_STREAM = 0x9A27  # separates the partition seeds from other (seed, epoch) streams


def cluster_seed(seed: int, epoch: int) -> int:
    """Seed of epoch ``epoch``'s random split: a 31-bit hash of ``(seed, epoch)``."""
    return dropout_key(seed, epoch, _PARTITION_STREAM) & 0x7FFFFFFF


@dataclass
class RevPlan:
    """How the graph is split for each step.

    Attributes:
        method: ``"random"`` (fresh every epoch) or ``"metis"`` (once for the run).
        k: number of parts (1: the full graph) or ``"auto"`` (the smallest K whose
            largest part fits ``memory_budget * (1 - safety_margin)``).
        memory_budget: bytes available on the device (needed for ``k="auto"``).
        safety_margin: fraction of the budget kept free.
    """

    method: str = "random"
    k: int | str = 1
    memory_budget: int | None = None
    safety_margin: float = 0.05

    def __post_init__(self) -> None:
        if self.method not in CLUSTER_METHODS:
            raise ValueError(f"method must be one of {CLUSTER_METHODS}, got {self.method!r}")
        check_k(self.k, self.memory_budget)
        check_safety_margin(self.safety_margin)


@dataclass
class PartRecord:
    """One part of one step. ``peak_bytes``: measured (``None`` without a meter or
    when the part was skipped); ``estimated_bytes``: the memory model's estimate."""

    index: int
    num_nodes: int
    num_edges: int
    num_train: int
    loss: float
    time_compute_s: float
    skipped: bool = False
    peak_bytes: int | None = None
    estimated_bytes: int | None = None


@dataclass
class RevStepResult:
    """One optimizer step over the parts.

    Attributes:
        loss: mean training loss over all training nodes (``sum_P loss_P``).
        train_acc: accuracy over the training nodes of the step's forward passes
            (training mode, dropout on); multi-label: the fraction of correct
            (node, task) sign predictions, as :mod:`betty.train` reports it.
        parts: one record per part (skipped parts have no training node).
    """

    loss: float
    train_acc: float
    parts: list[PartRecord] = field(default_factory=list)

    @property
    def time_compute_s(self) -> float:
        return sum(p.time_compute_s for p in self.parts)

    @property
    def peak_bytes(self) -> int | None:
        return largest_peak(self.parts)


@dataclass
class RevEpochRecord(IdleTime):
    """Everything measured in one epoch (one step over K parts)."""

    epoch: int
    loss: float
    train_acc: float
    k: int
    edges_kept_fraction: float
    repartitioned: bool
    time_partition_s: float
    time_compute_s: float
    epoch_time_s: float
    peak_mem_measured_bytes: int | None
    peak_mem_estimated_bytes: int | None
    parts: list[PartRecord] = field(default_factory=list)
    time_wait_s: float = 0.0

    #: What one of :meth:`rows` describes (a RevGNN cluster part), the key naming it in a
    #: row, the memory table's name, and a row's columns.
    MICRO_BATCH_NAME = "part"
    MICRO_BATCH_KEY = "part"
    ROWS_TABLE = "memory_per_part"
    ROW_COLUMNS = ("epoch", "part", "num_nodes", "num_edges", "num_train", "skipped",
                   "peak_bytes", "estimated_bytes", "time_compute_s", "loss")

    def rows(self) -> list[dict]:
        """One row (:attr:`ROW_COLUMNS`) per cluster part this process ran."""
        return [{"epoch": self.epoch, "part": p.index, "num_nodes": p.num_nodes,
                 "num_edges": p.num_edges, "num_train": p.num_train, "skipped": p.skipped,
                 "peak_bytes": p.peak_bytes, "estimated_bytes": p.estimated_bytes,
                 "time_compute_s": p.time_compute_s, "loss": p.loss} for p in self.parts]

    @property
    def mem_estimate_error(self) -> float | None:
        """max over measured parts of |estimated - measured| / measured."""
        return estimate_error((p.estimated_bytes, p.peak_bytes) for p in self.parts)

    def metrics(self) -> dict[str, float]:
        """Per-epoch metrics, named as :meth:`betty.engine.EpochRecord.metrics` where
        they mean the same thing (``loss``, ``train_acc``, ``k``, ``time_partition_s``,
        ``time_compute_s``, ``epoch_time_s``, ``peak_mem_*``, ``mem_estimate_error``),
        plus ``edges_kept_fraction``, ``time_wait_s`` (the step waiting for its parts:
        the split's wall serially, what the preparation thread had not hidden when
        pipelined) and ``time_idle_s``. ``redundancy``, ``time_sample_s`` and
        ``time_block_s`` do not apply (no sampling, every node is loaded once)."""
        return epoch_metrics(self, ("edges_kept_fraction", "time_wait_s", "time_idle_s"))


class SharedHashMasks:
    """A ``mask_fn(shape, node_ids, layer)`` for RevGNN / RevGNNDEQ: RevGNN's dropout
    recipe with masks keyed by global node ID.

    Layers ``< head_layer`` (the blocks; the DEQ cell) share one ``(N, D)`` multiplier
    ``M_b[i, j] = keep(key, 0, ids[i], j) / (1 - p)``; layers ``>= head_layer`` (the
    dropout before the decoder) get ``M_h`` from hash layer 1. Each is computed once per
    node set and cached (one object per part: the reversible backward asks for the mask
    again for every block), so the memory pattern is that of RevGNN's own shared masks
    (two ``(N, D)`` tensors alive for the forward and backward of a part).

    Args:
        p: drop probability in ``[0, 1)``.
        key: the step's dropout key (``dropout_key(seed, epoch)``).
        head_layer: ``num_layers`` for RevGNN, 1 for RevGNNDEQ.
        dtype: multiplier dtype (the model's).
    """

    def __init__(self, p: float, key: int, head_layer: int, dtype: torch.dtype = torch.float32) -> None:
        check_dropout(p, "p")
        self.p, self.key, self.head_layer, self.dtype = float(p), int(key), int(head_layer), dtype
        self._ids: Optional[weakref.ref] = None
        self._cache: dict[int, Tensor] = {}

    def __call__(self, shape: tuple[int, int], node_ids: Tensor, layer: int) -> Tensor:
        which = 0 if layer < self.head_layer else 1
        if self._ids is None or self._ids() is not node_ids:
            self._ids, self._cache = weakref.ref(node_ids), {}
        mask = self._cache.get(which)
        if mask is None or tuple(mask.shape) != tuple(shape):
            mult = hash_keep_mask(node_ids, int(shape[1]), self.p, self.key, which).to(self.dtype)
            mask = self._cache[which] = mult.mul_(1.0 / (1.0 - self.p))
        return mask

    def clear(self) -> None:
        """Drop the cached masks (call after a part's backward)."""
        self._ids, self._cache = None, {}


def backward_parts(
    model: nn.Module,
    parts: Sequence[GraphPart],
    feat: Tensor,
    label: Tensor,
    train_mask: Tensor,
    *,
    multilabel: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    mask_factory: Optional[Callable[[], Callable]] = None,
    meter: Any = None,
    after_last: Optional[Callable[[], None]] = None,
    indices: Optional[Sequence[int]] = None,
    loss_fn: Optional[Callable[[Tensor, Tensor], Tensor]] = None,
) -> tuple[list[PartRecord], float]:
    """Forward and backward of every part with training nodes, accumulating into
    ``.grad`` (no zeroing, no optimizer step): :func:`betty.train.accumulate_micro_batches`
    with this engine's forward of one part.

    Args:
        model: called as ``model(part.graph, x, node_ids=ids[, mask_fn=...])`` ``->
            (n_part, C)``; put in training mode here.
        parts: node-disjoint parts (``node_ids`` global, increasing).
        feat, label, train_mask: ``(N, F)``, ``(N,)`` int64 / ``(N, T)``, ``(N,)`` bool,
            global order (host tensors; slices are moved to ``device``).
        multilabel: BCE over tasks instead of cross-entropy.
        device, dtype: where and in which dtype the model runs (default: ``feat``'s).
        mask_factory: returns a fresh ``mask_fn`` for each part (``None``: the model's
            own dropout).
        meter: a :class:`betty.memory.MemoryMeter`; one region per part that runs.
        after_last: called inside the last running part's region, after its backward
            (the optimizer step, so its temporaries are measured).
        indices: the records' ``index`` of each part (default ``0..len(parts)-1``; a
            rank's share of a split keeps the split's numbering).
        loss_fn: the summed loss over a part's training rows, ``loss_fn(out, target)``
            (must sum: ``reduction='sum'``; default
            :func:`betty.train.node_loss_sum`, cross-entropy or multi-label BCE).

    Returns:
        ``(records, correct)``: one :class:`PartRecord` per part (loss = ``loss_P``) and
        the summed correct count over training nodes (see :class:`RevStepResult`).
    """
    if loss_fn is not None and getattr(loss_fn, "reduction", "sum") != "sum":
        raise ValueError(f"loss_fn must sum over rows (reduction='sum'), got reduction="
                         f"{loss_fn.reduction!r}: the step divides by the training nodes itself")
    n_train = count_train_nodes(train_mask)
    device = torch.device(device) if device is not None else feat.device
    indices = list(range(len(parts))) if indices is None else [int(i) for i in indices]
    model.train()
    counts = [int(train_mask[p.node_ids.to(train_mask.device)].sum()) for p in parts]
    records = [PartRecord(index=i, num_nodes=int(part.graph.num_nodes()),
                          num_edges=int(part.graph.num_edges()), num_train=c, loss=0.0,
                          time_compute_s=0.0, skipped=c == 0)
               for i, part, c in zip(indices, parts, counts)]
    running = [(pos, part) for pos, (part, c) in enumerate(zip(parts, counts)) if c > 0]

    def correct_of(out: Tensor, ids: Tensor) -> float:
        local_train = train_mask[ids].to(device)
        return count_correct(out.detach()[local_train], label[ids].to(device)[local_train], multilabel)

    def forward(part: GraphPart) -> MicroBatchForward:
        ids = part.node_ids.to(feat.device)
        local_train = train_mask[ids].to(device)
        x = feat[ids].to(device)
        if dtype is not None and x.dtype != dtype:
            x = x.to(dtype)
        kwargs: dict[str, Any] = {"node_ids": ids.to(device)}
        mask_fn = mask_factory() if mask_factory is not None else None
        if mask_fn is not None:
            kwargs["mask_fn"] = mask_fn
        out = model(part.graph.to(device), x, **kwargs)
        target = label[ids].to(device)[local_train]
        loss_sum = (loss_fn(out[local_train], target) if loss_fn is not None
                    else node_loss_sum(out[local_train], target, multilabel))
        del target, local_train  # not held through the backward: counted again after it
        return MicroBatchForward(
            loss_sum=loss_sum,
            count_correct=lambda: correct_of(out, ids),
            keep=(ids, x, kwargs),
            release=mask_fn.clear if mask_fn is not None and hasattr(mask_fn, "clear") else None)

    runs = accumulate_micro_batches(running, forward, n_train, meter=meter,
                                    last_index=running[-1][0] if running else None, after_last=after_last)
    for run in runs:
        rec = records[run.index]
        rec.loss, rec.peak_bytes, rec.time_compute_s = run.loss, run.peak_bytes, run.seconds
    return records, sum(run.correct for run in runs)


def train_step_parts(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    parts: Sequence[GraphPart],
    feat: Tensor,
    label: Tensor,
    train_mask: Tensor,
    *,
    parallel: Any = None,
    costs: Optional[Sequence[float]] = None,
    clip_grad_norm: Optional[float] = None,
    **kwargs: Any,
) -> RevStepResult:
    """One optimizer step with the gradients accumulated over the parts: ``zero_grad``
    -> :func:`backward_parts` -> one ``optimizer.step()`` (inside the last part's meter
    region): :func:`betty.train.step_over_micro_batches`.

    For part ``P`` with training nodes ``T_P`` (``T`` = all training nodes):

        loss_P = sum_{v in T_P} loss(out_v, y_v) / |T|,    grad = sum_P d loss_P / d theta

    so the step equals the step on one part holding the whole graph when no edge
    crosses parts.

    ``parallel``: a :class:`betty.distributed.DataParallel`: this rank runs its share of
    the parts (assigned by ``costs`` (K,), default each part's nodes + edges), gradients
    are all-reduced before the step (outside the meter regions), and the loss and
    accuracy are summed over the ranks (``parts`` lists this rank's).
    ``clip_grad_norm``: clip the accumulated gradient's norm before the step (one
    process). Other keyword arguments: those of :func:`backward_parts` (``after_last``,
    ``indices`` excepted).
    """
    if parallel is not None and costs is None:
        costs = [float(p.graph.num_nodes() + p.graph.num_edges()) for p in parts]
    if parallel is not None and clip_grad_norm is not None:
        raise ValueError("clip_grad_norm is for one process: the ranks' gradients are "
                         "all-reduced after the parts")

    def run(mine, after_last):
        chosen = range(len(parts)) if mine is None else sorted(mine)

        def clip_then_step() -> None:
            nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
            after_last()

        step = clip_then_step if clip_grad_norm is not None else after_last
        records, correct = backward_parts(model, [parts[i] for i in chosen], feat, label,
                                          train_mask, after_last=step, indices=chosen,
                                          **kwargs)
        return records, sum(r.loss for r in records), correct

    records, loss, correct = step_over_micro_batches(model, optimizer, run, parallel=parallel,
                                                     costs=costs, step_in_last_region=True)
    return RevStepResult(loss=loss, train_acc=correct / int(train_mask.sum()), parts=records)


def supports_estimate(model: nn.Module) -> bool:
    """Whether :mod:`betty.rev.memory` can estimate ``model`` (a RevGNN on either
    backend, not the DEQ)."""
    from betty.rev.model import RevGNN

    return isinstance(model, RevGNN)


def estimate_parts(model: nn.Module, optimizer: torch.optim.Optimizer, parts: Sequence[GraphPart],
                   train_mask: Tensor, **memory_kwargs: Any) -> list[int]:
    """Estimated peak bytes of every part's step (:func:`betty.rev.memory.estimate_rev_parts`;
    ``memory_kwargs``: ``dtype``, ``backend``, ``label_columns``, ``feat_dtype``,
    ``masks_held``, and ``first_step``, ``step_in_region`` for the optimizer's first step)."""
    from betty.rev.memory import estimate_rev_parts

    return [int(e.peak) for e in estimate_rev_parts(parts, model, train_mask=train_mask,
                                                    optimizer=optimizer, **memory_kwargs)]


def _no_batch(batch: Any) -> None:
    if batch is not None:
        raise ValueError("RevGNN samples no batches: it splits the whole graph into cluster parts; "
                         "leave batch out")


class RevTrainer(SearchReports):
    """Epochs of RevGNN training on one dataset: one optimizer step per epoch,
    accumulated over the plan's K parts.

    Args:
        model: a :class:`~betty.rev.model.RevGNN` or
            :class:`~betty.rev.deq.RevGNNDEQ` on ``device``.
        optimizer: its optimizer.
        dataset: a :class:`betty.data.GraphDataset`.
        plan: the split (:class:`RevPlan`).
        device: where parts run.
        seed: seeds the splits (random: :func:`cluster_seed` ``(seed, epoch)``; METIS:
            ``seed``).
        dropout_seed: seeds the dropout masks (default ``seed``).
        dtype: compute dtype.
        dropout_mode: ``"deterministic"`` (:class:`SharedHashMasks`) or ``"standard"``.
        meter: optional :class:`betty.memory.MemoryMeter` (one region per part).
        estimate_memory: estimate every part (RevGNN only; ignored for the DEQ).
        on_search: called with the :class:`betty.rev.memory.RevKSearchResult` of every
            K search of ``k="auto"`` when its epoch trains (:class:`betty.records.SearchReports`);
            the latest is kept as ``search_result``.
        parallel: a :class:`betty.distributed.DataParallel`: spread the parts over its
            ranks and all-reduce the gradients (every rank builds the same trainer).
        prefetch: ``0`` (default): each epoch's parts are split when its step starts;
            ``n >= 1``: a preparation thread splits up to ``n`` epochs ahead (:meth:`epochs`).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, dataset, plan: RevPlan, *,
                 device: torch.device | str = "cpu", seed: int = 0, dropout_seed: int | None = None,
                 dtype: torch.dtype = torch.float32, dropout_mode: str = "deterministic",
                 meter: Any = None, estimate_memory: bool = True,
                 on_search: Optional[Callable[[Any], None]] = None, parallel: Any = None,
                 precision: Any = None, prefetch: int = 0) -> None:
        from betty.precision import Precision, check_parameter_dtype

        if precision is not None and Precision.parse(precision).mixed:
            raise ValueError(f"train.precision {Precision.parse(precision)} is not supported for "
                             "model.arch revgnn: its backward rebuilds each block's input by "
                             "inverting the coupling, which is exact only in the forward's own "
                             "dtype; use train.precision 32 or 64")
        if dropout_mode not in DROPOUT_MODES:
            raise ValueError(f"dropout_mode must be one of {DROPOUT_MODES}, got {dropout_mode!r}")
        if not hasattr(model, "dropout") or not hasattr(model, "encoder"):
            raise TypeError(f"model must be a RevGNN or RevGNNDEQ, got {type(model).__name__}")
        check_parameter_dtype(model, dtype)
        can_estimate = supports_estimate(model)
        if plan.k == "auto" and not can_estimate:
            raise ValueError(f"k='auto' needs the reversible memory estimator, which does not "
                             f"model {type(model).__name__}; give an integer k")
        from betty.memory import default_backend

        self.model, self.optimizer, self.dataset, self.plan = model, optimizer, dataset, plan
        self.device, self.seed, self.dtype = torch.device(device), seed, dtype
        self.dropout_seed = seed if dropout_seed is None else dropout_seed
        self.dropout_mode, self.meter, self.on_search = dropout_mode, meter, on_search
        self.parallel = parallel
        from betty.pipeline import check_prefetch

        self.prefetch = check_prefetch(prefetch)
        self.estimate_memory = estimate_memory and can_estimate
        if self.estimate_memory:
            as_optimizer_spec(optimizer)  # an optimizer the memory model does not know: refused now
        elif plan.memory_budget is not None:
            why = ("estimate_memory=False" if can_estimate
                   else f"the memory model does not cover {type(model).__name__}")
            raise ValueError(f"a memory_budget needs the memory estimates ({why}): without them no "
                             "split is held to the budget")
        self.train_mask = torch.zeros(dataset.num_nodes, dtype=torch.bool)
        self.train_mask[dataset.train_idx] = True
        self.memory_kwargs = dict(dtype=dtype, backend=default_backend(self.device),
                                  feat_dtype=dataset.feat.dtype,
                                  label_columns=dataset.num_classes if dataset.multilabel else 0,
                                  masks_held=dropout_mode == "deterministic")  # SharedHashMasks cache
        self.k: int | None = None if plan.k == "auto" else int(plan.k)
        self.last_split_times: dict[str, float | None] = {}
        self._fixed: tuple[list[GraphPart], list[int] | None] | None = None
        self._warned_idle = False
        if plan.memory_budget is not None and self.device.type == "cuda":
            from betty.memory import apply_budget

            apply_budget(self.device, plan.memory_budget)

    @property
    def parallel(self) -> Any:
        """The :class:`betty.distributed.DataParallel` the parts are spread over (``None``:
        one process). A model with batch normalisation is refused on several ranks: each
        rank would update the running statistics from its own parts only, so the ranks'
        models would drift apart and from the one-process model."""
        return self._parallel

    @parallel.setter
    def parallel(self, value: Any) -> None:
        if value is not None and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.model.modules()):
            raise ValueError("batch normalisation (model.norm: batch) cannot train on several ranks: each "
                             "rank would update its running statistics from its own parts only; use "
                             "norm 'layer' or 'none'")
        self._parallel = value

    # -- splits ---------------------------------------------------------------------
    @property
    def head_layer(self) -> int:
        """The mask_fn layer of the decoder dropout (RevGNN: L; DEQ: 1)."""
        return int(getattr(self.model, "num_layers", 1)) if supports_estimate(self.model) else 1

    def _search(self, epoch: int) -> list[GraphPart]:
        from betty.rev.memory import search_k_rev

        result = search_k_rev(backend_graph(self.model, self.dataset.graph), self.model, int(self.plan.memory_budget),
                              method=self.plan.method, seed=self._split_seed(epoch),
                              train_mask=self.train_mask, safety_margin=self.plan.safety_margin,
                              optimizer=self.optimizer, **self.memory_kwargs)  # from K = 1 on any ranks:
        # K is part of the RevGNN model (edges between parts are dropped); ranks beyond K wait
        self.k, self._pending_search = result.k, result
        return list(result.parts)

    def _split_seed(self, epoch: int) -> int:
        if self.plan.method == "random":
            return cluster_seed(self.seed, epoch)
        return self.seed & 0x7FFFFFFF

    @property
    def repartitions(self) -> bool:
        """Whether every epoch draws a new split (random clusters with K > 1)."""
        return self.plan.method == "random" and (self.k is None or self.k > 1)

    def split(self, epoch: int) -> tuple[list[GraphPart], list[int] | None, bool]:
        """``(parts, per-part estimated bytes or None, whether the split is new)`` of
        epoch ``epoch`` (the K search runs at the first call with ``k="auto"``, and is
        reported at once: :attr:`search_result`, ``on_search``).
        ``last_split_times`` then holds ``partition_s`` (the split), ``estimate_s`` (the
        memory estimates) and ``ksearch_s`` (the K search, which includes both; ``None``
        without one)."""
        out = self._split(epoch)
        self._report_search(self._take_search())
        return out

    def _split(self, epoch: int) -> tuple[list[GraphPart], list[int] | None, bool]:
        """:meth:`split` with its K search left pending (:meth:`prepare` hands it to the
        epoch it split, which reports it when it trains: an epoch prepared ahead that
        never trains reports none)."""
        if self._fixed is not None and not self.repartitions:
            parts, estimates = self._fixed
            self.last_split_times = {"partition_s": 0.0, "estimate_s": 0.0, "ksearch_s": None}
            return parts, estimates, False
        start = time.perf_counter()
        searched = self.k is None
        if searched:
            parts = self._search(epoch)
        else:
            parts = cluster_partition(backend_graph(self.model, self.dataset.graph), self.k, self.plan.method, self._split_seed(epoch))
        took = time.perf_counter() - start
        estimates = self._pending_search.estimates if searched else None
        if estimates:
            estimates = [int(e.peak) for e in estimates]
        elif self.plan.k == "auto":  # re-check every fresh split against the budget
            estimates = estimate_parts(self.model, self.optimizer, parts, self.train_mask,
                                       **self.memory_kwargs)
        else:
            estimates = self.estimate(parts)
        estimate_s = time.perf_counter() - start - took
        if not searched and self.plan.k == "auto" and max(estimates) > self._usable_budget():
            parts = self._search(epoch)  # this epoch's split grew past the budget
            estimates = [int(e.peak) for e in self._pending_search.estimates]
            searched, took = True, time.perf_counter() - start
        self.last_split_times = {"partition_s": 0.0 if searched else took,
                                 "estimate_s": 0.0 if searched else estimate_s,
                                 "ksearch_s": took if searched else None}
        if not self.repartitions:
            self._fixed = (parts, estimates)
        return parts, estimates, True

    def _usable_budget(self) -> float:
        return float(self.plan.memory_budget) * (1.0 - self.plan.safety_margin)

    def estimate(self, parts: Sequence[GraphPart]) -> list[int] | None:
        """Per-part estimated peak bytes (``None`` when not estimated)."""
        if not self.estimate_memory:
            return None
        return estimate_parts(self.model, self.optimizer, parts, self.train_mask, **self.memory_kwargs)

    def measure_split(self, batch: None = None) -> Split:
        """Epoch 0's split of the graph, measured as
        :func:`betty.rev.sweep.measure_cluster_split` measures it (``batch``: the sampled
        engine's argument; RevGNN samples none, so it must stay ``None``)."""
        _no_batch(batch)
        return measure_cluster_split(self)

    def sweep(self, ks: Sequence[int], methods: Sequence[str] | None = None, *, batch: None = None,
              **options: Any) -> tuple[list[dict], dict[str, str]]:
        """The graph split by every cluster method at every K of ``ks``:
        :func:`betty.rev.sweep.sweep_clusters` (``options``: its ``seed``,
        ``time_limit_s``, ``max_k``, ``progress``, ``on_skip``), rows with the columns
        :data:`betty.rev.sweep.CLUSTER_SWEEP_COLUMNS`."""
        _no_batch(batch)
        return sweep_clusters(self, ks, methods, **options)

    def memory_report(self, measure: bool = False) -> dict:
        """The memory model's view of the first epoch's split, as
        :meth:`betty.engine.Trainer.memory_report`: epoch 0's K parts (:meth:`split`: the
        K search runs here with ``k="auto"``), each part estimated by component
        (:func:`betty.rev.memory.estimate_rev_parts` with :attr:`memory_kwargs`; the
        optimizer's steady state) and, with ``measure``, measured once on ``device``.

        Measuring trains the model: two real optimizer steps over the parts
        (:func:`train_step_parts` with epoch 0's dropout masks), the first so that the
        optimizer state exists, the second measured, one
        :class:`betty.memory.MemoryMeter` region per part (the last one holds the
        optimizer step, as in training). The parameters and the optimizer state are
        left two steps on, not restored. It runs in this process (no ``parallel``).

        Returns:
            :func:`betty.memory.report.split_report`'s dict (bytes as ints, errors as
            fractions): ``method``, ``k`` (parts), ``backend``, ``num_nodes_per_part``,
            ``memory_budget_bytes``, ``safety_margin``, ``max_estimated_peak_bytes``,
            ``micro_batches`` (per part ``index``, ``estimated_peak_bytes``,
            ``components``; with ``measure`` ``measured_peak_bytes`` and
            ``relative_error``, ``None`` for a part without training nodes), with
            ``measure`` ``max_measured_peak_bytes`` and ``max_abs_relative_error``, and
            ``k_tried`` when this call ran the K search
            (``RevKSearchResult.to_dict()["tried"]``).

        Raises:
            ValueError: the model has no estimator (the DEQ variant).
        """
        from betty.memory import MemoryMeter, split_report
        from betty.rev.memory import estimate_rev_parts

        if not supports_estimate(self.model):
            raise ValueError("the memory model does not cover this reversible variant "
                             "(model.deq: true has no estimator)")
        report_optimizer_spec(self.optimizer)
        searched = self.search_result
        parts, _, _ = self.split(0)
        estimates = estimate_rev_parts(parts, self.model, train_mask=self.train_mask,
                                       optimizer=self.optimizer, **self.memory_kwargs)
        measured = None
        if measure:
            meter = MemoryMeter(self.device)
            meter.track(self.model, self.optimizer)
            common = dict(multilabel=self.dataset.multilabel, device=self.device, dtype=self.dtype,
                          mask_factory=self.mask_factory(0))
            args = (self.model, self.optimizer, parts, self.dataset.feat, self.dataset.label, self.train_mask)
            train_step_parts(*args, **common)  # the optimizer state
            measured = [r.peak_bytes for r in train_step_parts(*args, meter=meter, **common).parts]
        return split_report(estimates, method=self.plan.method, k=len(parts), backend=self.memory_kwargs["backend"],
                            memory_budget=self.plan.memory_budget, safety_margin=self.plan.safety_margin,
                            sizes={"num_nodes_per_part": [int(p.node_ids.numel()) for p in parts]},
                            measured=measured, micro_batch_name=RevEpochRecord.MICRO_BATCH_NAME,
                            search=self.search_result if self.search_result is not searched else None)

    def mask_factory(self, epoch: int) -> Optional[Callable[[], SharedHashMasks]]:
        """A fresh :class:`SharedHashMasks` per part (deterministic dropout with p > 0)."""
        p = float(self.model.dropout)
        if self.dropout_mode != "deterministic" or p == 0.0:
            return None
        key, head, dtype = dropout_key(self.dropout_seed, epoch), self.head_layer, self.dtype
        return lambda: SharedHashMasks(p, key, head, dtype)

    # -- epochs ---------------------------------------------------------------------
    def prepare(self, epoch: int) -> tuple[list[GraphPart], list[int] | None, bool, float, Any]:
        """``(parts, per-part estimates or None, whether the split is new, seconds, the K
        search or None)`` of epoch ``epoch``: :meth:`split` (its K search reported when
        the epoch trains), and the check of a fixed K against the budget.
        Reads the graph and this trainer's split state, never the model's parameters;
        run in epoch order it gives the same parts at any time.

        Raises:
            betty.memory.ksearch.BudgetExceeded: a fixed K whose largest part is
                estimated past the memory budget.
        """
        from betty.memory.ksearch import check_fixed_k

        start = time.perf_counter()
        parts, estimates, fresh = self._split(epoch)
        search = self._take_search()
        if estimates and self.plan.k != "auto" and self.plan.memory_budget is not None:
            check_fixed_k(estimates, len(parts), self.plan.memory_budget, self.plan.safety_margin,
                          micro_batch_name="part")
        return parts, estimates, fresh, time.perf_counter() - start, search

    def epochs(self, epochs: Iterable[int],
               progress: Optional[Callable[[int, int], None]] = None) -> Iterator[RevEpochRecord]:
        """Train ``epochs`` one after the other, yielding each one's record when it ends.

        With ``prefetch = n >= 1`` a preparation thread (:class:`betty.pipeline.Prefetcher`)
        splits the graph (:meth:`prepare`) up to ``n`` epochs ahead of the step: with
        random clusters a fresh split per epoch is drawn while the previous epoch trains.
        The parts and updates are the serial loop's, bit for bit; leaving the loop early
        stops the thread.
        """
        from betty.pipeline import preparation

        epochs = list(epochs)
        with preparation(epochs, self.prepare, self.prefetch) as source:
            for epoch in epochs:
                start, waited = time.perf_counter(), source.wait_s
                _, prepared = next(source)
                yield self._train_split(epoch, prepared, start, source.wait_s - waited, progress)

    def train_epoch(self, epoch: int, progress: Optional[Callable[[int, int], None]] = None) -> RevEpochRecord:
        """One epoch = one optimizer step over the epoch's parts; ``progress(1, 1)`` is
        called after the step."""
        return next(self.epochs([epoch], progress))

    def _train_split(self, epoch: int, prepared, start: float, wait: float,
                     progress: Optional[Callable[[int, int], None]]) -> RevEpochRecord:
        """The optimizer step of ``epoch`` over its :meth:`prepare`'d parts (``start``:
        the epoch's start on the clock; ``wait``: seconds spent waiting for the parts)."""
        from betty.memory import oom_guard

        parts, estimates, fresh, t_split, search = prepared
        self._report_search(search)
        ds = self.dataset
        if self.parallel is not None and len(parts) < self.parallel.world_size and not self._warned_idle:
            self._warned_idle = True
            warnings.warn(f"{len(parts)} cluster part(s) for {self.parallel.world_size} ranks: "
                          f"{self.parallel.world_size - len(parts)} rank(s) have no part; K is part of the "
                          "RevGNN model (edges between parts are dropped), so more ranks do not raise it",
                          stacklevel=3)
        had_state = bool(self.optimizer.state)
        with oom_guard(estimates or [], self.plan.memory_budget), locate_non_finite(epoch, micro_batch_name="part"):
            step_kwargs = dict(multilabel=ds.multilabel, device=self.device, dtype=self.dtype,
                               mask_factory=self.mask_factory(epoch), meter=self.meter)
            step = train_step_parts(self.model, self.optimizer, parts, ds.feat, ds.label,
                                    self.train_mask, parallel=self.parallel,
                                    costs=estimates if self.parallel is not None else None, **step_kwargs)
        logged = estimates
        if estimates is not None and not had_state:
            # before the first step the optimizer holds no state: log the estimate of
            # what actually ran, the parts without the state and the one whose region
            # holds the step (in one process: the last running part) with the state the
            # step creates and its temporaries (the K search and the budget checks keep
            # the steady-state estimate, which is never below it)
            logged = estimate_parts(self.model, self.optimizer, parts, self.train_mask, first_step=True,
                                    step_in_region=self.parallel is None, **self.memory_kwargs)
        if logged is not None:
            for rec in step.parts:
                rec.estimated_bytes = logged[rec.index]
            logged = [rec.estimated_bytes for rec in step.parts]  # this process's parts
        if progress is not None:
            progress(1, 1)
        return RevEpochRecord(
            epoch=epoch, loss=step.loss, train_acc=step.train_acc, k=len(parts),
            edges_kept_fraction=edges_kept_fraction(parts, ds.num_edges), repartitioned=fresh,
            time_partition_s=t_split, time_compute_s=step.time_compute_s, time_wait_s=wait,
            epoch_time_s=time.perf_counter() - start, peak_mem_measured_bytes=step.peak_bytes,
            peak_mem_estimated_bytes=max(logged) if logged else None, parts=step.parts)
