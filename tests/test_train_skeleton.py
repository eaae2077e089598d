"""The training-step skeleton both engines share (betty.train.accumulate_micro_batches,
step_over_micro_batches) on a linear model whose gradients are known in closed form."""

from __future__ import annotations

import contextlib

import pytest
import torch

from betty.train import MicroBatchForward, accumulate_micro_batches, step_over_micro_batches


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    xs = torch.randn(10, 3, dtype=torch.float64)
    model = model.double()
    return model, xs


def _forward(model, xs, log):
    def forward(rows):
        out = model(xs[rows]).squeeze(1)
        log.append(("forward", rows[0]))
        return MicroBatchForward(loss_sum=out.sum(), count_correct=lambda: float(len(rows)),
                                 release=lambda: log.append(("release", rows[0])),
                                 info={"n": len(rows)})
    return forward


class _Meter:
    def __init__(self, log):
        self.log = log

    @contextlib.contextmanager
    def measure(self):
        self.log.append("enter")
        reading = type("R", (), {"peak_bytes": 7})()
        yield reading
        self.log.append("exit")


def test_gradient_is_that_of_the_global_mean_and_after_last_runs_in_the_last_region():
    model, xs = _setup()
    log: list = []
    micro_batches = [(0, [0, 1, 2]), (1, [3, 4]), (2, [5, 6, 7, 8, 9])]
    runs = accumulate_micro_batches(micro_batches, _forward(model, xs, log), 10, meter=_Meter(log),
                                    last_index=2, after_last=lambda: log.append("after_last"))
    # d/dw of (1/10) Σ_v w·x_v = mean of the rows
    assert torch.allclose(model.weight.grad[0], xs.mean(0), rtol=0, atol=1e-15)
    assert [r.index for r in runs] == [0, 1, 2] and [r.correct for r in runs] == [3, 2, 5]
    assert [r.info["n"] for r in runs] == [3, 2, 5] and all(r.peak_bytes == 7 for r in runs)
    with torch.no_grad():
        assert sum(r.loss for r in runs) == pytest.approx(float(model(xs).mean()), abs=1e-12)
    assert log[-4:] == [("forward", 5), ("release", 5), "after_last", "exit"]
    assert log.count("after_last") == 1 and log.count("enter") == 3


@pytest.mark.parametrize("in_region", [False, True])
def test_step_over_micro_batches_zeroes_runs_and_steps_once(in_region):
    model, xs = _setup()
    model.weight.grad = torch.ones_like(model.weight)  # must be zeroed first
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    w0 = model.weight.detach().clone()
    seen = []

    def run(mine, after_last):
        seen.append((mine, after_last is not None))
        runs = accumulate_micro_batches([(0, [0, 1, 2, 3, 4]), (1, [5, 6, 7, 8, 9])],
                                        _forward(model, xs, []), 10, last_index=1, after_last=after_last)
        return "result", sum(r.loss for r in runs), 10.0

    result, loss, correct = step_over_micro_batches(model, opt, run, step_in_last_region=in_region)
    assert seen == [(None, in_region)] and result == "result" and correct == 10.0
    assert torch.allclose(model.weight.detach()[0], w0[0] - xs.mean(0), rtol=0, atol=1e-15)


def test_step_over_micro_batches_delegates_to_parallel_and_sums_over_ranks():
    model, xs = _setup()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    calls = {}

    class FakeParallel:
        def step(self, model_, optimizer, costs, run_micro_batches):
            calls["costs"] = costs
            return run_micro_batches([1])

        def sum_scalars(self, *values):
            return [2 * v for v in values]  # two identical ranks

    def run(mine, after_last):
        calls["mine"], calls["after_last"] = mine, after_last
        return "mine", 0.25, 3.0

    result, loss, correct = step_over_micro_batches(model, opt, run, parallel=FakeParallel(),
                                                    costs=[1.0, 2.0], step_in_last_region=True)
    assert (result, loss, correct) == ("mine", 0.5, 6.0)
    assert calls == {"costs": [1.0, 2.0], "mine": frozenset({1}), "after_last": None}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_micro_batch_loss_stops_before_its_backward(bad):
    from betty.train import NonFiniteLoss, locate_non_finite

    model, xs = _setup()
    xs[5, 0] = bad  # micro-batch 1 (rows 4..7) sees it
    log: list = []
    micro_batches = [(0, [0, 1, 2, 3]), (1, [4, 5, 6, 7]), (2, [8, 9])]
    with pytest.raises(NonFiniteLoss) as caught, locate_non_finite(epoch=3, batch=2):
        accumulate_micro_batches(micro_batches, _forward(model, xs, log), n_global=10)
    err = caught.value
    assert (err.micro_batch, err.epoch, err.batch) == (1, 3, 2) and not torch.isfinite(torch.tensor(err.value))
    assert "non-finite training loss" in str(err) and "at epoch 3, batch 2, micro-batch 1: stopping" in str(err)
    assert log == [("forward", 0), ("release", 0), ("forward", 4)]  # micro-batch 2 never ran
    # only micro-batch 0's gradient is there: the bad micro-batch's backward never ran
    assert torch.isfinite(model.weight.grad).all()
    assert torch.allclose(model.weight.grad, xs[:4].sum(0, keepdim=True) / 10)
