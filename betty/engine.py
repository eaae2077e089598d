"""The epoch loop: sample, partition, train with exact accumulation, measure.

One *epoch* runs over the training nodes in one or more *batches* (one batch, the
whole training set, by default: Betty's full-batch setting). Each batch is sampled once,
split into K micro-batches, and turned into exactly one optimizer step.

Batches are a fixed, seeded split of the training nodes (so a batch's output nodes are
the same every epoch and its partition can be reused); their order is reshuffled each
epoch. Sampling is re-done every epoch with seed ``(seed, epoch, batch index)``.

Partition reuse (``reuse``): the output nodes of a batch never change, only their
sampled neighbours do, so a partition can be kept for ``reuse`` epochs (``None``:
forever) and applied to each fresh sample; micro-batch blocks are always carved from
the current sample.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from betty.batch import SampledBatch
from betty.checks import is_integer
from betty.memory import (DEFAULT_SAFETY_MARGIN, MemoryMeter, OptimizerSpec, apply_budget, default_backend,
                          estimate_micro_batches, make_estimator, make_k_chooser, memory_balance_weights, oom_guard,
                          split_report)
from betty.memory.estimator import persistent_bytes, step_bytes
from betty.memory.ksearch import check_fixed_k, check_k, check_safety_margin, check_step_fits
from betty.memory.replay import replays_mixed_precision
from betty.memory.spec import ModelSpec, report_optimizer_spec
from betty.memory.sizes import carved_split_sizes
from betty.models.dropout import dropout_key
from betty.partition import PartitionResult, partition_batch
from betty.partition.base import CUT_STRUCTURES
from betty.partition.metrics import split_metrics
from betty.partition.sweep import Split, measure_batch_split, sweep_batch
from betty.pipeline import check_prefetch, preparation
from betty.precision import LossScaler, Precision, check_parameter_dtype
from betty.records import IdleTime, SearchReports, epoch_metrics, estimate_error
from betty.sampling import check_fanouts, sample_full_batch
from betty.train import (MicroBatchRecord, accumulate_gradients, host_rows, locate_non_finite, same_device,
                         train_step)

__all__ = ["PartitionPlan", "check_plan", "EpochRecord", "BatchRecord", "PreparedBatch", "Trainer", "fixed_batches",
           "PREPARATION_TIMERS"]

#: The sampled-batch epoch's own timers (beyond the shared ``time_partition_s``,
#: ``time_compute_s``, ``epoch_time_s``): see :class:`EpochRecord`.
PREPARATION_TIMERS = ("time_sample_s", "time_estimate_s", "time_block_s", "time_metrics_s",
                      "time_h2d_s", "time_wait_s", "time_idle_s")


@dataclass
class PartitionPlan:
    """How each batch is split.

    Attributes:
        method: a registered partitioner name.
        k: number of micro-batches, or ``"auto"`` (search K with the memory model so the
            largest micro-batch fits ``memory_budget * (1 - safety_margin)``). A batch
            with fewer output nodes than a fixed ``k`` (the last, smaller batch of an
            epoch) gets one micro-batch per output node.
        reuse: keep a batch's partition for this many epochs (``None``: for the run).
        balance: ``"nodes"`` (equal output nodes per micro-batch) or ``"memory"`` (equal
            estimated memory per micro-batch).
        memory_budget: bytes available on the device (needed for ``k="auto"``).
        safety_margin: fraction of the budget kept free.
        options: method options for :func:`betty.partition.partition_batch` (e.g.
            ``time_limit_s``, ``deterministic``, ``threads`` for ``hypergraph``).
        min_k: smallest K the search (``k="auto"``) may choose; a data-parallel
            :class:`Trainer` raises it to its world size (K >= N ranks).
    """

    method: str = "random"
    k: int | str = 1
    reuse: int | None = None
    balance: str = "nodes"
    memory_budget: int | None = None
    safety_margin: float = DEFAULT_SAFETY_MARGIN
    options: dict = field(default_factory=dict)
    min_k: int = 1


def check_plan(plan: PartitionPlan) -> None:
    """Refuse a :class:`PartitionPlan` that could only fail later, on the preparation
    thread: an unknown method or option, a K that is neither an integer >= 1 nor
    ``"auto"`` (then with a memory budget), a ``reuse`` or ``min_k`` below 1, a
    ``balance`` other than ``nodes``/``memory``, a safety margin outside [0, 1)."""
    from betty.partition import PARTITIONERS
    from betty.partition.base import check_options

    if plan.method not in PARTITIONERS:
        raise ValueError(f"unknown partition method {plan.method!r}; allowed: {sorted(PARTITIONERS)}")
    check_k(plan.k, plan.memory_budget)
    if plan.reuse is not None and not (is_integer(plan.reuse) and plan.reuse >= 1):
        raise ValueError(f"reuse must be an integer >= 1 (epochs) or None, got {plan.reuse!r}")
    if not (is_integer(plan.min_k) and plan.min_k >= 1):
        raise ValueError(f"min_k must be an integer >= 1, got {plan.min_k!r}")
    if plan.balance not in ("nodes", "memory"):
        raise ValueError(f"balance must be 'nodes' or 'memory', got {plan.balance!r}")
    check_safety_margin(plan.safety_margin)
    check_options(plan.options)


STATE_STEP_TRIES = 32
"""Steps :meth:`Trainer.memory_report` tries to make the optimizer's state (a 16-mixed
loss scaler halves its scale after each skipped one)."""


@dataclass
class BatchRecord:
    """One batch (= one optimizer step) of an epoch."""

    index: int
    k: int
    loss: float
    train_acc: float
    num_outputs: int
    redundancy: float
    repartitioned: bool
    time_sample_s: float
    time_partition_s: float
    time_block_s: float
    time_compute_s: float
    peak_mem_measured_bytes: int | None
    peak_mem_estimated_bytes: int | None
    micro: list[MicroBatchRecord] = field(default_factory=list)
    micro_estimated_bytes: list[int] | None = None
    time_estimate_s: float = 0.0
    time_metrics_s: float = 0.0
    time_h2d_s: float = 0.0


@dataclass
class PreparedBatch:
    """One batch made ready for its optimizer step: everything the step needs that
    does not depend on the model's parameters (made ahead of the step when the
    :class:`Trainer` pipelines).

    Attributes:
        epoch, index: which batch of which epoch.
        batch: the sampled full batch.
        partition: its split into ``partition.k`` micro-batches.
        estimates: per-micro-batch estimated peak bytes (K,), or ``None`` without an estimator.
        fresh: whether the partition was (re)computed for this batch.
        redundancy: :func:`betty.partition.metrics.split_metrics`'s ``redundancy``.
        micro_batches: ``(index, micro-batch, seconds to carve it)`` of the micro-batches this
            process runs, carved ahead; ``None``: carved one at a time during the step.
        nbytes: host bytes of the batch's tensors and of its carved micro-batches.
        time_sample_s, time_partition_s, time_estimate_s, time_metrics_s: wall of each
            preparation step (the partition's without the estimates made outside the
            K search).
        time_gather_s: wall of gathering the carved micro-batches' input features
            ahead (``MicroBatch.input_features``; 0 when the step gathers them).
        carve_batch: the batch the step carves its micro-batches from: with preparation
            on a device (``Trainer(sample_device=)``) the batch as sampled there, whose
            host copy is ``batch``; else ``batch`` itself (``None`` once the step took it).
        search: the :class:`betty.memory.KSearchResult` of the K search that split it
            (``None``: none ran), reported when the batch trains.
    """

    epoch: int
    index: int
    batch: SampledBatch
    partition: PartitionResult
    estimates: list[int] | None
    fresh: bool
    redundancy: float
    micro_batches: list | None
    nbytes: int
    time_sample_s: float
    time_partition_s: float
    time_estimate_s: float
    time_metrics_s: float
    time_gather_s: float = 0.0
    carve_batch: SampledBatch | None = None
    search: Any = None


def _tensor_bytes(obj) -> int:
    """Bytes of the tensors reachable from ``obj`` through dataclass fields, lists,
    tuples and dicts (each storage counted once)."""
    seen: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend(getattr(item, f.name) for f in dataclasses.fields(item))
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return total


@dataclass
class EpochRecord(IdleTime):
    """Everything measured in one epoch (sums/maxima over its batches).

    Wall-clock timers (seconds, summed over the epoch's batches), each step once:
    ``time_sample_s`` (neighbour sampling), ``time_partition_s`` (the cut, or the K
    search with its estimates; ~0 when a partition is reused), ``time_estimate_s``
    (the memory estimates made outside the K search: the check of a reused partition,
    the per-micro-batch estimate logged next to the measurement), ``time_block_s`` (carving
    the K micro-batches and building their backend blocks on the device),
    ``time_metrics_s`` (the redundancy metric, :func:`betty.partition.metrics.split_metrics`),
    ``time_h2d_s`` (gathering each micro-batch's features and labels and copying them
    to the device), ``time_compute_s`` (forward, backward and, in one process, optimizer step) and
    ``time_idle_s = epoch_time_s - time_compute_s`` (the epoch's wall not spent
    computing: the device waiting). ``time_wait_s`` is the part of the epoch the
    training loop spent waiting for a prepared batch. Serially (``prefetch=0``) the
    first seven are disjoint parts of ``epoch_time_s``, so their sum is at most it, and
    ``time_wait_s`` is about the preparation's share; pipelined, sampling, partitioning,
    the estimates, the metric and the carving (and with ``gather_ahead`` the host side
    of ``time_h2d_s``, the feature gather) run on the preparation thread, behind
    compute, and only ``time_wait_s`` of them shows in the epoch's wall.
    ``prefetch_bytes``: the most host bytes of prepared batches alive at once (0 serially).
    """

    epoch: int
    loss: float
    train_acc: float
    k: int
    redundancy: float
    time_sample_s: float
    time_partition_s: float
    time_block_s: float
    time_compute_s: float
    epoch_time_s: float
    peak_mem_measured_bytes: int | None
    peak_mem_estimated_bytes: int | None
    batches: list[BatchRecord] = field(default_factory=list)
    time_estimate_s: float = 0.0
    time_metrics_s: float = 0.0
    time_h2d_s: float = 0.0
    time_wait_s: float = 0.0
    prefetch_bytes: int = 0

    #: What one of :meth:`rows` describes, the key naming it in a row, the memory
    #: table's name, and a row's columns.
    MICRO_BATCH_NAME = "micro-batch"
    MICRO_BATCH_KEY = "micro"
    ROWS_TABLE = "memory_per_microbatch"
    ROW_COLUMNS = ("epoch", "batch", "micro", "num_outputs", "num_inputs", "num_edges",
                   "peak_bytes", "estimated_bytes", "time_block_s", "time_compute_s", "loss")

    def rows(self) -> list[dict]:
        """One row (:attr:`ROW_COLUMNS`) per micro-batch this process ran: its sizes,
        measured and estimated peak bytes (``None`` where not known), times and loss."""
        out = []
        for b in self.batches:
            estimates = b.micro_estimated_bytes or [None] * len(b.micro)
            for m, est in zip(b.micro, estimates):
                out.append({"epoch": self.epoch, "batch": b.index, "micro": m.index,
                            "num_outputs": m.num_outputs, "num_inputs": m.num_inputs,
                            "num_edges": m.num_edges, "peak_bytes": m.peak_bytes, "estimated_bytes": est,
                            "time_block_s": m.time_block_s, "time_compute_s": m.time_compute_s,
                            "loss": m.loss})
        return out

    @property
    def mem_estimate_error(self) -> float | None:
        """max over micro-batches of |estimated - measured| / measured."""
        return estimate_error((est, m.peak_bytes) for b in self.batches
                              if b.micro_estimated_bytes is not None
                              for m, est in zip(b.micro, b.micro_estimated_bytes))

    def metrics(self) -> dict[str, float]:
        """The per-epoch metrics with their stable MLflow names."""
        return epoch_metrics(self, ("redundancy", *PREPARATION_TIMERS, "prefetch_bytes"))


def fixed_batches(train_idx: torch.Tensor, batch_size: int | None, seed: int) -> list[torch.Tensor]:
    """Split the training nodes into fixed batches (sorted IDs inside each batch).

    ``batch_size=None`` gives one batch holding every training node.
    """
    train_idx = torch.as_tensor(train_idx, dtype=torch.int64)
    if train_idx.numel() == 0:
        raise ValueError("no training nodes")
    if batch_size is None or batch_size >= train_idx.numel():
        return [torch.sort(train_idx).values]
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    gen = torch.Generator().manual_seed(seed)
    perm = train_idx[torch.randperm(train_idx.numel(), generator=gen)]
    return [torch.sort(chunk).values for chunk in torch.split(perm, batch_size)]


KChooser = Callable[[SampledBatch, PartitionPlan, int], tuple[PartitionResult, list[int] | None]]
"""``(batch, plan, seed) -> (partition, per-micro-batch estimated bytes or None)``."""

Estimator = Callable[[SampledBatch, torch.Tensor, int], list[int]]
"""``(batch, groups, k) -> estimated peak bytes of every micro-batch``."""


class Trainer(SearchReports):
    """Runs epochs of exact micro-batch training on one dataset.

    Args:
        model: a :class:`betty.models.BlockGNN` on ``device``.
        optimizer: its optimizer.
        dataset: a :class:`betty.data.GraphDataset`.
        fanouts: per-layer fanouts, input layer first.
        plan: how to split each batch.
        batch_size: output nodes per batch (``None``: all training nodes).
        device: where micro-batches run.
        seed: seeds batches, sampling, partitioning and dropout.
        dtype: the parameters' dtype (default float32).
        precision: ``train.precision`` (default: ``64`` for float64 ``dtype``, else
            ``32``): ``bf16-mixed``/``16-mixed`` run each micro-batch's forward and loss
            under autocast with float32 parameters and gradients; ``16-mixed`` adds one
            :class:`betty.precision.LossScaler` for the run (its scale carries across
            steps, an inf/NaN gradient skips the step on every rank).
        meter: optional memory meter (one region per micro-batch).
        k_chooser: picks K (and the partition) for a batch when ``plan.k == "auto"``;
            default: :func:`betty.memory.make_k_chooser` for this model and device.
        estimator: per-micro-batch memory estimate, logged next to the measurement and used to
            decide when a reused partition must be recomputed; default:
            :func:`betty.memory.make_estimator` when ``estimate_memory`` is set.
        estimate_memory: build the default estimator (the analytic memory model).
        on_search: called with the :class:`betty.memory.KSearchResult` of every batch's
            K search when the batch trains (:class:`betty.records.SearchReports`: a batch
            prepared ahead that never trains reports none); the latest is kept as
            ``search_result``.
        parallel: a :class:`betty.distributed.DataParallel`: spread each batch's micro-batches
            over its ranks (longest estimated first) and all-reduce the gradients;
            every rank must build the Trainer identically (same seed).
        prefetch: ``0`` (default): each batch is prepared (sampled, partitioned,
            estimated) when its step starts and its micro-batches are carved one at a
            time; ``n >= 1``: a preparation thread prepares and carves up to ``n`` batches
            ahead of the step (:meth:`epochs`), at the cost of holding their host
            tensors (``EpochRecord.prefetch_bytes``).
        gather_ahead: whether a batch prepared ahead (``prefetch >= 1``) also gathers
            its micro-batches' input features into host memory
            (:func:`betty.train.host_rows`; pinned for CUDA, so that the step's
            copy is a ``non_blocking`` one), so the step only copies them. ``None``
            (default): when ``device`` is not the CPU and ``prefetch >= 1``. On the CPU
            the gathered rows are the device memory a micro-batch's peak counts, so they
            are gathered in the step, one micro-batch at a time.
        sample_device: where a batch is prepared, the cut excepted: ``None`` (default)
            on the host (NumPy index work); a torch device: the sampler, carving and the
            feature gather run as torch ops there (preparation on the device), the
            graph's CSR, the features and the labels copied there once, and a host copy
            of each batch is what the cut, the estimate and the redundancy metric read.
            ``"cpu"`` runs the torch-op path on the host: the same batches, micro-batches and
            updates as ``None``, bit for bit. A CUDA device must be ``device`` itself,
            with ``prefetch=0`` (a batch prepared ahead would hold device memory beside
            the step's); the memory model then counts what preparation keeps there
            (:mod:`betty.memory.device_preparation`).
        copy_ahead: copy micro-batch k+1's inputs (blocks, IDs, features, labels) to
            the device while micro-batch k computes (:func:`betty.train.accumulate_gradients`:
            on CUDA on a side stream, from pinned memory, ``non_blocking``; on the CPU
            synchronously at the same point, the same memory profile). The updates are
            the same; it costs memory: each micro-batch but a step's last holds the next
            one's inputs beside its own, which the memory model counts (its
            ``next_inputs`` component) and the K search fits. Default off. Not with
            ``parallel`` (the estimate follows the single-process order of the micro-batches)
            or a CUDA ``sample_device`` (a batch prepared there is not copied from the host).
    """

    def __init__(self, model, optimizer, dataset, fanouts, plan: PartitionPlan, *,
                 batch_size: int | None = None, device="cpu", seed: int = 0,
                 dtype: torch.dtype = torch.float32, precision: Precision | str | None = None,
                 meter=None, k_chooser: KChooser | None = None, estimator: Estimator | None = None,
                 estimate_memory: bool = True, on_search=None,
                 dropout_seed: int | None = None, parallel=None, prefetch: int = 0,
                 gather_ahead: bool | None = None,
                 sample_device: torch.device | str | None = None, copy_ahead: bool = False) -> None:
        fanouts = check_fanouts(fanouts)
        if len(fanouts) != model.num_layers:
            raise ValueError(f"{len(fanouts)} fanouts for a {model.num_layers}-layer model")
        check_plan(plan)
        self.model, self.optimizer, self.dataset = model, optimizer, dataset
        self.sample_device = self._preparation_device(sample_device, device, prefetch)
        self.copy_ahead = self._check_copy_ahead(copy_ahead, parallel, self.sample_device)
        if precision is None:
            precision = "64" if dtype == torch.float64 else "32"
        self.precision = Precision.parse(precision)
        if self.precision.param_dtype != dtype:
            raise ValueError(f"precision {self.precision} keeps parameters in "
                             f"{self.precision.param_dtype}, but dtype is {dtype}")
        check_parameter_dtype(model, dtype)
        why = self.precision.unsupported(getattr(model, "backend_name", ""), torch.device(device).type)
        if why is not None:
            raise ValueError(why)
        self.memory_kwargs = memory_kwargs = self._memory_kwargs(model, dataset, device, dtype)
        if plan.memory_budget is not None:
            if not estimate_memory and estimator is None and k_chooser is None:
                raise ValueError("a memory_budget needs the memory estimates (estimate_memory=True, or "
                                 "an estimator or k_chooser of your own): without them a reused "
                                 "partition is not re-checked and a fixed K not held to the budget")
            backend = memory_kwargs["backend"]
            check_step_fits(persistent_bytes(model, optimizer, backend) + step_bytes(model, optimizer, backend),
                            plan.memory_budget, plan.safety_margin)
        self.on_search = on_search  # with each KSearchResult of the default K chooser (SearchReports)
        if k_chooser is None and plan.k == "auto":
            k_chooser = make_k_chooser(model, optimizer, graph=dataset.graph,
                                       on_search=self._recording(), **memory_kwargs)
        # Estimates drive K and re-partitioning with the optimizer's steady state (its
        # state tensors exist); before the first step they do not, so the estimate
        # logged next to the measurement then uses a state-free optimizer.
        self._stateless_estimator = None
        if estimator is None and estimate_memory:
            estimator = make_estimator(model, optimizer, **memory_kwargs)
            self._stateless_estimator = make_estimator(model, OptimizerSpec("sgd"), **memory_kwargs)
        if plan.memory_budget is not None and torch.device(device).type == "cuda":
            apply_budget(device, plan.memory_budget)  # an underestimate shows as an OOM
        self.fanouts = list(fanouts)
        self.plan = plan
        self.device, self.seed, self.dtype = device, seed, dtype
        self.scaler = LossScaler() if self.precision.needs_scaler else None
        self.meter = meter
        self.k_chooser, self.estimator = k_chooser, estimator
        self.dropout_seed = seed if dropout_seed is None else dropout_seed
        self.parallel = parallel
        self.batches = fixed_batches(dataset.train_idx, batch_size, seed)
        self._partitions: dict[int, tuple[PartitionResult, int]] = {}  # batch -> (result, epoch made)
        self.prefetch = check_prefetch(prefetch)
        if gather_ahead is None:
            gather_ahead = bool(self.prefetch) and torch.device(device).type != "cpu"
        elif gather_ahead and not self.prefetch:
            raise ValueError("gather_ahead=True gathers for batches prepared ahead: it needs prefetch >= 1")
        self.gather_ahead = bool(gather_ahead)

    def _recording(self):
        """The K chooser's ``on_search``: keeps the result until the split it made is
        reported (through a weak reference: the K chooser the trainer holds does not
        hold the trainer). A batch prepared ahead reports it when it trains
        (:meth:`train_prepared`), so a batch that never trains (an early stop) reports
        no search; :meth:`partition` reports it at once."""
        ref = weakref.ref(self)

        def record(result) -> None:
            trainer = ref()
            if trainer is not None:
                trainer._pending_search = result

        return record

    @staticmethod
    def _preparation_device(sample_device, device, prefetch: int) -> torch.device | None:
        """``sample_device`` resolved and checked (see the class docstring)."""
        if sample_device is None:
            return None
        on = torch.device(sample_device)
        if on.type == "cuda":
            if not same_device(on, torch.device(device)):
                raise ValueError(f"sample_device {str(on)!r} prepares batches on a CUDA device: it "
                                 f"must be the training device ({str(device)!r}), whose memory "
                                 f"budget counts what preparation keeps there")
            if prefetch:
                raise ValueError(f"sample_device {str(on)!r} prepares each batch on the training "
                                 f"device when its step starts: use prefetch=0 (a batch prepared "
                                 f"ahead would hold device memory beside the step's), got "
                                 f"prefetch={prefetch}")
        return on

    @staticmethod
    def _check_copy_ahead(copy_ahead: bool, parallel, sample_device: torch.device | None) -> bool:
        """``copy_ahead`` checked (see the class docstring)."""
        if not copy_ahead:
            return False
        if parallel is not None:
            raise ValueError("copy_ahead counts each micro-batch's successor in the single-process "
                             "order of the micro-batches; it does not run with parallel=")
        if sample_device is not None and sample_device.type == "cuda":
            raise ValueError(f"copy_ahead overlaps the copy of each next micro-batch from the "
                             f"host; with sample_device {str(sample_device)!r} the batch is "
                             f"prepared on the device and not copied")
        return True

    def _device_store(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The features and labels the step reads: on the preparation device (copied
        there once) with preparation on a device, else the dataset's host tensors."""
        feat, label = self.dataset.feat, self.dataset.label
        if self.sample_device is None:
            return feat, label
        store = self.__dict__.get("_store_on_device")
        if store is None:
            store = self._store_on_device = (feat.to(self.sample_device), label.to(self.sample_device))
        return store

    # -- micro-batches ---------------------------------------------------------------------
    def sample(self, epoch: int, batch_index: int = 0, *, on_host: bool = True) -> SampledBatch:
        """The sampled neighbourhood of batch ``batch_index`` at ``epoch``. With
        ``sample_device`` the sampler runs as torch ops on that device
        (:func:`betty.sampling.sample_full_batch`'s device path: on the CPU the same
        batch as the host path, bit for bit); ``on_host`` (default) returns the batch's
        host copy, ``on_host=False`` the batch where it was sampled (what preparation
        carves)."""
        seed = dropout_key(self.seed, epoch, batch_index) & 0x7FFFFFFF
        batch = sample_full_batch(self.dataset.graph, self.batches[batch_index], self.fanouts,
                                  seed=seed, device=self.sample_device)
        return batch.to("cpu") if on_host else batch

    def _fresh_partition(self, batch: SampledBatch, epoch: int, batch_index: int):
        """``(partition, estimates or None)`` of ``batch``: the plan's split (or K search);
        on N ranks rank 0's, which every rank takes (:meth:`DataParallel.agree`)."""
        out = self._split(batch, self.seed + 1000 * epoch + batch_index)
        return out if self.parallel is None else self.parallel.agree(out)

    def _split(self, batch: SampledBatch, seed: int):
        if self.plan.k == "auto":
            plan = self.plan
            if self.parallel is not None and self.parallel.world_size > plan.min_k:
                plan = dataclasses.replace(plan, min_k=self.parallel.world_size)  # K >= N
            return self.k_chooser(batch, plan, seed)
        weights = None
        if self.plan.balance == "memory":
            weights = memory_balance_weights(batch, self.model)
        k = min(int(self.plan.k), batch.num_outputs)  # the epoch's last batch may be smaller
        return partition_batch(batch, k, self.plan.method, seed=seed,
                               weights=weights, graph=self.dataset.graph,
                               options=self.plan.options), None

    def partition(self, batch: SampledBatch, epoch: int, batch_index: int):
        """(partition, per-micro-batch estimates or None, whether it was recomputed)."""
        result, estimates, fresh, _, _, _ = self._partition_timed(batch, epoch, batch_index)
        self._report_search(self._take_search())
        return result, estimates, fresh

    def _partition_timed(self, batch: SampledBatch, epoch: int, batch_index: int, carve_ahead: bool = False,
                         carve_batch: SampledBatch | None = None):
        """:meth:`partition` plus the wall of the estimates made outside the K search and,
        with ``carve_ahead``, every micro-batch carved (``carve_all``'s list; ``None`` without),
        from ``carve_batch`` (:attr:`PreparedBatch.carve_batch`; needed with ``carve_ahead``),
        and the wall of that carving (the preparation threads carve several micro-batches at
        once: their own seconds sum to more).
        Carved first, a split's estimate and redundancy read the carved micro-batches' sizes
        (:func:`betty.memory.sizes.carved_split_sizes`) instead of building its micro-batch
        membership; a K search still estimates from the membership of each K it tries."""
        cached = self._partitions.get(batch_index)
        expired = cached is None or (
            self.plan.reuse is not None and epoch - cached[1] >= self.plan.reuse)
        estimates, t_estimate, micro, t_carve = None, 0.0, None, 0.0
        if not expired and self.estimator is not None:
            result = cached[0]
            if carve_ahead:
                micro, t_carve = self._carve_recorded(batch, result, carve_batch)
            estimates, t_estimate = self._estimate(self.estimator, batch, result)
            budget = self._usable_budget()
            if budget is not None and max(estimates) > budget:
                expired, micro = True, None  # the fresh sample grew past the budget: re-partition
        if expired:
            result, estimates = self._fresh_partition(batch, epoch, batch_index)
            self._partitions[batch_index] = (result, epoch)
            if carve_ahead:
                micro, seconds = self._carve_recorded(batch, result, carve_batch)
                t_carve += seconds
            return result, estimates, True, t_estimate, micro, t_carve
        if carve_ahead and micro is None:
            micro, t_carve = self._carve_recorded(batch, cached[0], carve_batch)
        return cached[0], estimates, False, t_estimate, micro, t_carve

    def _carve_recorded(self, batch: SampledBatch, result: PartitionResult,
                        carve_batch: SampledBatch) -> tuple[list, float]:
        """Every micro-batch of ``result`` carved from ``carve_batch`` (one process), its sizes
        recorded on ``batch`` (its host copy, or itself) as the split's micro-batch sizes;
        and the seconds that took."""
        start = time.perf_counter()
        micro = self._carve(carve_batch, result, None)
        carved_split_sizes(batch, result.groups, result.k, [mb for _, mb, _ in micro])
        return micro, time.perf_counter() - start

    @staticmethod
    def _estimate(estimator: Estimator, batch: SampledBatch, result: PartitionResult) -> tuple[list[int], float]:
        """``estimator``'s per-micro-batch bytes and the seconds it took."""
        start = time.perf_counter()
        estimates = estimator(batch, result.groups, result.k)
        return estimates, time.perf_counter() - start

    def _usable_budget(self) -> float | None:
        if self.plan.memory_budget is None:
            return None
        return self.plan.memory_budget * (1.0 - self.plan.safety_margin)

    # -- the first split, measured, and other splits of its batch -------------------
    def measure_split(self, batch: SampledBatch | None = None) -> Split:
        """Epoch 0's split of ``batch`` (default: :meth:`sample` ``(0, 0)``), measured as
        :func:`betty.partition.measure_batch_split` measures it."""
        return measure_batch_split(self, self.sample(0, 0) if batch is None else batch)

    def sweep(self, ks: Sequence[int], methods: Sequence[str] | None = None, *,
              batch: SampledBatch | None = None, **options: Any) -> tuple[list[dict], dict[str, str]]:
        """``batch`` (default: :meth:`sample` ``(0, 0)``) split by every method at every K
        of ``ks`` with the plan's partitioner options: :func:`betty.partition.sweep_batch`
        (``options``: its ``seed``, ``time_limit_s``, ``max_k``, ``progress``, ``on_skip``),
        rows with the columns :data:`betty.partition.sweep.SWEEP_COLUMNS`."""
        batch = self.sample(0, 0) if batch is None else batch
        return sweep_batch(batch, ks, methods, graph=self.dataset.graph, options=self.plan.options, **options)

    # -- memory report --------------------------------------------------------------
    def memory_report(self, measure: bool = False) -> dict:
        """The memory model's view of the first epoch's first batch: batch 0 sampled and
        split as epoch 0 splits it (:meth:`sample`, :meth:`partition`: the K search runs
        here with ``k="auto"``, and the split is kept for the epoch as any other), every
        micro-batch estimated by component (:func:`betty.memory.estimate_micro_batches` with
        :attr:`memory_kwargs`; the optimizer's steady state, its state tensors counted)
        and, with ``measure``, measured once on ``device``.

        Measuring trains the model: one real optimizer step over the batch (so that the
        optimizer state exists, as in every step after the first), then forward and
        backward of every micro-batch, each in its own :class:`betty.memory.MemoryMeter`
        region (the gradients accumulated, no optimizer step), and the gradients are
        cleared. The parameters and the optimizer state are left one step on, not
        restored. It runs in this process (no ``parallel``), reading the dataset's host
        features, with epoch 0 batch 0's dropout key (the masks of the step it measures).

        Returns:
            :func:`betty.memory.report.split_report`'s dict (bytes as ints, errors as
            fractions): ``method``, ``k``, ``backend``, ``num_outputs`` (the batch's
            output nodes), ``memory_budget_bytes``, ``safety_margin``,
            ``max_estimated_peak_bytes``, ``micro_batches`` (per micro-batch ``index``,
            ``estimated_peak_bytes``, ``components``; with ``measure``
            ``measured_peak_bytes`` and ``relative_error``), with ``measure``
            ``max_measured_peak_bytes`` and ``max_abs_relative_error``, and ``k_tried``
            when this call ran the K search (``KSearchResult.to_dict()["tried"]``).
        """
        report_optimizer_spec(self.optimizer)
        searched = self.search_result
        batch = self.sample(0, 0)
        result, _, _ = self.partition(batch, 0, 0)
        estimates = estimate_micro_batches(batch, result.groups, result.k, self.model, self.optimizer,
                                           **self.memory_kwargs)
        measured = None
        if measure:
            meter = MemoryMeter(self.device)
            meter.track(self.model, self.optimizer)
            measured = self._measure_micro_batches(batch, result, meter)
        return split_report(estimates, method=result.method, k=result.k, backend=self.memory_kwargs["backend"],
                            memory_budget=self.plan.memory_budget, safety_margin=self.plan.safety_margin,
                            sizes={"num_outputs": batch.num_outputs}, measured=measured,
                            search=self.search_result if self.search_result is not searched else None,
                            micro_batch_name=EpochRecord.MICRO_BATCH_NAME)

    def _measure_micro_batches(self, batch: SampledBatch, result: PartitionResult, meter) -> list[int | None]:
        """:meth:`memory_report`'s measurement: one optimizer step, then every micro-batch's
        forward and backward in a ``meter`` region; its measured peak bytes."""
        feat, label = self.dataset.feat, self.dataset.label
        common = dict(k=result.k, device=self.device, dropout_key=dropout_key(self.dropout_seed, 0, 0),
                      multilabel=self.dataset.multilabel, dtype=self.dtype, precision=self.precision,
                      scaler=self.scaler, copy_ahead=self.copy_ahead)  # measured as trained (and as estimated)
        saved = None if self.scaler is None else self.scaler.state_dict()
        for _ in range(STATE_STEP_TRIES):  # a loss scaler skips a step that overflows: the next, scaled down, is taken
            skipped = None if self.scaler is None else self.scaler.skipped_steps
            train_step(self.model, self.optimizer, batch, result.groups, feat, label, **common)  # the state
            if self.scaler is None or self.scaler.skipped_steps == skipped:
                break
        else:
            raise RuntimeError(f"the loss scaler skipped {STATE_STEP_TRIES} steps in a row (inf or NaN "
                               "gradients): no optimizer state to measure with")
        if saved is not None:  # the run's scaler goes on as if the measurement had not happened
            self.scaler.load_state_dict(saved)
        self.optimizer.zero_grad(set_to_none=True)
        step = accumulate_gradients(self.model, batch, result.groups, feat, label, meter=meter, **common)
        self.model.zero_grad(set_to_none=True)
        return [r.peak_bytes for r in step.micro]

    # -- epochs ---------------------------------------------------------------------
    def _memory_kwargs(self, model, dataset, device, dtype: torch.dtype) -> dict:
        """The memory model's keywords for this run's step. Under a mixed precision the
        replay follows autocast where it covers the model
        (:func:`betty.memory.replay.replays_mixed_precision`, on this device); elsewhere
        K is chosen from the estimate of the float32 step, with a warning (the measured
        mixed-precision peaks in docs/precision.md are below float32's)."""
        backend = default_backend(device)
        kwargs = dict(backend=backend, feat_dtype=dataset.feat.dtype,
                      label_columns=dataset.num_classes if dataset.multilabel else 0)
        if self.copy_ahead:
            kwargs["copy_ahead"] = True
        if self.sample_device is not None and self.sample_device.type == "cuda":
            from betty.memory.constants import load_constants
            from betty.memory.device_preparation import store_bytes

            granule = load_constants(backend).granule_bytes
            kwargs["device_store_bytes"] = store_bytes(dataset.graph, dataset.feat, dataset.label, granule)
        if not self.precision.mixed:
            return dict(kwargs, dtype=dtype)
        host = not backend.startswith("cuda")
        if replays_mixed_precision(ModelSpec.from_model(model), host):
            return dict(kwargs, dtype=None, precision=self.precision)
        warnings.warn(f"the memory model replays this model's float32 step, not its "
                      f"{self.precision} step: K is chosen from float32 estimates",
                      stacklevel=3)
        return dict(kwargs, dtype=torch.float32)

    def batch_order(self, epoch: int) -> list[int]:
        """The order in which ``epoch`` steps through the batches (seeded, reshuffled
        every epoch)."""
        gen = torch.Generator().manual_seed(self.seed * 7919 + epoch)
        return torch.randperm(len(self.batches), generator=gen).tolist()

    def prepare(self, epoch: int, batch_index: int, carve: bool = False) -> PreparedBatch:
        """Sample batch ``batch_index`` of ``epoch``, partition it (or reuse its
        partition), estimate its micro-batches and measure its redundancy; with ``carve``, also
        carve the micro-batches this process will run. Reads the dataset and this
        trainer's partitions, never the model's parameters: run in epoch order (a reused
        partition's age counts in epochs), it gives the same result at any time.

        Raises:
            betty.memory.ksearch.BudgetExceeded: a fixed K whose largest micro-batch is estimated
                past the memory budget (:func:`betty.memory.ksearch.check_fixed_k`).
        """
        t0 = time.perf_counter()
        carve_batch = self.sample(epoch, batch_index, on_host=False)
        batch = carve_batch.to("cpu")  # itself when sampled on the host
        t1 = time.perf_counter()
        carve_ahead = carve and self.parallel is None  # under parallel the estimates pick the micro-batches
        result, estimates, fresh, t_estimate, micro, t_block = self._partition_timed(
            batch, epoch, batch_index, carve_ahead, carve_batch)
        search = self._take_search()
        if estimates is None and self.estimator is not None:
            estimates, seconds = self._estimate(self.estimator, batch, result)
            t_estimate += seconds
        if estimates and self.plan.k != "auto" and self.plan.memory_budget is not None:
            check_fixed_k(estimates, result.k, self.plan.memory_budget, self.plan.safety_margin)
        t2 = time.perf_counter()
        redundancy = split_metrics(batch, result.groups, result.k)["redundancy"]
        t3 = time.perf_counter()
        if carve and micro is None:
            micro = self._carve(carve_batch, result, estimates)
        batch.forget(CUT_STRUCTURES)  # what the split was cut from: not kept while the batch waits and trains
        t_gather = 0.0
        if micro is not None and self.gather_ahead:
            t4 = time.perf_counter()
            self._gather_inputs(micro)
            t_gather = time.perf_counter() - t4
        prepared = PreparedBatch(
            epoch=epoch, index=batch_index, batch=batch, partition=result, estimates=estimates,
            fresh=fresh, redundancy=redundancy, micro_batches=micro, nbytes=0,
            time_sample_s=t1 - t0, time_partition_s=t2 - t1 - t_estimate - t_block,
            time_estimate_s=t_estimate, time_metrics_s=t3 - t2,
            time_gather_s=t_gather, carve_batch=carve_batch, search=search)
        prepared.nbytes = _tensor_bytes((batch, micro))
        return prepared

    def _micro_batch_costs(self, result: PartitionResult, estimates: list[int] | None) -> list[float] | None:
        """What ``parallel`` assigns the micro-batches by (``None`` in one process): the
        estimates, else each micro-batch's output count. Both the carving ahead and the step
        use this one list, so they agree on this rank's micro-batches."""
        if self.parallel is None:
            return None
        if estimates is not None:
            return estimates
        from betty.distributed.assign import micro_batch_output_costs

        return micro_batch_output_costs(result.groups, result.k)

    def _carve(self, batch: SampledBatch, result: PartitionResult, estimates: list[int] | None) -> list:
        """``(index, micro-batch, seconds)`` of every micro-batch this process runs: all K, or
        under ``parallel`` this rank's share of the assignment its step will make."""
        from betty.train import carve_all

        costs = self._micro_batch_costs(result, estimates)
        indices = None if costs is None else self.parallel.assign(costs)
        return carve_all(batch, result.groups, result.k, indices, torch_ops=self.torch_ops)

    @property
    def torch_ops(self) -> bool:
        """Whether carving runs in torch ops (preparation on a device, the CPU included;
        :func:`betty.train.carve_all`'s ``torch_ops``)."""
        return self.sample_device is not None

    def _gather_inputs(self, micro: list) -> None:
        """Each carved micro-batch's input features, gathered into host memory
        (``MicroBatch.input_features``; pinned for CUDA)."""
        for _, mb, _ in micro:
            mb.input_features = host_rows(self.dataset.feat, mb.input_nid, self.device)

    def train_prepared(self, prepared: PreparedBatch) -> BatchRecord:
        """One optimizer step over a :class:`PreparedBatch`."""
        batch, result, b, epoch = prepared.batch, prepared.partition, prepared.index, prepared.epoch
        self._report_search(prepared.search)
        estimates = prepared.estimates
        logged, t_logged = estimates, 0.0
        if self._stateless_estimator is not None and not self.optimizer.state:
            logged, t_logged = self._estimate(self._stateless_estimator, batch, result)
        micro, prepared.micro_batches = prepared.micro_batches, None  # freed micro-batch by micro-batch
        with oom_guard(estimates or [], self.plan.memory_budget), locate_non_finite(epoch, b):
            step_kwargs = dict(k=result.k, device=self.device,
                               dropout_key=dropout_key(self.dropout_seed, epoch, b),
                               multilabel=self.dataset.multilabel, meter=self.meter,
                               dtype=self.dtype, precision=self.precision, scaler=self.scaler,
                               copy_ahead=self.copy_ahead)
            if micro is not None:
                step_kwargs["micro_batches"] = micro
            feat, label = self._device_store()
            carve_batch, prepared.carve_batch = prepared.carve_batch, None
            step = train_step(self.model, self.optimizer, carve_batch, result.groups,
                              feat, label, parallel=self.parallel, torch_ops=self.torch_ops,
                              costs=self._micro_batch_costs(result, estimates), **step_kwargs)
        if logged:  # the micro-batches this process ran (all K unless data-parallel)
            logged = [logged[m.index] for m in step.micro]
        return BatchRecord(
            index=b, k=result.k, loss=step.loss, train_acc=step.train_acc,
            num_outputs=batch.num_outputs, redundancy=prepared.redundancy, repartitioned=prepared.fresh,
            time_sample_s=prepared.time_sample_s, time_partition_s=prepared.time_partition_s,
            time_block_s=step.time_block_s, time_compute_s=step.time_compute_s,
            time_estimate_s=prepared.time_estimate_s + t_logged, time_metrics_s=prepared.time_metrics_s,
            time_h2d_s=prepared.time_gather_s + step.time_h2d_s,
            peak_mem_measured_bytes=step.peak_bytes,
            peak_mem_estimated_bytes=max(logged) if logged else None,
            micro=step.micro, micro_estimated_bytes=logged,
        )

    def train_epoch(self, epoch: int, progress: Callable[[int, int], None] | None = None) -> EpochRecord:
        """One epoch; ``progress(done_batches, total_batches)`` is called after each step."""
        return next(self.epochs([epoch], progress))

    def epochs(self, epochs: Iterable[int],
               progress: Callable[[int, int], None] | None = None) -> Iterator[EpochRecord]:
        """Train ``epochs`` one after the other, yielding each one's record when it ends.

        With ``prefetch = n >= 1`` a preparation thread (:class:`betty.pipeline.Prefetcher`)
        runs :meth:`prepare` up to ``n`` batches ahead of the step, across epoch
        boundaries (the next epoch's first batch is prepared while the caller evaluates
        the model), carving the micro-batches too; the samples, partitions and updates
        are those of the serial loop, bit for bit. Leaving the loop early (a ``break``,
        an exception) stops the thread; a batch prepared ahead is dropped, and its
        partition, if fresh, stays cached as it would after a serial epoch.
        """
        epochs = list(epochs)
        order = {e: self.batch_order(e) for e in epochs}
        items = [(e, b) for e in epochs for b in order[e]]
        source = preparation(items, lambda item: self.prepare(*item, carve=bool(self.prefetch)),
                             self.prefetch, size=lambda prepared: prepared.nbytes,
                             finish_allowed=self.parallel is not None)  # its splits are agreed
        with source:
            for epoch in epochs:
                start, waited = time.perf_counter(), source.wait_s
                source.reset_peak()
                records = []
                for done in range(1, len(order[epoch]) + 1):
                    _, prepared = next(source)
                    records.append(self.train_prepared(prepared))
                    del prepared
                    if progress is not None:
                        progress(done, len(order[epoch]))
                yield self._epoch_record(epoch, records, time.perf_counter() - start,
                                         source.wait_s - waited, source.peak_bytes)

    @staticmethod
    def _epoch_record(epoch: int, records: list[BatchRecord], wall: float, wait: float,
                      prefetch_bytes: int) -> EpochRecord:
        n = sum(r.num_outputs for r in records)
        measured = [r.peak_mem_measured_bytes for r in records if r.peak_mem_measured_bytes is not None]
        estimated = [r.peak_mem_estimated_bytes for r in records if r.peak_mem_estimated_bytes is not None]
        return EpochRecord(
            epoch=epoch,
            loss=sum(r.loss * r.num_outputs for r in records) / n,
            train_acc=sum(r.train_acc * r.num_outputs for r in records) / n,
            k=max(r.k for r in records),
            redundancy=sum(r.redundancy * r.num_outputs for r in records) / n,
            time_sample_s=sum(r.time_sample_s for r in records),
            time_partition_s=sum(r.time_partition_s for r in records),
            time_block_s=sum(r.time_block_s for r in records),
            time_compute_s=sum(r.time_compute_s for r in records),
            epoch_time_s=wall,
            peak_mem_measured_bytes=max(measured) if measured else None,
            peak_mem_estimated_bytes=max(estimated) if estimated else None,
            batches=records,
            time_estimate_s=sum(r.time_estimate_s for r in records),
            time_metrics_s=sum(r.time_metrics_s for r in records),
            time_h2d_s=sum(r.time_h2d_s for r in records),
            time_wait_s=wait,
            prefetch_bytes=prefetch_bytes,
        )
