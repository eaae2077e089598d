"""A memory budget is kept: a fixed ``partition.k`` estimated over it is refused (naming
the key, the estimated peak and the budget, and how to proceed), and with ``k: auto``
and ``safety_margin: 0`` the measured peak of the chosen K stays within the budget."""

from __future__ import annotations

import pytest
import torch

from test_workflow_support import invoke, runs_of

EXPERIMENT = "budget-test"  # the conftest tracking fixture's experiment
FAST = ["-s", "partition.sweep.k=[2]", "-s", "partition.sweep.methods=[range]"]


def test_fixed_k_over_its_budget_fails_the_run(tracking):
    uri, exp = tracking
    # 64 KiB: above what the optimizer step needs, below the largest of K = 2 micro-batches
    res = invoke("run", "tiny", "--experiment", EXPERIMENT, "-s", "partition.memory_budget=64KiB", *FAST)
    assert res.exit_code == 1, res.output
    err = res.stderr
    assert "partition.k = 2 does not fit partition.memory_budget: its largest micro-batch is estimated at" in err
    assert "over the usable budget 62259 bytes (memory_budget 65536 with safety_margin 0.05)" in err
    assert "Set partition.k: auto to choose a K that fits, or raise partition.memory_budget to at least" in err
    train = [r for r in runs_of(uri, exp) if r.data.tags.get("stage") == "train"]
    assert [r.info.status for r in train] == ["FAILED"]
    assert "partition.k = 2 does not fit" in train[0].data.tags["error"]
    # without a budget the same K trains
    assert invoke("run", "tiny", "--experiment", EXPERIMENT, *FAST).exit_code == 0


def test_fixed_k_of_parts_over_its_budget_is_refused(tmp_path, monkeypatch):
    from betty.memory.ksearch import BudgetExceeded
    from workflow.components import load_data, make_trainer
    from workflow.specfile import load_spec

    monkeypatch.chdir(tmp_path)
    rspec = load_spec("synthetic_revgnn", ["dataset.num_nodes=300", "model.layers=2", "model.hidden=8",
                                           "partition.memory_budget=1KiB"])
    trainer, _, _ = make_trainer(rspec, load_data(rspec), torch.device("cpu"))
    with pytest.raises(BudgetExceeded, match=r"partition.k = 3 does not fit partition.memory_budget: its largest "
                                             r"part is estimated at \d+ bytes"):
        trainer.train_epoch(0)


@pytest.mark.dgl
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_auto_k_without_margin_measures_within_its_budget(tmp_path, monkeypatch, layers):
    """The budget is the K = 1 estimate of the first batch exactly: K = 1 is chosen and
    its measured peak must not exceed it (DGL's per-block host tensors count)."""
    from betty.memory.meter import MemoryMeter
    from workflow.components import load_data, make_trainer
    from workflow.specfile import load_spec

    monkeypatch.chdir(tmp_path)
    shape = [f"model.layers={layers}", f"sampling.fanouts=[{','.join(['3'] * layers)}]",
             "train.optimizer=sgd", "model.backend=dgl"]
    probe = load_spec("tiny", [*shape, "partition.k=1"])
    ds = load_data(probe)
    trainer, _, _ = make_trainer(probe, ds, torch.device("cpu"))
    batch = trainer.sample(0)
    budget = max(trainer.estimator(batch, torch.zeros(batch.num_outputs, dtype=torch.int64), 1))

    rspec = load_spec("tiny", [*shape, "partition.k=auto", f"partition.memory_budget={budget}",
                               "partition.safety_margin=0"])
    meter = MemoryMeter(torch.device("cpu"))
    trainer, model, optimizer = make_trainer(rspec, ds, torch.device("cpu"), meter=meter)
    meter.track(model, optimizer)
    record = trainer.train_epoch(0)
    assert record.k == 1
    assert record.peak_mem_measured_bytes <= budget, (record.peak_mem_measured_bytes, budget)
