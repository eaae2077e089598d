"""The interface both training engines share, and the records they keep: how an epoch's
figures are named and how an estimate's error is measured (:class:`betty.engine.Trainer`
and :class:`betty.engine.EpochRecord` for sampled blocks,
:class:`betty.rev.engine.RevTrainer` and :class:`betty.rev.engine.RevEpochRecord` for
RevGNN's cluster parts: :class:`TrainerProtocol`, :class:`EpochRecordProtocol`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["SHARED_EPOCH_METRICS", "MEMORY_METRICS", "EpochRecordProtocol", "TrainerProtocol", "IdleTime",
           "SearchReports", "epoch_metrics", "estimate_error"]


@runtime_checkable
class EpochRecordProtocol(Protocol):
    """One epoch of either engine. ``metrics()``: ``{name: float}`` with the names of
    :func:`epoch_metrics`; ``rows()``: one dict per micro-batch (RevGNN: cluster part)
    with the keys :attr:`ROW_COLUMNS`; :attr:`MICRO_BATCH_NAME` names what a row describes
    (``"micro-batch"`` or ``"part"``), :attr:`MICRO_BATCH_KEY` its key in a row,
    :attr:`ROWS_TABLE` the memory table's name."""

    epoch: int
    loss: float
    k: int
    MICRO_BATCH_NAME: str
    MICRO_BATCH_KEY: str
    ROWS_TABLE: str
    ROW_COLUMNS: tuple[str, ...]

    def metrics(self) -> dict[str, float]: ...

    def rows(self) -> list[dict]: ...


@runtime_checkable
class TrainerProtocol(Protocol):
    """Either engine: ``train_epoch(e)`` trains epoch ``e`` (one step per batch;
    RevGNN: one step over the cluster parts), ``epochs(range)`` yields the same records
    with the next epochs' preparation overlapped, ``memory_report()`` estimates (and
    measures) the first epoch's micro-batches or parts, ``measure_split()`` measures
    its split (a :class:`betty.partition.Split`), ``sweep(ks)`` compares the partition
    methods over several K; ``parallel`` is the
    :class:`betty.distributed.DataParallel` of a rank (or ``None``)."""

    model: Any
    optimizer: Any
    dataset: Any
    parallel: Any

    def train_epoch(self, epoch: int) -> EpochRecordProtocol: ...

    def epochs(self, epochs: Iterable[int]) -> Iterator[EpochRecordProtocol]: ...

    def memory_report(self, measure: bool = False) -> dict: ...

    def measure_split(self, batch: Any = None) -> Any: ...

    def sweep(self, ks: Sequence[int], methods: Sequence[str] | None = None, *, batch: Any = None,
              **options: Any) -> tuple[list[dict], dict[str, str]]: ...


class IdleTime:
    """``time_idle_s`` of an epoch record with ``epoch_time_s`` and ``time_compute_s``:
    the epoch's wall not covered by compute (seconds, >= 0; the device waiting)."""

    epoch_time_s: float
    time_compute_s: float

    @property
    def time_idle_s(self) -> float:
        return max(0.0, self.epoch_time_s - self.time_compute_s)


def estimate_error(pairs: Iterable[tuple[int | None, int | None]]) -> float | None:
    """``max |estimated − measured| / measured`` over the ``(estimated, measured)`` pairs
    where both are known (and measured > 0); ``None`` when there is none."""
    errs = [abs(est - meas) / meas for est, meas in pairs if meas and est is not None]
    return max(errs) if errs else None


SHARED_EPOCH_METRICS = ("loss", "train_acc", "k", "time_partition_s", "time_compute_s", "epoch_time_s")
"""Metrics every epoch record has, under the same name as its attribute: the sampled-batch
:class:`betty.engine.EpochRecord` and the reversible :class:`betty.rev.engine.RevEpochRecord`."""

MEMORY_METRICS = ("peak_mem_measured_bytes", "peak_mem_estimated_bytes", "mem_estimate_error")


def epoch_metrics(record, own: Sequence[str] = ()) -> dict[str, float]:
    """An epoch record's metrics with their stable MLflow names, each a float: the
    :data:`SHARED_EPOCH_METRICS`, then the record's ``own`` attributes, then those of
    :data:`MEMORY_METRICS` that are known (not ``None``). A metric's name is its
    attribute's, so the two epoch loops cannot name one quantity two ways."""
    out = {name: float(getattr(record, name)) for name in (*SHARED_EPOCH_METRICS, *own)}
    for name in MEMORY_METRICS:
        value = getattr(record, name)
        if value is not None:
            out[name] = float(value)
    return out


class SearchReports:
    """A trainer's K searches, kept from when a split is made (on a preparation thread,
    maybe ahead of its step) until its batch or epoch trains, so that a split that never
    trains (an early stop) reports none. Where it splits, a trainer sets
    ``_pending_search``; it takes it with :meth:`_take_search` and reports it with
    :meth:`_report_search`. ``search_result``: the latest reported; ``on_search``:
    called with each."""

    search_result: Any = None
    on_search: Any = None
    _pending_search: Any = None

    def _take_search(self):
        """The K search of the split just made (``None``: none ran), taken from the
        pending slot."""
        search, self._pending_search = self._pending_search, None
        return search

    def _report_search(self, search) -> None:
        """Make ``search`` the latest ``search_result`` and hand it to ``on_search``."""
        if search is None:
            return
        self.search_result = search
        if self.on_search is not None:
            self.on_search(search)
