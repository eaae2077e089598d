"""Helpers shared by both engines: one implementation each."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from betty.engine import EpochRecord
from betty.records import epoch_metrics, estimate_error
from betty.partition import PARTITIONERS
from betty.partition.reg import (DEFAULT_MAX_HUB_DEGREE, DEFAULT_MAX_HUB_DEGREE_ALL,
                                 reg_all_partition, reg_partition, reg_unweighted_partition)
from betty.train import largest_peak


def test_estimate_error_is_the_worst_relative_error_over_known_pairs():
    assert estimate_error([(110, 100), (90, 100), (None, 50), (7, None), (5, 0)]) == 0.1
    assert estimate_error([(None, 10), (3, None)]) is None
    assert estimate_error([]) is None


def test_both_epoch_records_name_their_shared_metrics_alike():
    from betty.rev.engine import RevEpochRecord

    common = dict(epoch=0, loss=0.5, train_acc=0.75, k=3, time_partition_s=0.1, time_compute_s=0.2,
                  epoch_time_s=0.4, peak_mem_measured_bytes=None, peak_mem_estimated_bytes=1000)
    sampled = EpochRecord(redundancy=1.5, time_sample_s=0.05, time_block_s=0.01, **common).metrics()
    rev = RevEpochRecord(edges_kept_fraction=0.9, repartitioned=True, **common).metrics()
    shared = {"loss": 0.5, "train_acc": 0.75, "k": 3.0, "time_partition_s": 0.1, "time_compute_s": 0.2,
              "epoch_time_s": 0.4, "peak_mem_estimated_bytes": 1000.0,  # unknown ones left out
              "time_wait_s": 0.0, "time_idle_s": 0.2}
    assert sampled == {**shared, "redundancy": 1.5, "time_sample_s": 0.05, "time_block_s": 0.01,
                       "time_estimate_s": 0.0, "time_metrics_s": 0.0, "time_h2d_s": 0.0,
                       "prefetch_bytes": 0.0}
    assert rev == {**shared, "edges_kept_fraction": 0.9}
    assert all(type(v) is float for v in (*sampled.values(), *rev.values()))
    measured = SimpleNamespace(**{**common, "peak_mem_measured_bytes": 1100, "mem_estimate_error": 0.1})
    assert epoch_metrics(measured)["mem_estimate_error"] == 0.1
    assert epoch_metrics(measured)["peak_mem_measured_bytes"] == 1100.0


def test_both_epoch_records_give_one_row_per_micro_batch_with_their_columns():
    import torch

    from betty.engine import PartitionPlan, Trainer
    from betty.models import build_model
    from betty.rev.engine import RevEpochRecord, RevPlan, RevTrainer
    from distributed_cases import CLASSES, FEATS, dataset

    ds = dataset()
    torch.manual_seed(0)
    model = build_model("sage", FEATS, CLASSES, hidden=8, layers=2)
    sampled = Trainer(model, torch.optim.Adam(model.parameters()), ds, [4, 6], PartitionPlan("random", 3),
                      batch_size=50).train_epoch(0)
    model = build_model("revgnn", FEATS, CLASSES, hidden=8, layers=3)
    rev = RevTrainer(model, torch.optim.Adam(model.parameters()), ds, RevPlan("random", 2)).train_epoch(0)
    for record, micro_batches in ((sampled, 3 * len(sampled.batches)), (rev, 2)):
        rows = record.rows()
        assert len(rows) == micro_batches
        assert all(tuple(row) == type(record).ROW_COLUMNS for row in rows)
        assert [row[type(record).MICRO_BATCH_KEY] for row in rows[:2]] == [0, 1]
        assert all(row["epoch"] == 0 and row["loss"] > 0 for row in rows)
    assert (EpochRecord.ROWS_TABLE, RevEpochRecord.ROWS_TABLE) == ("memory_per_microbatch", "memory_per_part")


def test_largest_peak_ignores_records_without_a_measurement():
    recs = [SimpleNamespace(peak_bytes=p) for p in (None, 5, 9, None)]
    assert largest_peak(recs) == 9
    assert largest_peak(recs[:1]) is None


def test_reg_variants_are_registered_with_their_own_names_and_hub_defaults():
    for name, fn, hub in [("reg", reg_partition, DEFAULT_MAX_HUB_DEGREE),
                          ("reg-unweighted", reg_unweighted_partition, DEFAULT_MAX_HUB_DEGREE),
                          ("reg-all", reg_all_partition, DEFAULT_MAX_HUB_DEGREE_ALL)]:
        assert PARTITIONERS[name] is fn
        assert fn.__name__ == name.replace("-", "_") + "_partition" and fn.__doc__
        assert inspect.signature(fn).parameters["max_hub_degree"].default == hub


@pytest.mark.parametrize("module", ["betty.rev.memory", "betty.memory", "betty.rev.engine",
                                    "betty.memory.ops", "betty.rev.replay", "betty.train"])
def test_each_module_imports_first_in_a_fresh_process(module):
    """No import cycle: any of these can be the first betty module a program imports
    (``import betty.rev.memory`` first used to fail on betty.memory re-exporting it)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
