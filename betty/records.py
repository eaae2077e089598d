"""The records both training engines keep: how an epoch's figures are named and how an
estimate's error is measured (:class:`betty.engine.EpochRecord`,
:class:`betty.rev.engine.RevEpochRecord`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["SHARED_EPOCH_METRICS", "MEMORY_METRICS", "epoch_metrics", "estimate_error"]


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
