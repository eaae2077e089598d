"""The Trainer's memory model follows its precision: under bf16-mixed the estimate it
logs beside the measured peak is the autocast step's, and K is searched with it."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from betty.engine import PartitionPlan, Trainer
from betty.memory import MemoryMeter
from betty.models import build_model
from distributed_cases import CLASSES, FEATS, dataset

pytestmark = pytest.mark.dgl


def _multilabel(ds):
    """``ds`` with ``(N, CLASSES)`` float32 0/1 targets instead of its class labels."""
    gen = torch.Generator().manual_seed(5)
    targets = (torch.rand(ds.feat.shape[0], CLASSES, generator=gen) > 0.5).float()
    return dataclasses.replace(ds, label=targets, multilabel=True)


def _trainer(precision: str, aggregator: str = "mean", arch: str = "sage", k=4, budget=None,
             multilabel: bool = False):
    torch.manual_seed(0)
    model = build_model(arch, FEATS, CLASSES, hidden=16, layers=2, aggregator=aggregator)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    plan = PartitionPlan("random", k, memory_budget=budget)
    meter = MemoryMeter("cpu")
    meter.track(model, opt)  # parameters and Adam state count, as in the train stage
    ds = _multilabel(dataset(2000)) if multilabel else dataset(2000)
    return Trainer(model, opt, ds, [4, 6], plan, seed=1, precision=precision, meter=meter)


def test_bf16_mixed_estimate_is_the_autocast_steps():
    records = {}
    for precision in ("32", "bf16-mixed"):
        trainer = _trainer(precision)
        trainer.train_epoch(0)
        records[precision] = trainer.train_epoch(1)
    est = {p: r.peak_mem_estimated_bytes for p, r in records.items()}
    err = {p: r.mem_estimate_error for p, r in records.items()}
    # the autocast step's estimate, not the float32 one, within the float32 tolerance
    # of the SAGE-mean memory tests
    assert est["bf16-mixed"] < 0.8 * est["32"], est
    assert err["bf16-mixed"] is not None and err["bf16-mixed"] < 2e-3, err
    assert err["32"] < 2e-3, err


def test_bf16_mixed_searches_k_with_its_own_estimate():
    picked = {}
    budget = None
    for precision in ("32", "bf16-mixed"):
        probe = _trainer(precision)
        probe.train_epoch(0)
        if budget is None:  # just above the float32 K=4 peak: bf16-mixed needs fewer micro-batches
            budget = int(probe.train_epoch(1).peak_mem_estimated_bytes * 1.3)
        trainer = _trainer(precision, k="auto", budget=budget)
        trainer.train_epoch(0)
        picked[precision] = trainer.train_epoch(1).k
    assert picked["bf16-mixed"] < picked["32"], picked


def test_sage_lstm_is_followed_on_the_host_and_falls_back_to_float32_on_cuda():
    """On the host the replay follows SAGE-LSTM's autocast step (its LSTM in float32):
    no warning, and the logged estimate is within the float32 tolerance of the LSTM
    memory tests. On CUDA autocast runs the LSTM in bfloat16, a step the replay does
    not follow: the memory keywords fall back to the float32 step with a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = _trainer("bf16-mixed", aggregator="lstm")
    assert trainer.memory_kwargs["dtype"] is None, trainer.memory_kwargs
    trainer.train_epoch(0)
    err = trainer.train_epoch(1).mem_estimate_error
    assert err is not None and err < 1e-4, err
    with pytest.warns(UserWarning, match="float32 step, not its bf16-mixed step"):
        cuda = trainer._memory_kwargs(trainer.model, trainer.dataset, "cuda", torch.float32)
    assert cuda["dtype"] == torch.float32 and "precision" not in cuda, cuda


@pytest.mark.parametrize("arch", ["sage", "gat"])
def test_bf16_mixed_multilabel_estimate_is_the_autocast_steps(arch):
    """Multi-label targets (BCE loss): no float32 fallback, and the logged estimate is
    the autocast step's, within the float32 tolerance of the memory tests."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = _trainer("bf16-mixed", arch=arch, multilabel=True)
    trainer.train_epoch(0)
    record = trainer.train_epoch(1)
    assert record.mem_estimate_error is not None and record.mem_estimate_error < 2e-3, (
        record.peak_mem_estimated_bytes, record.peak_mem_measured_bytes)


def test_16_mixed_with_dgl_on_the_cpu_is_refused_before_it_fails_in_a_kernel(tmp_path, monkeypatch):
    """DGL's CPU sparse kernels take no float16: the trainer refuses it when built, and
    `betty validate` names it (an error with --strict)."""
    from test_workflow_support import invoke

    with pytest.raises(ValueError, match="16-mixed needs CUDA with the DGL backend"):
        _trainer("16-mixed")
    monkeypatch.chdir(tmp_path)
    warned = invoke("validate", "tiny", "-s", "train.precision=16-mixed", "-s", "model.backend=dgl")
    assert warned.exit_code == 0 and "warning: train.precision 16-mixed needs CUDA" in warned.stderr
    strict = invoke("validate", "tiny", "-s", "train.precision=16-mixed", "-s", "model.backend=dgl", "--strict")
    assert strict.exit_code == 2 and "error: train.precision 16-mixed needs CUDA" in strict.stderr
    assert "16-mixed" not in invoke("validate", "tiny", "-s", "train.precision=16-mixed", "-s",
                                    "model.backend=pyg").stderr
