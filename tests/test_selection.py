"""Best-validation model selection and early stopping (betty.selection.BestValidation),
in the library (both trainers) and through the workflow's train and evaluate stages."""

from __future__ import annotations

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient

from betty.selection import BestValidation
from workflow.components import load_data, make_trainer
from workflow.pipeline import run_stage
from workflow.specfile import SpecError, load_spec

# a crafted validation curve: best at epoch 3, then no improvement (a tie at epoch 5)
CURVE = [0.50, 0.60, 0.55, 0.80, 0.70, 0.80, 0.75, 0.79]
NO_SWEEP = ["partition.sweep.k=[]"]


class _Weights(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))


def test_early_stopping_stops_after_patience_evaluations_without_improvement():
    tracker = BestValidation("best_valid", patience=3)
    model = _Weights()
    stopped_at = None
    for epoch, score in enumerate(CURVE):
        with torch.no_grad():
            model.w.fill_(epoch)  # the weights after this epoch's step
        tracker.update(epoch, score, model)
        if tracker.should_stop():
            stopped_at = epoch
            break
    # best 0.80 at epoch 3; epochs 4, 5 (a tie is no improvement), 6 do not improve
    assert stopped_at == 6 == tracker.stopped_epoch
    assert tracker.best_epoch == 3 and tracker.best_score == 0.80
    assert torch.equal(tracker.state_dict()["w"], torch.full((3,), 3.0))
    assert tracker.metrics() == {"best_valid_acc": 0.80, "best_epoch": 3.0, "stopped_epoch": 6.0}


def test_no_early_stop_without_patience_and_last_keeps_no_copy():
    tracker = BestValidation("last")
    for epoch, score in enumerate(CURVE):
        tracker.update(epoch, score, _Weights())
        assert not tracker.should_stop()
    assert tracker.state_dict() is None and tracker.best_epoch == 3
    assert "stopped_epoch" not in tracker.metrics()


def test_best_valid_without_a_model_is_refused_before_any_state_changes():
    tracker = BestValidation("best_valid")
    with pytest.raises(ValueError, match="needs the model"):
        tracker.update(0, 0.9)
    assert tracker.best_score is None and tracker.evaluations == 0
    assert tracker.update(1, 0.5, _Weights())  # the next score still improves: the weights are kept
    assert tracker.best_epoch == 1 and tracker.state_dict() is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy's device differs from the model's on a GPU")
def test_the_kept_weights_take_no_device_memory():
    model = _Weights().cuda()
    tracker = BestValidation("best_valid")
    tracker.update(0, 0.9, model)
    assert tracker.state_dict()["w"].device.type == "cpu"
    tracker.apply(model)
    assert model.w.device.type == "cuda"


@pytest.mark.parametrize("kwargs", [{"select": "best"}, {"patience": 0}, {"patience": 1.5}])
def test_invalid_tracker_arguments_are_refused(kwargs):
    with pytest.raises(ValueError, match="select|patience"):
        BestValidation(**kwargs)


def _train(rspec, epochs, scores=None):
    """Train ``epochs`` epochs; with ``scores``, feed them to a best_valid tracker after
    each step. Returns (final state, tracker)."""
    ds = load_data(rspec)
    trainer, model, _ = make_trainer(rspec, ds, torch.device("cpu"))
    tracker = BestValidation("best_valid")
    for epoch in range(epochs):
        trainer.train_epoch(epoch)
        if scores is not None:
            tracker.update(epoch, scores[epoch], model)
    return {k: v.clone() for k, v in model.state_dict().items()}, tracker


@pytest.mark.parametrize("arch", ["sage", "revgnn"])
def test_selected_state_is_bitwise_the_state_of_a_run_truncated_at_the_best_epoch(tracking, arch):
    extra = ["model.arch=revgnn", "partition.method=random"] if arch == "revgnn" else []
    rspec = load_spec("tiny", NO_SWEEP + extra)
    final, tracker = _train(rspec, len(CURVE), CURVE)
    truncated, _ = _train(rspec, tracker.best_epoch + 1)
    selected = tracker.state_dict()
    assert tracker.best_epoch == 3
    assert selected.keys() == truncated.keys()
    assert all(torch.equal(selected[k], truncated[k]) for k in truncated)
    # training went on after the best epoch: the final weights differ from the selected ones
    assert any(not torch.equal(final[k], selected[k]) for k in final if final[k].is_floating_point())


def _model_state(run_id, tmp_path):
    path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="model.pt", dst_path=str(tmp_path))
    return torch.load(path, weights_only=True)


def test_workflow_logs_selection_metrics_and_evaluate_scores_the_selected_weights(tracking, tmp_path):
    client = MlflowClient(tracking[0])
    select = ["evaluate.select=best_valid", "train.epochs=15", "train.lr=0.2", "train.measure_memory=false"]
    rspec = load_spec("tiny", NO_SWEEP + select)
    train_id, final = run_stage("train", rspec)
    metrics = client.get_run(train_id).data.metrics
    best = int(metrics["best_epoch"])
    assert best < 14  # training went on past the best epoch
    history = [m.value for m in client.get_metric_history(train_id, "valid_acc")]
    assert metrics["best_valid_acc"] == max(history) == history[best]
    assert history.index(max(history)) == best  # the first epoch reaching the best score
    # the logged model is the best epoch's: a run truncated there, with select: last, logs the same weights
    short = load_spec("tiny", NO_SWEEP + select[1:] + [f"train.epochs={best + 1}"])
    short_id, _ = run_stage("train", short)
    selected, truncated = _model_state(train_id, tmp_path / "a"), _model_state(short_id, tmp_path / "b")
    assert all(torch.equal(selected[k], truncated[k]) for k in truncated)
    eval_id, scores = run_stage("evaluate", rspec, {"train": train_id})
    assert scores["valid_acc"] == pytest.approx(metrics["best_valid_acc"], abs=1e-12)
    assert "stopped_epoch" not in metrics


def test_workflow_early_stopping_logs_the_stopping_epoch(tracking, monkeypatch):
    import workflow.training as training

    client = MlflowClient(tracking[0])
    curve = iter(CURVE)
    monkeypatch.setattr(training, "evaluate_model", lambda *a, **k: {"valid_acc": next(curve)})
    rspec = load_spec("tiny", NO_SWEEP + ["train.epochs=8", "train.early_stopping={patience: 2}",
                                          "train.measure_memory=false"])
    train_id, final = run_stage("train", rspec)
    metrics = client.get_run(train_id).data.metrics
    assert (metrics["best_epoch"], metrics["stopped_epoch"], metrics["best_valid_acc"]) == (3, 5, 0.80)
    assert [m.step for m in client.get_metric_history(train_id, "loss")] == list(range(6))


@pytest.mark.parametrize("overrides, path", [
    (["evaluate.select=best"], "evaluate.select"),
    (["evaluate.select=best_valid", "evaluate.every=0"], "evaluate.every"),
    (["train.early_stopping={patience: 0}"], "train.early_stopping.patience"),
    (["train.early_stopping={patience: 3}", "evaluate.every=0"], "evaluate.every"),
])
def test_spec_refuses_bad_selection_settings(overrides, path):
    with pytest.raises(SpecError) as err:
        load_spec("tiny", overrides)
    assert path in str(err.value)


@pytest.mark.slow
def test_distributed_training_selects_and_stops_like_one_process(tracking):
    client = MlflowClient(tracking[0])
    select = ["evaluate.select=best_valid", "train.epochs=15", "train.lr=0.2", "train.measure_memory=false",
              "train.early_stopping={patience: 1}"]
    rspec = load_spec("tiny", NO_SWEEP + select + ["train.world_size=2"])
    train_id, _ = run_stage("train", rspec)
    metrics = client.get_run(train_id).data.metrics
    history = [m.value for m in client.get_metric_history(train_id, "valid_acc")]
    best, stopped = int(metrics["best_epoch"]), int(metrics["stopped_epoch"])
    assert metrics["best_valid_acc"] == max(history) == history[best]
    assert stopped == best + 1 == len(history) - 1  # patience 1: the first evaluation without improvement
    # every rank left the loop together and rank 0 handed on the best epoch's weights
    _, scores = run_stage("evaluate", rspec, {"train": train_id})
    assert scores["valid_acc"] == pytest.approx(metrics["best_valid_acc"], abs=1e-12)
