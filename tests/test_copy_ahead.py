"""Copy-ahead (``Trainer(copy_ahead=True)``): micro-batch k+1's inputs are copied to the
device once micro-batch k's are there and before k's forward (on the CPU synchronously,
at the point where CUDA issues the side stream's copy), the updates are those without
it bit for bit, and the memory model counts k+1's inputs in k's peak, by exactly the
bytes the step copies, which the CPU meter confirms."""

from __future__ import annotations

import pytest
import torch

import betty.train
from betty.engine import PartitionPlan, Trainer
from betty.memory import estimate_micro_batches, search_k
from betty.memory.meter import MemoryMeter
from betty.models import build_model
from betty.partition import partition_batch
from betty.sampling import sample_full_batch
from betty.streams import CopyStream
from betty.train import accumulate_gradients, build_optimizer, train_step
from distributed_cases import CLASSES, FEATS, assert_same_training, dataset
from graphs import backend_params, power_law_graph
from test_memory_accuracy import TOLERANCE

pytestmark = pytest.mark.usefixtures("one_thread")  # bit-for-bit comparisons

MODELS = [("sage", "mean"), ("gat", None)]
MODEL_IDS = ["sage-mean", "gat"]


def _trainer(backend: str, arch: str, copy_ahead: bool, *, prefetch: int = 0, gather_ahead=None,
             dtype=torch.float32, meter: bool = False, batch_size=50, nodes: int = 240,
             hidden: int = 8):
    torch.manual_seed(0)
    model = build_model(arch, FEATS, CLASSES, hidden=hidden, layers=2, aggregator="mean", heads=2,
                        dropout=0.5, attn_dropout=0.25, backend=backend).to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    m = None
    if meter:
        m = MemoryMeter("cpu")
        m.track(model, opt)
    trainer = Trainer(model, opt, dataset(nodes), [4, 6], PartitionPlan("reg", 3, reuse=2), seed=1,
                      batch_size=batch_size, prefetch=prefetch, gather_ahead=gather_ahead, meter=m,
                      dtype=dtype, copy_ahead=copy_ahead)
    return trainer, model


def _run(backend, arch, copy_ahead, epochs: int = 3, **kwargs):
    trainer, model = _trainer(backend, arch, copy_ahead, **kwargs)
    records = list(trainer.epochs(range(epochs)))
    return {n: p.detach().clone() for n, p in model.named_parameters()}, records


def test_off_cuda_a_staging_runs_where_it_is_called_and_hands_its_tensors_over():
    """On the CPU there is no side stream: a staging's copies are made at once (a host
    tensor is the device's own, returned as is unless copied), recorded until
    :meth:`CopyStream.use` hands them to their users."""
    stream = CopyStream("cpu", side=True)
    assert stream.side is None
    t = torch.arange(6)
    with stream.staging() as staged:
        same, fresh = staged.to(t), staged.to(t, copy=True)
    assert same is t and fresh is not t and torch.equal(fresh, t)
    assert [id(x) for x in staged.tensors] == [id(same), id(fresh)] and staged.event is None
    stream.use(staged)
    assert staged.tensors == []


# -- exact ------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("arch,agg", MODELS, ids=MODEL_IDS)
@pytest.mark.parametrize("prefetch,gather_ahead", [(0, False), (1, False), (1, True)],
                         ids=["serial", "pipelined", "gathered-ahead"])
def test_copy_ahead_trains_as_without_it_bit_for_bit(backend, arch, agg, prefetch, gather_ahead):
    """Dropout on, several batches an epoch (K = 3 each), serial and pipelined, the
    features gathered in the step or ahead: the same parameters, losses and micro-batches as
    the serial run without copy-ahead."""
    reference, ref_records = _run(backend, arch, False)
    params, records = _run(backend, arch, True, prefetch=prefetch, gather_ahead=gather_ahead)
    assert_same_training(reference, ref_records, params, records)


def test_the_next_micro_batches_copy_is_issued_before_this_micro_batches_forward(monkeypatch):
    """The order of carving, staging (the inputs' copy) and forward over K = 4 micro-batches:
    with copy-ahead micro-batch k+1 is carved before micro-batch k runs and staged after micro-batch k's
    inputs, before micro-batch k's forward; without it each micro-batch is carved, staged and run
    in turn."""
    g, feat, label, train = power_law_graph(num_nodes=300, avg_degree=6, seed=2)
    batch = sample_full_batch(g, train, [4, 6], seed=1)
    k = 4
    groups = partition_batch(batch, k, "random", seed=3).groups
    torch.manual_seed(0)
    model = build_model("sage", 12, 5, hidden=8, layers=2, aggregator="mean", dropout=0.5)
    events: list[tuple[str, int]] = []
    staged_x: list[int] = []  # data pointer of each micro-batch's staged features, in micro-batch order
    carve, stage, forward = betty.train._carve_timed, betty.train._stage_inputs, model.forward

    def carving(carver, entry):
        events.append(("carve", int(entry[0])))
        return carve(carver, entry)

    def staging(*args, **kwargs):
        inputs = stage(*args, **kwargs)
        staged_x.append(inputs.x.data_ptr())
        events.append(("stage", len(staged_x) - 1))
        return inputs

    def forwarding(blocks, x, **kwargs):
        # the micro-batch whose features these are: the latest staged with this data pointer
        index = len(staged_x) - 1 - staged_x[::-1].index(x.data_ptr())
        events.append(("forward", index))
        return forward(blocks, x, **kwargs)

    monkeypatch.setattr(betty.train, "_carve_timed", carving)
    monkeypatch.setattr(betty.train, "_stage_inputs", staging)
    monkeypatch.setattr(model, "forward", forwarding)
    for copy_ahead in (False, True):
        events.clear()
        staged_x.clear()
        accumulate_gradients(model, batch, groups, feat, label, k=k, dropout_key=5,
                             copy_ahead=copy_ahead)
        if copy_ahead:
            want = [("carve", 0), ("carve", 1), ("stage", 0), ("stage", 1), ("forward", 0)]
            for i in range(1, k - 1):
                want += [("carve", i + 1), ("stage", i + 1), ("forward", i)]
            want += [("forward", k - 1)]
        else:
            want = [e for i in range(k) for e in [("carve", i), ("stage", i), ("forward", i)]]
        assert events == want, copy_ahead


# -- counted ----------------------------------------------------------------------------

def _staged_bytes(trainer: Trainer, epochs: int) -> dict[tuple[int, int], list[int]]:
    """``{(epoch, batch): bytes}``: what the step copies to the device for each micro-batch
    of each batch (everything ``_stage_inputs`` allocates, as the CPU meter counts it),
    for a fresh ``trainer`` preparing its batches in training order (so its partitions
    are those of a run)."""
    meter = MemoryMeter("cpu")
    out = {}
    for epoch in range(epochs):
        for b in trainer.batch_order(epoch):
            prepared = trainer.prepare(epoch, b, carve=True)
            out[epoch, b] = []
            for _, mb, _ in prepared.micro_batches:
                with meter.measure() as reading:
                    inputs = betty.train._stage_inputs(CopyStream("cpu"), trainer.model, mb,
                                                       trainer.dataset.feat, trainer.dataset.label, "cpu")
                out[epoch, b].append(reading.peak_bytes - reading.baseline_bytes)
                del inputs
    return out


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("arch,agg", MODELS, ids=MODEL_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_each_micro_batch_counts_the_next_micro_batches_inputs_and_the_meter_agrees(backend, arch, agg, dtype):
    """A Trainer with copy-ahead and the CPU meter: each micro-batch's estimate is the one
    without copy-ahead plus exactly the bytes the step copies for the next micro-batch (none
    for a batch's last micro-batch); what copy-ahead adds to a measured peak is at most what
    it adds to the estimate, and every measured peak is within the memory model's
    tolerance (tests/test_memory_accuracy.py) of its estimate (the meter counts a micro-batch's
    inputs copied ahead from its region's start). The measured peak is not asserted
    below the estimate outright: without copy-ahead the replay already leaves out a few
    bytes (the loss's 0-d tensors; 0.15% on DGL's float64 GAT here), which copy-ahead
    neither adds to nor hides. In float64 the features are cast after the copy: the
    float32 rows are what is held ahead."""
    tol = TOLERANCE[backend][MODEL_IDS[MODELS.index((arch, agg))]]
    size = dict(dtype=dtype, nodes=1000, hidden=32, batch_size=200)
    off, off_model = _trainer(backend, arch, False, meter=True, **size)
    on, on_model = _trainer(backend, arch, True, meter=True, **size)
    assert on.memory_kwargs == dict(off.memory_kwargs, copy_ahead=True)
    epochs = 3
    staged_bytes = _staged_bytes(_trainer(backend, arch, True, **size)[0], epochs)
    off_records = list(off.epochs(range(epochs)))
    on_records = list(on.epochs(range(epochs)))
    for name, value in off_model.named_parameters():
        assert torch.equal(value, on_model.state_dict()[name]), name
    checked = 0
    for epoch, (a, b) in enumerate(zip(off_records, on_records)):
        for x, y in zip(a.batches, b.batches):
            staged = staged_bytes[epoch, y.index]
            assert x.k == y.k == len(staged) and x.k > 1
            growth = [e_on - e_off for e_off, e_on in zip(x.micro_estimated_bytes, y.micro_estimated_bytes)]
            assert growth == staged[1:] + [0], (epoch, y.index)
            for m_off, e_off, m_on, e_on in zip(x.micro, x.micro_estimated_bytes, y.micro,
                                                  y.micro_estimated_bytes):
                # what copy-ahead adds to the measured peak, the estimate adds too
                assert m_on.peak_bytes - m_off.peak_bytes <= e_on - e_off
                assert abs(e_on - m_on.peak_bytes) / m_on.peak_bytes <= tol, (epoch, y.index, m_on.index)
                checked += 1
    assert checked >= 3 * epochs


@pytest.mark.parametrize("backend", backend_params())
def test_the_memory_report_measures_with_copy_ahead_as_it_estimates(backend):
    """``memory_report(measure=True)`` measures the step as training runs it, copy-ahead
    included: the measured micro-batches hold the next one's inputs, as the estimates do."""
    tol = TOLERANCE[backend]["sage-mean"]
    trainer, _ = _trainer(backend, "sage", True, nodes=1000, hidden=32, batch_size=200)
    report = trainer.memory_report(measure=True)
    assert report["k"] > 1 and report["max_abs_relative_error"] <= tol, report["max_abs_relative_error"]


@pytest.mark.parametrize("backend", backend_params())
def test_the_k_search_fits_the_micro_batches_with_the_next_inputs(backend):
    """``k: auto``: the search estimates with the next micro-batch's inputs, so a budget the
    plain micro-batches just fit needs more micro-batches with copy-ahead; trained with the K it picks,
    every measured peak is within the budget."""
    g, feat, label, train = power_law_graph(num_nodes=800, avg_degree=8, num_feats=40,
                                            num_classes=5, seed=800)
    batch = sample_full_batch(g, train, [4, 6], seed=1)
    torch.manual_seed(0)
    model = build_model("sage", 40, 5, hidden=64, layers=2, aggregator="mean", dropout=0.5,
                        backend=backend).train()
    opt = build_optimizer("adam", model.parameters(), 1e-3)
    train_step(model, opt, batch, torch.zeros(batch.num_outputs, dtype=torch.int64), feat, label,
               dropout_key=7)  # Adam's state exists
    kwargs = dict(method="random", seed=5, safety_margin=0.0)
    plain = search_k(batch, model, opt, memory_budget=int(0.5 * estimate_micro_batches(
        batch, torch.zeros(batch.num_outputs, dtype=torch.int64), 1, model, opt)[0].peak), **kwargs)
    budget = plain.max_peak  # the plain split at its K just fits
    assert search_k(batch, model, opt, memory_budget=budget, **kwargs).k == plain.k
    found = search_k(batch, model, opt, memory_budget=budget, copy_ahead=True, **kwargs)
    assert found.k > plain.k and found.max_peak <= budget
    assert all("next_inputs" in e.breakdown for e in found.estimates[:-1])
    meter = MemoryMeter("cpu")
    meter.track(model, opt)
    opt.zero_grad(set_to_none=True)
    result = accumulate_gradients(model, batch, found.partition.groups, feat, label, k=found.k,
                                  meter=meter, dropout_key=11, copy_ahead=True)
    assert max(m.peak_bytes for m in result.micro) <= budget


def test_the_estimate_refuses_copy_ahead_beside_a_device_store():
    g, _, _, train = power_law_graph(num_nodes=300, avg_degree=6, seed=2)
    batch = sample_full_batch(g, train, [4, 6], seed=1)
    model = build_model("sage", 12, 5, hidden=8, layers=2, aggregator="mean")
    with pytest.raises(ValueError, match="copy_ahead"):
        estimate_micro_batches(batch, torch.zeros(batch.num_outputs, dtype=torch.int64), 1, model,
                               device_store_bytes=1000, copy_ahead=True)


def test_copy_ahead_is_off_by_default_and_refused_where_it_cannot_be_counted():
    trainer, _ = _trainer("auto", "sage", False)
    assert not trainer.copy_ahead and "copy_ahead" not in trainer.memory_kwargs
    model = build_model("sage", FEATS, CLASSES, hidden=8, layers=2, aggregator="mean")
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with pytest.raises(ValueError, match="copy_ahead .* parallel"):
        Trainer(model, opt, dataset(), [4, 6], PartitionPlan("reg", 3), copy_ahead=True,
                parallel=object())
    with pytest.raises(ValueError, match="copy_ahead .* not copied"):
        Trainer(model, opt, dataset(), [4, 6], PartitionPlan("reg", 3), device="cuda",
                sample_device="cuda", copy_ahead=True)


# -- CUDA -------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_copy_ahead_trains_as_without_it_within_its_estimate():
    """On CUDA (a side stream, pinned non_blocking copies): the parameters of a run
    without copy-ahead to GPU rounding, and every measured micro-batch peak (the device's whole
    allocation) at most its estimate with the next inputs."""
    results = {}
    for copy_ahead in (False, True):
        torch.manual_seed(0)
        model = build_model("sage", FEATS, CLASSES, hidden=8, layers=2, aggregator="mean",
                            dropout=0.5).cuda()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        meter = MemoryMeter("cuda")
        meter.track(model, opt)
        trainer = Trainer(model, opt, dataset(), [4, 6], PartitionPlan("reg", 3), device="cuda",
                          seed=1, meter=meter, prefetch=1, copy_ahead=copy_ahead)
        records = list(trainer.epochs(range(2)))
        results[copy_ahead] = ({n: p.detach().cpu() for n, p in model.named_parameters()}, records)
    for name, value in results[False][0].items():
        assert torch.allclose(value, results[True][0][name], rtol=1e-5, atol=1e-6), name
    last = results[True][1][-1].batches[0]
    for m, estimated in zip(last.micro, last.micro_estimated_bytes):
        assert m.peak_bytes <= estimated * 1.05
