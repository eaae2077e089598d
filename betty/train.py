"""Exact gradient accumulation over the micro-batches of one sampled batch.

For a full batch with output nodes V (|V| = N) split into micro-batches V_1..V_K, the
full-batch loss is ``L = (1/N) Σ_{v in V} ℓ(v)``. Micro-batch k contributes

    L_k = (1/N) Σ_{v in V_k} ℓ(v),        Σ_k L_k = L,

and because every node of V_k sees exactly its full-batch sampled neighbourhood (and,
with deterministic dropout, its full-batch dropout masks), ``Σ_k ∇L_k = ∇L``: K
backward passes followed by one optimizer step give the full-batch update to
floating-point tolerance. For multi-label targets ``ℓ(v)`` is the mean binary
cross-entropy over the T tasks.

Only one micro-batch's blocks, features and activations are on the device at a time:
its input features are gathered from the host feature matrix and moved per micro-batch,
and everything is released before the next one starts. With ``copy_ahead`` the inputs
of micro-batch k+1 (blocks, IDs, features, labels) are copied while micro-batch k
computes (on a side CUDA stream, :mod:`betty.streams`), so they are on the device beside
micro-batch k, which the memory model counts (``next_inputs``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch.nn import functional as F

from betty import catalog
from betty.batch import MicroBatch, SampledBatch
from betty.data.store import gather_rows
from betty.microbatch import Carver, validate_groups
from betty.pages import out_of_core
from betty.precision import LossScaler, Precision, input_dtype, parameter_dtype
from betty.streams import CopyStream, Staged
from betty.workers import parallel_map

__all__ = [
    "NonFiniteLoss",
    "locate_non_finite",
    "host_rows",
    "same_device",
    "MicroBatchForward",
    "MicroBatchRun",
    "accumulate_micro_batches",
    "step_over_micro_batches",
    "count_correct",
    "largest_peak",
    "MicroBatchRecord",
    "StepResult",
    "train_step",
    "accumulate_gradients",
    "carve_micro_batches",
    "carve_all",
    "node_loss_sum",
    "build_optimizer",
    "first_layer",
    "parameter_groups",
    "OPTIMIZERS",
]

OPTIMIZERS = catalog.OPTIMIZERS


def build_optimizer(name: str, params: Iterable, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """``"adam"`` or ``"sgd"`` over ``params`` (tensors, or parameter groups: dicts whose
    own ``weight_decay`` overrides the default, e.g. :func:`parameter_groups`)."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def first_layer(model: torch.nn.Module) -> torch.nn.Module:
    """The module of ``model``'s first layer: ``layers[0]`` of a block model
    (:class:`betty.models.BlockGNN`), the input ``encoder`` of a RevGNN."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
        return layers[0]
    encoder = getattr(model, "encoder", None)
    if isinstance(encoder, torch.nn.Module):
        return encoder
    raise ValueError(f"{type(model).__name__} has neither layers[0] nor an encoder: no first layer "
                     "to restrict weight decay to")


def parameter_groups(model: torch.nn.Module, weight_decay: float,
                     first_layer_only: bool = False) -> list[dict]:
    """Optimizer parameter groups of ``model``: one group decayed by ``weight_decay``,
    or with ``first_layer_only`` the :func:`first_layer`'s parameters decayed and the
    rest not (Kipf and Welling's GCN setting). Empty groups are left out."""
    params = list(model.parameters())
    if not first_layer_only:
        return [{"params": params, "weight_decay": weight_decay}]
    first = {id(p) for p in first_layer(model).parameters()}
    groups = [{"params": [p for p in params if id(p) in first], "weight_decay": weight_decay},
              {"params": [p for p in params if id(p) not in first], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def node_loss_sum(logits: torch.Tensor, target: torch.Tensor, multilabel: bool = False) -> torch.Tensor:
    """Σ over nodes of the per-node loss.

    Single-label: cross-entropy, ``logits (n, C)``, ``target (n,)`` int64.
    Multi-label: mean over T tasks of binary cross-entropy with logits,
    ``logits, target (n, T)``.
    """
    if multilabel:
        per_elem = F.binary_cross_entropy_with_logits(logits, target.to(logits.dtype), reduction="none")
        return per_elem.mean(1).sum()
    return F.cross_entropy(logits, target, reduction="sum")


def count_correct(logits: torch.Tensor, target: torch.Tensor, multilabel: bool = False) -> float:
    """Correct predictions summed over the ``n`` rows: single-label ``logits (n, C)``,
    ``target (n,)``: ``Σ [argmax logits = target]``; multi-label ``(n, T)``: the
    fraction of the T tasks whose sign is right, summed over rows (counted as an integer
    over the ``(n, T)`` entries, then divided by T: no float32 rounding)."""
    if multilabel:
        return int(((logits > 0) == (target > 0.5)).sum()) / target.shape[1]
    return float((logits.argmax(1) == target).sum())


# ---------------------------------------------------------------------------------------
# The training-step skeleton shared by both engines (sampled blocks here, RevGNN parts in
# betty.rev.engine): micro-batches -> loss sum / N_global -> backward -> (all-reduce) -> step.

P = TypeVar("P")
T = TypeVar("T")


class NonFiniteLoss(FloatingPointError):
    """A micro-batch's loss came out NaN or infinite: training cannot go on (the gradients
    would poison every parameter; the learning rate is too large, or an input holds
    NaN/inf). Raised by :func:`accumulate_micro_batches` before that micro-batch's backward, naming
    it (a sampled micro-batch or a RevGNN cluster part) and, through :func:`locate_non_finite`, the epoch
    and batch."""

    def __init__(self, value: float, micro_batch: int, epoch: int | None = None, batch: int | None = None,
                 micro_batch_name: str = "micro-batch") -> None:
        super().__init__(value, micro_batch, epoch, batch)
        self.value, self.micro_batch, self.epoch, self.batch = value, micro_batch, epoch, batch
        self.micro_batch_name = micro_batch_name

    def __str__(self) -> str:
        where = [f"epoch {self.epoch}"] if self.epoch is not None else []
        where += [f"batch {self.batch}"] if self.batch is not None else []
        where.append(f"{self.micro_batch_name} {self.micro_batch}")
        return (f"non-finite training loss ({self.value}) at {', '.join(where)}: stopping; "
                "lower train.lr or check the dataset's features for NaN/inf")


@contextmanager
def locate_non_finite(epoch: int, batch: int | None = None, micro_batch_name: str = "micro-batch") -> Iterator[None]:
    """Add ``epoch`` (and ``batch``, and what a micro-batch is called) to a
    :class:`NonFiniteLoss` raised inside."""
    try:
        yield
    except NonFiniteLoss as err:
        err.epoch, err.batch, err.micro_batch_name = epoch, batch, micro_batch_name
        raise


@dataclass
class MicroBatchForward:
    """What an engine's forward of one micro-batch hands to :func:`accumulate_micro_batches`.

    Attributes:
        loss_sum: 0-dim tensor ``Σ_{v in micro-batch} ℓ(v)`` (not yet divided by ``N``).
        count_correct: called after the backward: correct predictions of the micro-batch
            (:func:`count_correct`).
        keep: tensors to keep alive until the micro-batch ends (the memory model replays
            them as live through the backward: blocks, features, IDs).
        release: called after ``count_correct`` (e.g. to drop cached dropout masks).
        info: engine data passed through to :attr:`MicroBatchRun.info`.
    """

    loss_sum: torch.Tensor | None
    count_correct: Callable[[], float]
    keep: tuple = ()
    release: Callable[[], None] | None = None
    info: dict = field(default_factory=dict)


@dataclass
class MicroBatchRun:
    """One micro-batch that ran: ``loss`` = ``loss_sum / N``, ``correct``, wall ``seconds`` of
    its meter region (forward, backward and ``after_last``), measured ``peak_bytes``
    (``None`` without a meter) and the forward's ``info``."""

    index: int
    loss: float
    correct: float
    seconds: float
    peak_bytes: int | None
    info: dict


def accumulate_micro_batches(micro_batches: Iterable[tuple[int, P]], forward: Callable[[P], MicroBatchForward],
                             n_global: int, *, meter=None, last_index: int | None = None,
                             after_last: Callable[[], None] | None = None,
                             precision: Precision | str | None = None, device_type: str = "cpu",
                             scaler: LossScaler | None = None,
                             carried: Callable[[P], Iterable[torch.Tensor]] | None = None) -> list[MicroBatchRun]:
    """Forward and backward each micro-batch, accumulating ``∇ (loss_sum_k / N)`` into ``.grad``.

    With ``N = n_global`` the number of loss terms of the whole step (all micro-batches, all
    ranks), ``Σ_k loss_sum_k / N`` is the full step's mean loss, and the gradients left
    in ``.grad`` are its gradient (no zeroing, no optimizer step here). A NaN or
    infinite micro-batch loss raises :class:`NonFiniteLoss` before its backward.

    Args:
        micro_batches: ``(index, micro_batch)`` pairs; whatever producing one costs (carving
            it) happens outside the micro-batch's meter region.
        forward: the engine's forward of one micro-batch (inside the region).
        n_global: ``N``.
        meter: a :class:`betty.memory.MemoryMeter`: one region per micro-batch.
        last_index, after_last: ``after_last()`` runs inside micro-batch ``last_index``'s
            region, after everything the micro-batch allocated is released (the optimizer
            step, so its temporaries are measured with the last micro-batch).
        precision: a :class:`betty.precision.Precision` (default ``32``): under a mixed
            one, each micro-batch's forward and loss run in ``autocast(device_type)`` and the
            loss is taken in float32; the backward runs outside autocast and accumulates
            float32 gradients.
        scaler: a :class:`betty.precision.LossScaler` (``16-mixed``): every micro-batch's
            backward starts from ``scaler.scale · loss_k`` (one scale for the step; the
            step's owner unscales once).
        carried: ``carried(micro_batch)``: the device tensors a micro-batch brings into its region,
            made before it (its inputs copied ahead during the micro-batch before): the meter
            counts them from the region's start (:meth:`betty.memory.MemoryMeter.count`).
    """
    prec = Precision.parse(precision if precision is not None else "32")
    runs: list[MicroBatchRun] = []
    for index, micro_batch in micro_batches:
        start = time.perf_counter()
        with (meter.measure() if meter is not None else nullcontext()) as reading:
            if meter is not None and carried is not None:
                meter.count(carried(micro_batch))
            with prec.autocast(device_type):
                fwd = forward(micro_batch)
                loss_sum = fwd.loss_sum.float() if prec.mixed else fwd.loss_sum
                loss = loss_sum / n_global
            fwd.loss_sum = loss_sum = None
            value = float(loss.detach())
            if not math.isfinite(value):
                raise NonFiniteLoss(value, index)
            (scaler.scale_loss(loss) if scaler is not None else loss).backward()
            correct, info = fwd.count_correct(), fwd.info
            if fwd.release is not None:
                fwd.release()
            del fwd, loss
            if after_last is not None and index == last_index:
                after_last()
        del micro_batch  # freed before the next micro-batch is carved
        runs.append(MicroBatchRun(index=index, loss=value, correct=correct,
                             seconds=time.perf_counter() - start,
                             peak_bytes=None if reading is None else int(reading.peak_bytes),
                             info=info))
    return runs


def step_over_micro_batches(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            run: Callable[[frozenset[int] | None, Callable[[], None] | None],
                                          tuple[T, float, float]],
                            *, parallel=None, costs: Sequence[float] | None = None,
                            step_in_last_region: bool = False,
                            scaler: LossScaler | None = None) -> tuple[T, float, float]:
    """One optimizer step: ``zero_grad`` -> ``run(indices, after_last)`` -> (gradient
    all-reduce) -> ``optimizer.step()``.

    ``run(None, after_last)`` runs every micro-batch (``indices``: a set of micro-batch indices, this
    rank's under ``parallel``) and returns ``(result, loss, correct)``; ``after_last``
    (only with ``step_in_last_region``, single process) is the optimizer step, to be
    run inside the last micro-batch's meter region (stepped here if ``run`` did not).
    ``parallel``: a :class:`betty.distributed.DataParallel` that assigns the micro-batches by
    ``costs`` (K,), all-reduces the gradients and steps; ``loss`` and ``correct`` are
    then summed over the ranks. ``scaler`` (``16-mixed``, the same one ``run`` scales the
    losses with): the gradients are unscaled once after every micro-batch (after the
    all-reduce), and an inf or NaN anywhere skips the optimizer step on every rank
    (:meth:`betty.precision.LossScaler.step`). Returns ``(result, loss, correct)``.
    """
    if parallel is not None:
        extra = {} if scaler is None else {"scaler": scaler}
        result, loss, correct = parallel.step(model, optimizer, costs,
                                              lambda mine: run(frozenset(mine), None), **extra)
        loss, correct = parallel.sum_scalars(loss, correct)
        return result, loss, correct
    model.train()
    optimizer.zero_grad(set_to_none=True)
    stepped: list[bool] = []

    def step() -> None:
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer, model.parameters())
        stepped.append(True)

    out = run(None, step if step_in_last_region else None)
    if not stepped:
        step()
    return out


def largest_peak(records: Iterable) -> int | None:
    """The largest ``peak_bytes`` of ``records`` that have one (``None`` if none do)."""
    peaks = [r.peak_bytes for r in records if r.peak_bytes is not None]
    return max(peaks) if peaks else None


@dataclass
class MicroBatchRecord:
    """What happened in one micro-batch: its sizes and loss; ``time_block_s`` (carving
    it and putting its blocks and IDs on the device), ``time_h2d_s`` (its features and
    labels: gather, copy, cast), each counted with this micro-batch wherever it ran (with
    copy-ahead, during the micro-batch before); ``time_compute_s`` (its forward and
    backward: its region's wall without the copies made in it; for the last one in one
    process, also the optimizer step, which runs after that region); ``peak_bytes``: its
    measured peak (forward and backward)."""

    index: int
    num_outputs: int
    num_inputs: int
    num_edges: int
    loss: float
    time_block_s: float
    time_compute_s: float
    peak_bytes: int | None = None
    time_h2d_s: float = 0.0


@dataclass
class StepResult:
    """One optimizer step over K micro-batches.

    Attributes:
        loss: the full-batch loss ``Σ_k L_k``.
        train_acc: accuracy over the batch's output nodes (fraction of correct tasks
            for multi-label).
        micro: one record per micro-batch.
    """

    loss: float
    train_acc: float
    micro: list[MicroBatchRecord] = field(default_factory=list)

    @property
    def k(self) -> int:
        return len(self.micro)

    @property
    def time_block_s(self) -> float:
        return sum(m.time_block_s for m in self.micro)

    @property
    def time_compute_s(self) -> float:
        return sum(m.time_compute_s for m in self.micro)

    @property
    def time_h2d_s(self) -> float:
        return sum(m.time_h2d_s for m in self.micro)

    @property
    def peak_bytes(self) -> int | None:
        return largest_peak(self.micro)


def _device_ids(model, mb: MicroBatch, device, to: Callable | None = None):
    """Global node/edge IDs on the device, only when the model's dropout needs them
    (copied by ``to(tensor, copy)``, default :meth:`betty.streams.Staged.to`)."""
    to = to or Staged(device).to
    src = eid = None
    if model.training and getattr(model, "needs_node_ids", True):
        src = [to(layer.src_nid, True) for layer in mb.layers]
    if model.training and getattr(model, "needs_edge_ids", True):
        eid = [to(layer.edge_id, True) for layer in mb.layers]
    return src, eid


def _to_device_blocks(mb: MicroBatch, device, model=None, to: Callable | None = None) -> list:
    """Blocks of ``model``'s backend (``auto`` without a model) on ``device``; index
    tensors are always copied (counted per micro-batch), by ``to(tensor, copy)``
    (default :meth:`betty.streams.Staged.to`)."""
    from betty.backends import backend_of

    return backend_of(model).make_blocks(mb.layers, device, copy=True,
                                         degrees=getattr(model, "needs_degrees", False),
                                         to=to or Staged(device).to)


def host_rows(feat: torch.Tensor, ids: torch.Tensor, device) -> torch.Tensor:
    """``feat[ids]`` gathered on the host for a copy to ``device``: the rows read in
    ascending order (:func:`betty.data.store.gather_rows`: sequential reads of
    memory-mapped features), into pinned host memory for CUDA (a page-locked buffer from
    torch's caching host allocator, copied at full bus speed, ``non_blocking``)."""
    return gather_rows(feat, ids, pin=torch.device(device).type == "cuda")


def _input_features(feat: torch.Tensor, mb: MicroBatch, device, to: Callable | None = None) -> torch.Tensor:
    """``mb``'s input features on ``device``: the rows gathered ahead
    (``mb.input_features``, released from ``mb`` here) or else :func:`host_rows`, copied
    there by ``to(tensor, copy)`` (default :meth:`betty.streams.Staged.to`:
    ``non_blocking`` from pinned memory for CUDA). Where ``feat`` and ``mb``'s IDs are on
    ``device`` (the CPU, or features kept on the device for preparation there), the
    gathered rows are the device's own memory, which the memory model counts, so they
    are gathered in one ``feat[ids]`` with no second copy (from a feature file read out
    of core, :func:`betty.pages.out_of_core`, by :func:`betty.data.store.gather_rows`:
    one buffer, filled chunk by chunk, each chunk's pages read ahead and handed back)."""
    gathered, mb.input_features = mb.input_features, None
    device = torch.device(device)
    to = to or Staged(device).to
    ids = mb.input_nid
    if gathered is None and feat.device == ids.device and same_device(feat.device, device):
        return to(gather_rows(feat, ids) if out_of_core(feat) else feat[ids])
    return to(host_rows(feat, ids, device) if gathered is None else gathered)


@dataclass
class _DeviceInputs:
    """One micro-batch's inputs on the device, as :func:`_stage_inputs` put them there:
    its L ``blocks``, the global node and edge IDs its dropout keys on (``None`` where
    the model needs none), the input features ``x`` ``(n_in, F)`` in the host matrix's
    dtype (``None`` once the forward has taken them) and the labels ``y`` ``(n_out,)``
    or ``(n_out, T)``; ``staged`` records every one of these device tensors until the
    compute stream takes them (and the end of their copies on a side stream);
    ``t_block`` and ``t_h2d``: seconds spent on the blocks and IDs, and on the features
    and labels."""

    blocks: list
    src_nids: list | None
    edge_ids: list | None
    x: torch.Tensor
    y: torch.Tensor
    staged: Staged
    t_block: float
    t_h2d: float


def _stage_inputs(stream: CopyStream, model, mb: MicroBatch, feat: torch.Tensor, label: torch.Tensor,
                  device) -> _DeviceInputs:
    """Copy everything ``mb``'s forward reads to ``device`` on ``stream``
    (:meth:`betty.streams.CopyStream.staging`): the blocks, the IDs, the input features
    (``mb``'s rows gathered ahead are released), the labels."""
    start = time.perf_counter()
    with stream.staging() as staged:
        blocks = _to_device_blocks(mb, device, model, to=staged.to)
        src_nids, edge_ids = _device_ids(model, mb, device, to=staged.to)
        t_block = time.perf_counter() - start
        x = _input_features(feat, mb, device, to=staged.to)
        y = staged.to(label[mb.output_nid])
    return _DeviceInputs(blocks, src_nids, edge_ids, x, y, staged, t_block,
                         time.perf_counter() - start - t_block)


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device (``cuda`` and ``cuda:<current>`` are)."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def _micro_batch_outputs(groups: torch.Tensor, k: int,
                         indices: Collection[int] | None) -> list[tuple[int, torch.Tensor]]:
    """``(index, output positions)`` of each micro-batch in ``indices`` (default all ``k``), in
    micro-batch order; each micro-batch's outputs in ascending position."""
    order = torch.argsort(groups, stable=True)
    sizes = torch.bincount(groups, minlength=k).tolist()
    return [(index, idx) for index, idx in enumerate(torch.split(order, sizes))
            if indices is None or index in indices]


def _carve_timed(carver: Carver, entry: tuple[int, torch.Tensor]) -> tuple[int, MicroBatch, float]:
    """``(index, micro-batch, seconds to carve it)`` for ``entry = (index, outputs)``."""
    start = time.perf_counter()
    mb = carver.carve(entry[1])
    return entry[0], mb, time.perf_counter() - start


def carve_micro_batches(batch: SampledBatch, groups: torch.Tensor, k: int,
                        indices: Collection[int] | None = None, *,
                        torch_ops: bool | None = None) -> Iterator[tuple[int, MicroBatch, float]]:
    """Yield (micro-batch index, micro-batch, seconds to carve it) lazily, one micro-batch at a
    time, for the micro-batches in ``indices`` (default: all K), in micro-batch order; ``groups``
    ``(n_out,)`` is the micro-batch of each output node. The first micro-batch's seconds include
    building the :class:`betty.microbatch.Carver` (``torch_ops``: its index work in
    torch ops; ``None``: where ``batch`` is off the CPU). Micro-batches are carved on
    ``batch``'s device."""
    start = time.perf_counter()
    carver = Carver(batch, torch_ops=torch_ops)
    wanted = _micro_batch_outputs(groups, k, indices)
    setup = time.perf_counter() - start
    for entry in wanted:
        index, mb, seconds = _carve_timed(carver, entry)
        yield index, mb, seconds + setup
        setup = 0.0
        del mb  # the caller's reference is the only one while the next micro-batch is carved


def carve_all(batch: SampledBatch, groups: torch.Tensor, k: int,
              indices: Collection[int] | None = None, *,
              torch_ops: bool | None = None) -> list[tuple[int, MicroBatch, float]]:
    """:func:`carve_micro_batches` all at once: the same ``(index, micro-batch, seconds)`` list,
    the micro-batches carved on the preparation threads (:func:`betty.workers.parallel_map`;
    each thread with its own scratch, the carved micro-batches identical to a serial carve).
    For preparation that holds every micro-batch anyway (a prepared batch)."""
    start = time.perf_counter()
    carver = Carver(batch, torch_ops=torch_ops)
    wanted = _micro_batch_outputs(groups, k, indices)
    setup = time.perf_counter() - start
    carved = parallel_map(lambda entry: _carve_timed(carver, entry), wanted)
    if carved:
        index, mb, seconds = carved[0]
        carved[0] = (index, mb, seconds + setup)
    return carved


@dataclass
class _CarvedMicroBatch:
    """One carved micro-batch on its way through the step: ``mb``, the seconds it took
    to carve (``t_carve``), its device ``inputs`` once copied ahead (``None`` until
    then), and with copy-ahead the micro-batch that runs after it (``next``, ``None`` for the
    last), whose inputs it copies."""

    mb: MicroBatch
    t_carve: float
    inputs: _DeviceInputs | None = None
    next: _CarvedMicroBatch | None = None


def _micro_batches(carved: Iterable[tuple[int, MicroBatch, float]],
                   ahead: bool) -> Iterator[tuple[int, _CarvedMicroBatch]]:
    """``(index, micro_batch)`` of each carved micro-batch in order. Without ``ahead`` each is
    carved when asked for, none held while the next is carved; with ``ahead`` micro-batch
    k + 1 is carved before micro-batch k is handed out (outside micro-batch k's meter region) and
    linked as its ``next``."""
    if not ahead:
        for index, mb, seconds in carved:
            yield index, _CarvedMicroBatch(mb, seconds)
            del mb
        return
    pending: tuple[int, _CarvedMicroBatch] | None = None
    for index, mb, seconds in carved:
        micro_batch = _CarvedMicroBatch(mb, seconds)
        del mb
        if pending is not None:
            pending[1].next = micro_batch
            yield pending
        pending = (index, micro_batch)
        del micro_batch
    if pending is not None:
        yield pending


def _take_carved(micro_batches: Sequence[tuple[int, MicroBatch, float]],
                 wanted: frozenset[int]) -> Iterator[tuple[int, MicroBatch, float]]:
    """Yield the carved micro-batches in order, dropping this function's reference to each
    once the next is asked for. Raises ValueError unless they are exactly ``wanted``."""
    have = [int(i) for i, _, _ in micro_batches]
    if sorted(have) != sorted(wanted):  # also catches a micro-batch given twice
        raise ValueError(f"micro_batches carry micro-batches {sorted(have)}, but the step runs {sorted(wanted)}")
    pending = sorted(micro_batches, key=lambda entry: entry[0], reverse=True)
    if isinstance(micro_batches, list):
        micro_batches.clear()  # the caller's list held every micro-batch: now only ``pending`` does
    while pending:
        yield pending.pop()


def accumulate_gradients(
    model: torch.nn.Module,
    batch: SampledBatch,
    groups: torch.Tensor,
    feat: torch.Tensor,
    label: torch.Tensor,
    *,
    k: int | None = None,
    device: torch.device | str = "cpu",
    dropout_key: int | None = None,
    multilabel: bool = False,
    meter=None,
    dtype: torch.dtype | None = None,
    indices: Collection[int] | None = None,
    precision: Precision | str | None = None,
    scaler: LossScaler | None = None,
    micro_batches: Sequence[tuple[int, MicroBatch, float]] | None = None,
    torch_ops: bool | None = None,
    copy_ahead: bool = False,
) -> StepResult:
    """Forward and backward every micro-batch, accumulating into ``.grad``.

    Does not zero gradients and does not step: see :func:`train_step`.

    Args:
        model: a :class:`betty.models.BlockGNN` (already on ``device``).
        batch: the full sampled batch.
        groups: ``(n_out,)`` micro-batch of each output node (``batch.output_nid`` order).
        feat: ``(N, F)`` host feature matrix of the whole graph.
        label: ``(N,)`` int64 labels or ``(N, T)`` multi-label targets.
        k: number of micro-batches (default ``groups.max() + 1``).
        device: where micro-batches run.
        dropout_key: key for deterministic dropout masks.
        multilabel: use the multi-label loss.
        meter: optional :class:`betty.memory.meter.MemoryMeter`; one region per
            micro-batch (carving, which happens on the host, is outside it).
        dtype: cast features to this dtype on the device (default: the model's parameters'); under a
            mixed ``precision`` features already in its compute dtype are kept
            (:func:`betty.precision.input_dtype`).
        precision: ``32`` (default), ``64``, ``bf16-mixed`` or ``16-mixed``: forward and
            loss under autocast when mixed (:func:`accumulate_micro_batches`).
        scaler: the step's :class:`betty.precision.LossScaler` (``16-mixed``).
        indices: run only these micro-batch indices (default: all K); the normalisation stays
            the global ``1/|outputs|``, so the loss, accuracy and gradients returned are
            those micro-batches' shares of the full-batch ones (data parallelism,
            :mod:`betty.distributed`).
        micro_batches: the micro-batches carved ahead, ``(index, micro-batch, seconds to carve
            it)`` as :func:`carve_micro_batches` yields them; they must be exactly the micro-batches to
            run (all K, or ``indices``). A list is emptied, so that each micro-batch is freed
            once it has run. Default: carve them here, one at a time, on ``batch``'s
            device (``torch_ops``: that of :func:`carve_micro_batches`). With ``batch``,
            ``feat`` and ``label`` on ``device``, carving and the feature gather run
            there (preparation on the device).
        copy_ahead: copy micro-batch k+1's inputs (blocks, IDs, features, labels) to
            the device while micro-batch k computes: once k's inputs are on the device,
            before its forward, k+1's copy is issued (:mod:`betty.streams`: on CUDA on a
            side stream, from pinned memory, ``non_blocking``, the compute stream waiting
            for it before k+1 reads them; elsewhere synchronously, at the same point).
            Micro-batch k+1 is carved before micro-batch k runs. The updates are the same; each micro-batch
            but the last holds the next one's inputs beside its own (the memory model's
            ``copy_ahead``), and a meter counts a micro-batch's inputs copied ahead from its
            region's start.
    """
    groups = torch.as_tensor(groups)  # validated as given: a float or bool partition is refused
    dtype = parameter_dtype(model) if dtype is None else dtype  # once, not per micro-batch
    if k is None:
        k = int(groups.max()) + 1 if groups.numel() else 1
    groups = validate_groups(groups, batch.num_outputs, k)
    n_total = batch.num_outputs
    if indices is not None:
        indices = frozenset(int(p) for p in indices)
    if micro_batches is None:
        carved: Iterable[tuple[int, MicroBatch, float]] = carve_micro_batches(batch, groups, k, indices,
                                                                              torch_ops=torch_ops)
    else:
        carved = _take_carved(micro_batches, frozenset(range(k)) if indices is None else indices)
    stream = CopyStream(device, side=copy_ahead)

    def stage(micro_batch: _CarvedMicroBatch) -> _DeviceInputs:
        return _stage_inputs(stream, model, micro_batch.mb, feat, label, device)

    def forward(micro_batch: _CarvedMicroBatch) -> MicroBatchForward:
        inputs, micro_batch.inputs = micro_batch.inputs, None
        t_copies = 0.0  # seconds of copies made in this micro-batch's region, its own or the next's
        if inputs is None:
            inputs = stage(micro_batch)
            t_copies += inputs.t_block + inputs.t_h2d
        stream.use(inputs.staged)
        if micro_batch.next is not None:  # copy-ahead: issued now, runs while this micro-batch computes
            ahead = micro_batch.next.inputs = stage(micro_batch.next)
            t_copies += ahead.t_block + ahead.t_h2d
            del ahead
        start = time.perf_counter()
        x, inputs.x = inputs.x, None  # a cast copy replaces it
        cast = input_dtype(x.dtype, precision, dtype)
        if cast is not None:
            x = x.to(cast)
        t_cast = time.perf_counter() - start
        mb = micro_batch.mb
        logits = model(inputs.blocks, x, src_nids=inputs.src_nids, edge_ids=inputs.edge_ids,
                       dropout_key=dropout_key)
        y = inputs.y
        return MicroBatchForward(
            loss_sum=node_loss_sum(logits, y, multilabel),
            count_correct=lambda: count_correct(logits.detach(), y, multilabel),
            keep=(inputs, x),
            info={"num_outputs": mb.num_outputs, "num_inputs": mb.layers[0].num_src,
                  "num_edges": sum(layer.num_edges for layer in mb.layers),
                  "t_carve": micro_batch.t_carve, "t_block": inputs.t_block,
                  "t_h2d": inputs.t_h2d + t_cast, "t_copies": t_copies + t_cast})

    def carried(micro_batch: _CarvedMicroBatch) -> list[torch.Tensor]:
        return [] if micro_batch.inputs is None else micro_batch.inputs.staged.tensors

    runs = accumulate_micro_batches(_micro_batches(carved, ahead=copy_ahead), forward, n_total, meter=meter,
                                    precision=precision, device_type=torch.device(device).type,
                                    scaler=scaler, carried=carried)
    records = [
        MicroBatchRecord(
            index=r.index,
            num_outputs=r.info["num_outputs"],
            num_inputs=r.info["num_inputs"],
            num_edges=r.info["num_edges"],
            loss=r.loss,
            time_block_s=r.info["t_carve"] + r.info["t_block"],
            time_compute_s=r.seconds - r.info["t_copies"],
            peak_bytes=r.peak_bytes,
            time_h2d_s=r.info["t_h2d"],
        )
        for r in runs
    ]
    return StepResult(loss=sum(r.loss for r in runs),
                      train_acc=sum(r.correct for r in runs) / n_total, micro=records)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: SampledBatch,
    groups: torch.Tensor,
    feat: torch.Tensor,
    label: torch.Tensor,
    *,
    parallel=None,
    costs: Sequence[float] | None = None,
    **kwargs,
) -> StepResult:
    """Zero gradients, accumulate over all micro-batches, take one optimizer step
    (:func:`step_over_micro_batches`).

    ``parallel``: a :class:`betty.distributed.DataParallel`: this rank runs its share of
    the micro-batches (assigned by ``costs`` (K,), default
    :func:`betty.distributed.assign.micro_batch_output_costs`), gradients are all-reduced before
    the step, and the loss and accuracy returned are summed over the ranks (``micro``
    lists this rank's micro-batches). ``scaler``: the :class:`betty.precision.LossScaler` of a
    ``16-mixed`` run (made once per training run; its scale carries across steps).
    ``copy_ahead``: copy each next micro-batch's inputs to the device while the one
    before computes (a side CUDA stream; the same update, the next inputs counted in each
    micro-batch's peak: :func:`accumulate_gradients`). Other keyword arguments: those of
    :func:`accumulate_gradients` (``indices`` excepted).
    """
    if "indices" in kwargs:
        raise TypeError("train_step runs every micro-batch (or this rank's share with parallel=); "
                        "use accumulate_gradients(indices=...) for a subset")
    if parallel is not None and costs is None:
        from betty.distributed.assign import micro_batch_output_costs

        k = kwargs.get("k")
        costs = micro_batch_output_costs(groups, int(torch.as_tensor(groups).max()) + 1 if k is None else k)

    scaler = kwargs.get("scaler")
    accumulated_s = 0.0

    def run(mine, _after_last):
        nonlocal accumulated_s
        start = time.perf_counter()
        res = accumulate_gradients(model, batch, groups, feat, label, indices=mine, **kwargs)
        accumulated_s = time.perf_counter() - start
        return res.micro, res.loss, res.train_acc

    start = time.perf_counter()
    micro, loss, acc = step_over_micro_batches(model, optimizer, run, parallel=parallel, costs=costs,
                                               scaler=scaler)
    if parallel is None and micro:  # the optimizer step's wall, with the last micro-batch's compute
        micro[-1].time_compute_s += time.perf_counter() - start - accumulated_s
    return StepResult(loss=loss, train_acc=acc, micro=micro)


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every parameter gradient (zeros where none was produced)."""
    return {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
    }


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``max over parameters of ||a - b|| / max(||b||, tiny)`` (Frobenius norms); ``inf``
    where either side holds a NaN or an infinity (never a difference that passes)."""
    worst = 0.0
    for name, ref in b.items():
        denom = max(float(ref.norm()), torch.finfo(ref.dtype).tiny)
        diff = float((a[name] - ref).norm()) / denom
        if not math.isfinite(diff):
            return math.inf
        worst = max(worst, diff)
    return worst


__all__ += ["gradients", "max_relative_difference"]
