"""Preparation on the device (``Trainer(sample_device=)``): carving in torch ops gives
the NumPy path's micro-batches bit for bit, a Trainer preparing on the CPU's torch-op path
trains as the host path bit for bit (both backends, dropout, pipelined), and the memory
model counts what preparation keeps on a device, tensor by tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import betty.train
from betty.engine import PartitionPlan, Trainer
from betty.memory import device_preparation as prep
from betty.memory.estimator import estimate_micro_batches
from betty.memory.ksearch import KSearchError, search_k
from betty.memory.meter import MemoryMeter
from betty.memory.sizes import split_sizes
from betty.microbatch import Carver
from betty.models import build_model
from betty.sampling import sample_full_batch
from distributed_cases import CLASSES, FEATS, assert_same_training, dataset
from graphs import backend_params, power_law_graph
from test_pipeline import trainer_case

pytestmark = pytest.mark.usefixtures("one_thread")  # bit-for-bit comparisons

LAYER_TENSORS = ("src_nid", "edge_src", "edge_dst", "edge_id", "src_out_degree")


def _batch(fanouts=(3, -1, 4), seed: int = 3, shuffle_edges: bool = False):
    graph = power_law_graph(num_nodes=400, avg_degree=7, seed=3)[0]
    outputs = torch.arange(0, 400, 3)
    outputs = outputs[torch.randperm(outputs.numel(), generator=torch.Generator().manual_seed(1))]
    batch = sample_full_batch(graph, outputs, list(fanouts), seed=seed)
    if shuffle_edges:  # edges not destination-sorted: the carver keeps an edge order
        for layer in batch.layers:
            perm = torch.randperm(layer.num_edges, generator=torch.Generator().manual_seed(0))
            layer.edge_src, layer.edge_dst, layer.edge_id = (
                layer.edge_src[perm], layer.edge_dst[perm], layer.edge_id[perm])
    return batch


def _assert_same_micro_batch(a, b) -> None:
    assert torch.equal(a.output_index, b.output_index)
    for x, y in zip(a.full_src_index, b.full_src_index):
        assert torch.equal(x, y)
    for la, lb in zip(a.layers, b.layers):
        assert la.num_dst == lb.num_dst
        for name in LAYER_TENSORS:
            x, y = getattr(la, name), getattr(lb, name)
            assert (x is None) == (y is None), name
            if x is not None:
                assert x.dtype == y.dtype and torch.equal(x, y), name


@pytest.mark.parametrize("shuffle_edges", [False, True], ids=["sorted", "shuffled"])
@pytest.mark.parametrize("k", [1, 3, 40])  # 40: small micro-batches (sort branch); 1-3: scan branch
def test_torch_op_carving_gives_the_numpy_micro_batches(k, shuffle_edges):
    batch = _batch(shuffle_edges=shuffle_edges)
    groups = torch.randint(0, k, (batch.num_outputs,), generator=torch.Generator().manual_seed(2))
    numpy_carver, torch_carver = Carver(batch), Carver(batch, torch_ops=True)
    assert not numpy_carver.torch_ops and torch_carver.torch_ops
    for p in range(k):
        index = torch.nonzero(groups == p).view(-1)
        _assert_same_micro_batch(numpy_carver.carve(index), torch_carver.carve(index))


@pytest.mark.parametrize("shuffle_edges", [False, True], ids=["sorted", "shuffled"])
@pytest.mark.parametrize("granule", [1, 512])
def test_the_modelled_bytes_are_those_of_the_tensors(granule, shuffle_edges):
    """``Carver.state_bytes``, ``batch_bytes`` and ``carved_bytes`` against the tensors a
    Carver and its micro-batches actually hold."""
    batch = _batch(shuffle_edges=shuffle_edges)
    carver = Carver(batch, torch_ops=True)
    assert Carver.state_bytes(batch, granule) == carver.nbytes(granule)
    blocks = [getattr(layer, name) for layer in batch.layers for name in LAYER_TENSORS]
    assert prep.batch_bytes(batch, granule) == prep.tensor_bytes(blocks, granule) + carver.nbytes(granule)
    k = 5
    groups = torch.randint(0, k, (batch.num_outputs,), generator=torch.Generator().manual_seed(4))
    modelled = prep.carved_bytes(split_sizes(batch, groups, k), out_degrees=True, granule=granule)
    for p in range(k):
        # a device copy of the outputs, as carving on a device makes (on the CPU a view)
        mb = carver.carve(torch.nonzero(groups == p).view(-1).clone())
        tensors = [mb.output_index, *mb.full_src_index,
                   *(getattr(layer, name) for layer in mb.layers for name in LAYER_TENSORS)]
        assert modelled[p] == prep.tensor_bytes(tensors, granule), p


def test_the_estimate_adds_the_store_the_batch_and_each_carved_micro_batch():
    batch = _batch()
    k = 4
    groups = torch.randint(0, k, (batch.num_outputs,), generator=torch.Generator().manual_seed(5))
    model = build_model("sage", 8, 5, hidden=16, layers=3, aggregator="mean")
    host = estimate_micro_batches(batch, groups, k, model, "adam", backend="cuda")
    store = 10 * 2**20
    device = estimate_micro_batches(batch, groups, k, model, "adam", backend="cuda", device_store_bytes=store)
    carved = prep.carved_bytes(split_sizes(batch, groups, k), out_degrees=True, granule=512)
    fixed = store + prep.batch_bytes(batch, 512)
    for i, (a, b) in enumerate(zip(host, device)):
        assert b.peak - a.peak == fixed + int(carved[i])
        assert b.breakdown["device_store"] == fixed and b.breakdown["carved"] == carved[i]
        assert b.fixed - a.fixed == fixed
        assert "device_store" not in a.breakdown


def test_the_k_search_fits_the_micro_batches_beside_the_device_store():
    batch = _batch()
    model = build_model("sage", 8, 5, hidden=16, layers=3, aggregator="mean")
    kwargs = dict(method="random", backend="cuda", safety_margin=0.0)
    budget = int(estimate_micro_batches(batch, torch.zeros(batch.num_outputs, dtype=torch.int64), 1,
                                 model, "adam", backend="cuda")[0].peak * 1.01)
    assert search_k(batch, model, "adam", memory_budget=budget, **kwargs).k == 1
    fixed = prep.batch_bytes(batch, 512)
    found = search_k(batch, model, "adam", memory_budget=budget + fixed,
                     device_store_bytes=budget // 10, **kwargs)
    assert found.k > 1
    assert max(e.peak for e in found.estimates) <= budget + fixed
    assert all("carved" in e.breakdown for e in found.estimates)
    with pytest.raises(KSearchError, match="device store and batch") as err:
        search_k(batch, model, "adam", memory_budget=budget, device_store_bytes=budget, **kwargs)
    assert err.value.dominant.endswith("+device_store")


def test_store_bytes_count_the_csr_features_and_labels():
    ds = dataset()
    indptr, indices, eid = ds.graph.in_csr
    parts = [indptr, indices, eid, ds.graph.out_degrees(), ds.feat, ds.label]
    assert prep.store_bytes(ds.graph, ds.feat, ds.label) == sum(
        t.numel() * t.element_size() for t in parts if t is not None)


# -- the Trainer -------------------------------------------------------------------

def _trainer(backend: str, sample_device=None, prefetch: int = 0, meter: bool = False,
             batch_size=None):
    return trainer_case(prefetch, backend, batch_size=batch_size, meter=meter, sample_device=sample_device)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("prefetch,batch_size", [(0, None), (1, 50)])
def test_preparing_on_the_cpu_device_path_trains_as_the_host_bit_for_bit(monkeypatch, backend,
                                                                          prefetch, batch_size):
    """The sampler, carving and the gather in torch ops (``sample_device="cpu"``): the same
    parameters, losses, micro-batches and measured peaks as the host path."""
    host, host_model = _trainer(backend, prefetch=prefetch, meter=True, batch_size=batch_size)
    host_records = list(host.epochs(range(3)))
    made = []

    class Recording(Carver):
        def __init__(self, full, *, torch_ops=None):
            super().__init__(full, torch_ops=torch_ops)
            made.append(self.torch_ops)

    monkeypatch.setattr(betty.train, "Carver", Recording)
    device, device_model = _trainer(backend, "cpu", prefetch=prefetch, meter=True, batch_size=batch_size)
    records = list(device.epochs(range(3)))
    assert made and all(made)  # every carve ran in torch ops
    assert_same_training(dict(host_model.named_parameters()), host_records,
                         dict(device_model.named_parameters()), records)
    for a, b in zip(host_records, records):
        assert a.peak_mem_measured_bytes == b.peak_mem_measured_bytes
        assert a.peak_mem_estimated_bytes == b.peak_mem_estimated_bytes


def test_preparing_on_a_cuda_device_needs_it_to_train_there_without_prefetch():
    with pytest.raises(ValueError, match="must be the training device"):
        _trainer("auto", "cuda")
    model = build_model("sage", FEATS, CLASSES, hidden=8, layers=2, aggregator="mean")
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with pytest.raises(ValueError, match="use prefetch=0"):
        Trainer(model, opt, dataset(), [4, 6], PartitionPlan("reg", 3), device="cuda",
                prefetch=1, sample_device="cuda")


def test_the_cpu_path_counts_no_device_store():
    """On the CPU the store is the host's own tensors: nothing is copied, and the memory
    model's keywords are the host path's."""
    host, _ = _trainer("auto")
    device, _ = _trainer("auto", "cpu")
    assert device.memory_kwargs == host.memory_kwargs
    feat, label = device._device_store()
    assert feat is device.dataset.feat and label is device.dataset.label


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_trainer_prepares_on_the_device_within_the_estimate():
    """On CUDA: every measured micro-batch peak (the device's whole allocation) is at most the
    estimate, which counts the store, the batch and the carved micro-batch."""
    torch.manual_seed(0)
    model = build_model("sage", FEATS, CLASSES, hidden=8, layers=2, aggregator="mean").cuda()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    meter = MemoryMeter("cuda")
    meter.track(model, opt)
    trainer = Trainer(model, opt, dataset(), [4, 6], PartitionPlan("reg", 3), device="cuda",
                      meter=meter, sample_device="cuda")
    assert "device_store_bytes" in trainer.memory_kwargs
    records = list(trainer.epochs(range(2)))
    last = records[-1].batches[0]
    assert np.isfinite(last.loss)
    for measured, estimated in zip((m.peak_bytes for m in last.micro), last.micro_estimated_bytes):
        assert measured <= estimated * 1.05
