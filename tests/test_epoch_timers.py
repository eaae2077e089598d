"""Every preparation step of an epoch has its own timer, logged per epoch."""

from __future__ import annotations

import pytest
import torch

from betty.engine import PREPARATION_TIMERS, PartitionPlan, Trainer
from betty.models import build_model
from distributed_cases import CLASSES, FEATS, dataset

TIMERS = ("time_sample_s", "time_partition_s", "time_estimate_s", "time_block_s", "time_metrics_s",
          "time_h2d_s", "time_compute_s")


def _trainer(batch_size=None, reuse=None):
    torch.manual_seed(0)
    model = build_model("sage", FEATS, CLASSES, hidden=8, layers=2, aggregator="mean", dropout=0.5)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return Trainer(model, opt, dataset(), [4, 6], PartitionPlan("reg", 3, reuse=reuse), seed=1,
                   batch_size=batch_size)


@pytest.mark.parametrize("batch_size", [None, 50])
def test_every_timer_is_logged_positive_and_their_sum_fits_in_the_epoch(batch_size):
    trainer = _trainer(batch_size)
    for epoch in range(2):  # epoch 1 reuses the partition: its estimate is still timed
        record = trainer.train_epoch(epoch)
        metrics = record.metrics()
        assert set(TIMERS) | set(PREPARATION_TIMERS) | {"epoch_time_s"} <= set(metrics)
        for name in TIMERS:
            assert metrics[name] > 0, name
        parts = sum(metrics[name] for name in TIMERS)
        assert parts <= metrics["epoch_time_s"]
        assert metrics["time_idle_s"] == pytest.approx(metrics["epoch_time_s"] - metrics["time_compute_s"])
        # disjoint parts of one wall: what they leave uncovered is bookkeeping, not a step
        assert metrics["epoch_time_s"] - parts < 0.5 * metrics["epoch_time_s"]
        batches = record.batches
        assert len(batches) == (1 if batch_size is None else 3)
        for name in TIMERS:
            assert getattr(record, name) == pytest.approx(sum(getattr(b, name) for b in batches))


def test_the_estimate_of_a_reused_partition_is_not_counted_as_partitioning(monkeypatch):
    trainer = _trainer()
    trainer.train_epoch(0)
    import time

    real = trainer.estimator

    def slow(*args):
        time.sleep(0.2)
        return real(*args)

    trainer.estimator = slow
    record = trainer.train_epoch(1)  # reused: one estimate (the check) + none logged
    assert record.time_estimate_s >= 0.2
    assert record.time_partition_s < 0.2


@pytest.mark.parametrize("reuse", [None, 1])
def test_carving_ahead_is_taken_out_of_partitioning_by_its_wall_time(monkeypatch, reuse):
    """Preparation threads carve several micro-batches at once, so their own seconds sum
    to more than the wall they took: partitioning keeps what is left of its wall, >= 0."""
    import betty.train

    real = betty.train.carve_all

    def threads_at_once(*args, **kwargs):  # each micro-batch reports a second, as if carved side by side
        return [(i, mb, 1.0) for i, mb, _ in real(*args, **kwargs)]

    monkeypatch.setattr(betty.train, "carve_all", threads_at_once)
    trainer = _trainer(reuse=reuse)
    for epoch in range(2):  # a fresh partition, then a reused (or, reuse=1, a fresh) one
        prepared = trainer.prepare(epoch, 0, carve=True)
        assert sum(s for _, _, s in prepared.micro_batches) == 3.0
        assert 0 <= prepared.time_partition_s < 1.0


def test_the_optimizer_step_counts_as_compute_with_the_last_micro_batch(monkeypatch):
    import time

    trainer = _trainer()
    step = trainer.optimizer.step

    def slow_step(*args, **kwargs):
        time.sleep(0.2)
        return step(*args, **kwargs)

    monkeypatch.setattr(trainer.optimizer, "step", slow_step)
    record = trainer.train_epoch(0)
    *first, last = record.batches[0].micro
    assert last.time_compute_s >= 0.2 and all(m.time_compute_s < 0.2 for m in first)
    assert record.time_compute_s >= 0.2 and record.time_idle_s < 0.2
