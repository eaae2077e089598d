"""A NaN or infinite training loss stops training with :class:`betty.train.NonFiniteLoss`
(naming epoch, batch and micro-batch or part), and the workflow ends the run FAILED
with that message instead of finishing with the NaN losses dropped from its metrics."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from mlflow.tracking import MlflowClient

from test_workflow_support import invoke, runs_of

EXPERIMENT = "nonfinite-test"  # the conftest tracking fixture's experiment
FAST = ["-s", "partition.sweep.k=[2]", "-s", "partition.sweep.methods=[range]"]


SMALL_REV = ["dataset.num_nodes=300", "model.layers=2", "model.hidden=8"]


@pytest.mark.parametrize("spec", ["tiny", "synthetic_revgnn"])
def test_an_inf_feature_stops_the_first_epoch(tmp_path, monkeypatch, spec):
    from betty.train import NonFiniteLoss
    from workflow.components import load_data, make_trainer
    from workflow.specfile import load_spec

    monkeypatch.chdir(tmp_path)
    rspec = load_spec(spec, SMALL_REV if spec == "synthetic_revgnn" else [])
    ds = load_data(rspec)
    feat = ds.feat.clone()
    feat[ds.train_idx[0], 0] = float("inf")
    ds = dataclasses.replace(ds, feat=feat)
    trainer, _, _ = make_trainer(rspec, ds, torch.device("cpu"))
    with pytest.raises(NonFiniteLoss, match=r"non-finite training loss \(nan\) at epoch 0, ") as caught:
        trainer.train_epoch(0)
    assert caught.value.epoch == 0
    name = "part" if spec == "synthetic_revgnn" else "micro-batch"
    assert f", {name} {caught.value.micro_batch}: stopping" in str(caught.value)


def test_a_diverging_learning_rate_fails_the_run(tracking):
    uri, exp = tracking
    res = invoke("run", "tiny", "--experiment", EXPERIMENT, "-s", "train.lr=1.0e+30", "-s", "train.epochs=3", *FAST)
    assert res.exit_code == 1, res.output
    assert "NonFiniteLoss: non-finite training loss (nan) at epoch 1, batch 0, micro-batch 0" in res.stderr
    assert "Traceback" not in res.output
    runs = runs_of(uri, exp)
    train = [r for r in runs if r.data.tags.get("stage") == "train"]
    assert [r.info.status for r in train] == ["FAILED"]
    assert "non-finite training loss" in train[0].data.tags["error"]
    parent = [r for r in runs if r.data.tags.get("run_kind") == "main"]
    assert [r.info.status for r in parent] == ["FAILED"]
    assert not any(r.data.tags.get("stage") == "evaluate" for r in runs)
    assert MlflowClient(uri).get_metric_history(train[0].info.run_id, "loss")[0].step == 0


def test_a_diverging_learning_rate_fails_a_distributed_run(tracking):
    """On two ranks a rank's NonFiniteLoss ends the run FAILED naming the rank."""
    uri, exp = tracking
    res = invoke("run", "tiny", "--experiment", EXPERIMENT, "--nproc", "2", "-s", "train.lr=1.0e+30",
                 "-s", "train.epochs=3", *FAST, catch_exceptions=True)
    assert res.exit_code == 1, res.output
    assert re.search(r"rank \d failed: NonFiniteLoss: non-finite training loss \(nan\) at epoch 1, batch 0, "
                     r"micro-batch \d", res.stderr), res.stderr
    runs = runs_of(uri, exp)
    assert not [r for r in runs if r.info.status == "RUNNING"]
    train = [r for r in runs if r.data.tags.get("stage") == "train"]
    assert [r.info.status for r in train] == ["FAILED"]
    assert "NonFiniteLoss: non-finite training loss" in train[0].data.tags["error"]
