"""Epochs with validation, model selection and early stopping, on one process or N ranks.

:func:`fit` drives either trainer (:class:`betty.engine.Trainer` for sampled blocks,
:class:`betty.rev.engine.RevTrainer` for RevGNN): both yield epoch records with
``metrics()`` and ``rows()`` from ``trainer.epochs(...)``. Every ``every`` epochs rank 0
scores validation (``validate``), a :class:`betty.selection.BestValidation` keeps the
best weights and decides an early stop. On N ranks (``trainer.parallel``, a
:class:`betty.distributed.DataParallel`) every rank calls :func:`fit` with the same
trainer; after each epoch the ranks' figures are gathered on rank 0
(:func:`betty.distributed.gather.gather_epoch`) and rank 0's validation score is shared,
so every rank's selector keeps the same epoch's weights and all ranks leave after the same
epoch.

Example (one process)::

    result = fit(trainer, 20, validate=lambda epoch, k: {"valid_acc": score(trainer.model)},
                 selector=BestValidation("best_valid", patience=3))
    result.history[-1]["loss"], result.selection.get("best_epoch")
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from betty.records import TrainerProtocol

__all__ = ["FitResult", "fit", "mean_std", "summarize_repeats"]


@dataclass
class FitResult:
    """What :func:`fit` returns on rank 0.

    Attributes:
        history: one entry per epoch trained, ``{"epoch": e, **metrics}`` (the record's
            metrics, the gathered ranks' figures and, when scored, ``validate``'s).
        rows: every micro-batch (RevGNN: part) row of every epoch, ``row_labels`` first
            (on N ranks each with its ``rank``).
        record: the epoch record type (its ``ROWS_TABLE``, ``ROW_COLUMNS``, ``MICRO_BATCH_NAME``).
        selection: the selector's metrics (``best_<score_key>``, ``best_epoch``,
            ``stopped_epoch``).
    """

    history: list[dict] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    record: type | None = None
    selection: dict[str, float] = field(default_factory=dict)


def fit(trainer: TrainerProtocol, epochs: int, *, validate: Callable[[int, int], Mapping[str, float]] | None = None,
        every: int = 1, selector: Any = None, score_key: str = "valid_acc",
        on_epoch: Callable[[dict, bool], None] | None = None,
        before_epoch: Callable[[int], None] | None = None,
        row_labels: Mapping[str, Any] | None = None) -> FitResult | None:
    """Train ``epochs`` epochs of ``trainer`` (see the module docstring).

    Args:
        trainer: a ``Trainer`` or ``RevTrainer`` (:class:`betty.records.TrainerProtocol`);
            its ``parallel`` (or ``None``) says whether this is one rank of several.
        epochs: the most epochs to train (an early stop ends sooner).
        validate: ``validate(epoch, k) -> {name: score}`` on rank 0 every ``every``
            epochs, after the epoch's step (``k``: the epoch's micro-batches or parts);
            ``None`` or ``every = 0``: no scoring.
        selector: a :class:`betty.selection.BestValidation` fed ``score_key`` of each
            scored epoch (default: one with ``select="last"``, no early stop); its weights
            are loaded into ``trainer.model`` at the end, on every rank (each rank's
            selector is fed rank 0's scores, so all keep the same epoch's weights and stop
            after the same epoch). A scored epoch without
            ``score_key`` is an error when the selector needs it (``best_valid``, or a
            patience).
        on_epoch: called on rank 0 with each history entry and whether it is the last
            one (the last of ``epochs``, or an early stop).
        before_epoch: called on every rank with the epoch number before it trains.
        row_labels: keys put before each micro-batch row (e.g. ``{"repeat": r}``).

    Returns:
        a :class:`FitResult` on rank 0 (in one process: always); ``None`` on the others.
    """
    from betty.selection import BestValidation

    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be an integer >= 1, got {epochs!r}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"every must be an integer >= 0 (0: never score), got {every!r}")
    selector = selector if selector is not None else BestValidation("last")
    parallel = trainer.parallel
    rank = 0 if parallel is None else parallel.rank
    labels = dict(row_labels or {})
    result = FitResult()
    with closing(trainer.epochs(range(epochs))) as records:
        for epoch in range(epochs):
            reduced_before = None if parallel is None else (parallel.reduce_bytes, parallel.reduce_wait_s)
            if before_epoch is not None:
                before_epoch(epoch)
            record = next(records)
            result.record = type(record)
            metrics, rows = record.metrics(), [{**labels, **row} for row in record.rows()]
            if parallel is not None:
                from betty.distributed.gather import gather_epoch

                metrics, rows = gather_epoch(record, parallel, reduced_before, metrics, rows)
            due = validate is not None and bool(every) and (epoch + 1) % every == 0
            score = None
            if due and rank == 0:
                validated = validate(epoch, record.k)
                metrics.update(validated)
                if score_key in metrics:
                    score = float(metrics[score_key])
                elif selector.select == "best_valid" or selector.patience is not None:
                    raise ValueError(f"validate returned {sorted(validated)} without score_key "
                                     f"{score_key!r}, which the selector's select={selector.select!r}"
                                     f"/patience={selector.patience!r} needs; pass the score_key "
                                     f"validate returns")
            if due and parallel is not None:  # rank 0's score on every rank: every selector
                scored, value = parallel.share_scalars(score is not None, math.nan if score is None else score)
                score = value if scored else None  # keeps the same weights and stops with it
            if score is not None:
                selector.update(epoch, score, trainer.model)
            stop = due and selector.should_stop()
            if rank == 0:
                result.history.append({"epoch": epoch, **metrics})
                result.rows.extend(rows)
                if on_epoch is not None:
                    on_epoch(result.history[-1], stop or epoch + 1 == epochs)
            if stop:
                break
    selector.apply(trainer.model)  # on every rank: the weights are the same everywhere
    if rank != 0:
        return None
    result.selection = selector.metrics(score_key)
    return result


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """The mean and the population std of ``values`` x_1 .. x_R,

        mean = (1/R) Σ_r x_r,   std = sqrt((1/R) Σ_r (x_r - mean)²);

    with a NaN or infinite value among them the mean is their plain IEEE sum over R
    (NaN or infinite) and the std NaN: a diverged repeat shows in the summary."""
    import statistics

    if not values:
        raise ValueError("mean_std needs at least one value")
    if not all(math.isfinite(v) for v in values):
        return sum(values) / len(values), math.nan
    return statistics.fmean(values), statistics.pstdev(values)


def summarize_repeats(finals: list[Mapping[str, float]]) -> dict[str, float]:
    """The final metrics of R repeats (e.g. :func:`fit` with R seeds) as one summary: for
    every metric ``m`` present in all of them, ``m`` and ``m_mean`` their mean and
    ``m_std`` their population std (:func:`mean_std`). Metrics missing from some repeat
    are left out."""
    if not finals:
        raise ValueError("summarize_repeats needs the metrics of at least one repeat")
    out = {}
    for key in [k for k in finals[0] if all(k in f for f in finals)]:
        mean, std = mean_std([float(f[key]) for f in finals])
        out[key] = out[f"{key}_mean"] = mean
        out[f"{key}_std"] = std
    return out
