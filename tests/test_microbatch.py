"""Carving micro-batches out of a sampled batch: structure and ID mappings."""

from __future__ import annotations

import pytest
import torch

from betty.batch import LayerEdges, SampledBatch
from betty.microbatch import Carver, carve, split, validate_groups
from betty.sampling import sample_full_batch
from graphs import power_law_graph


@pytest.fixture(scope="module")
def batch():
    g, _, _, train = power_law_graph(num_nodes=500, avg_degree=6, seed=1)
    return sample_full_batch(g, train, [4, 5, 6], seed=2)


def _neighbours(layer: LayerEdges) -> dict[int, list[int]]:
    """global dst ID -> its sampled sources' global IDs, in block edge order."""
    out: dict[int, list[int]] = {int(d): [] for d in layer.dst_nid}
    for s, d in zip(layer.src_nid[layer.edge_src].tolist(), layer.dst_nid[layer.edge_dst].tolist()):
        out[d].append(s)
    return out


def _check_micro_batch(full: SampledBatch, mb, index: torch.Tensor) -> None:
    assert torch.equal(mb.output_nid, full.output_nid[index])
    for l, (fl, ml) in enumerate(zip(full.layers, mb.layers)):
        # explicit micro -> full -> raw ID maps
        assert torch.equal(fl.src_nid[mb.full_src_index[l]], ml.src_nid)
        # sources: destinations first, then the rest by ascending global ID
        rest = ml.src_nid[ml.num_dst:]
        assert bool((rest[1:] > rest[:-1]).all())
        # every destination keeps exactly its full-batch neighbours, in canonical order
        full_nb, micro_nb = _neighbours(fl), _neighbours(ml)
        for d, nb in micro_nb.items():
            assert nb == full_nb[d] and nb == sorted(nb)
        # edge IDs travel with their edges
        full_eid = {(int(s), int(d)): int(e) for s, d, e in zip(
            fl.src_nid[fl.edge_src], fl.dst_nid[fl.edge_dst], fl.edge_id)}
        for s, d, e in zip(ml.src_nid[ml.edge_src], ml.dst_nid[ml.edge_dst], ml.edge_id):
            assert full_eid[(int(s), int(d))] == int(e)


def test_micro_batches_keep_full_batch_neighbourhoods(batch):
    groups = torch.randint(0, 5, (batch.num_outputs,), generator=torch.Generator().manual_seed(0))
    micro_batches = split(batch, groups, 5)
    assert sum(p.num_outputs for p in micro_batches) == batch.num_outputs
    for k, micro_batch in enumerate(micro_batches):
        _check_micro_batch(batch, micro_batch, torch.nonzero(groups == k).flatten())


def test_zero_in_degree_outputs_are_kept(batch):
    deg = batch.layers[-1].in_degrees()
    isolated = torch.nonzero(deg == 0).flatten()
    assert isolated.numel() > 0
    mb = carve(batch, isolated)
    assert mb.num_outputs == isolated.numel() and mb.layers[-1].num_edges == 0
    assert mb.layers[-1].num_src == isolated.numel()


def test_carver_accepts_edges_in_any_order(batch):
    perm = torch.randperm(batch.layers[0].num_edges, generator=torch.Generator().manual_seed(3))
    l0 = batch.layers[0]
    shuffled = SampledBatch([LayerEdges(l0.src_nid, l0.num_dst, l0.edge_src[perm], l0.edge_dst[perm],
                                        l0.edge_id[perm]), *batch.layers[1:]])
    index = torch.arange(0, batch.num_outputs, 3)
    a, b = Carver(batch).carve(index), Carver(shuffled).carve(index)
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.src_nid, lb.src_nid)
        key_a = sorted(zip(la.edge_dst.tolist(), la.edge_id.tolist()))
        key_b = sorted(zip(lb.edge_dst.tolist(), lb.edge_id.tolist()))
        assert key_a == key_b


def test_a_carver_is_reusable_and_stateless_between_micro_batches(batch):
    carver = Carver(batch)
    index = torch.arange(0, batch.num_outputs, 2)
    first = carver.carve(index)
    carver.carve(torch.arange(1, batch.num_outputs, 2))
    again = carver.carve(index)
    for la, lb in zip(first.layers, again.layers):
        assert torch.equal(la.src_nid, lb.src_nid) and torch.equal(la.edge_src, lb.edge_src)


def test_invalid_partitions_are_refused(batch):
    n = batch.num_outputs
    with pytest.raises(ValueError, match="shape"):
        validate_groups(torch.zeros(n - 1, dtype=torch.long), n, 2)
    with pytest.raises(ValueError, match="empty"):
        validate_groups(torch.zeros(n, dtype=torch.long), n, 2)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        validate_groups(torch.full((n,), 2), n, 2)
    with pytest.raises(ValueError, match="integer micro-batch index, got dtype torch.float32"):
        validate_groups(torch.arange(n) % 2 + 0.5, n, 2)  # 0.5 and 1.5 name no micro-batch


def test_split_and_accumulation_refuse_a_float_or_bool_partition(batch):
    """They cast it to int64 before validate_groups, which then truncated 0.2/0.9/1.5
    into two micro-batches instead of refusing them."""
    from betty.models import build_model
    from betty.train import accumulate_gradients

    n = batch.num_outputs
    model = build_model("sage", 12, 5, hidden=4, layers=batch.num_layers)
    nodes = int(batch.input_nid.max()) + 1
    feat, label = torch.randn(nodes, 12), torch.zeros(nodes, dtype=torch.long)
    for groups in (torch.arange(n) % 2 + 0.5, torch.arange(n) % 2 == 0):
        with pytest.raises(ValueError, match="integer micro-batch index"):
            split(batch, groups)
        with pytest.raises(ValueError, match="integer micro-batch index"):
            accumulate_gradients(model, batch, groups, feat, label)


@pytest.mark.parametrize("index,message", [([-2], r"must lie in \[0, "), ([0, 0], "each output once"),
                                           (torch.tensor([1.7]), "1-D integer tensor"),
                                           (torch.tensor([[0, 1]]), "1-D integer tensor")])
def test_carve_refuses_positions_that_name_no_output_or_one_twice(batch, index, message):
    """A negative position named a node that is not an output; a repeated one doubled its
    edges and its loss; a float was truncated."""
    with pytest.raises(ValueError, match=message):
        Carver(batch).carve(index)


def test_small_and_large_micro_batch_paths_carve_the_same(batch, monkeypatch):
    """The Carver's two ways to list a micro-batch's sources (sort only the micro-batch's own
    sources, or scan the layer's) give identical micro-batches, and both pass the
    structural checks."""
    import betty.microbatch as mb_mod

    gen = torch.Generator().manual_seed(4)
    groups = torch.randint(0, 7, (batch.num_outputs,), generator=gen)
    micro_batches = [torch.nonzero(groups == k).flatten() for k in range(7)] + [torch.tensor([3])]
    carved = {}
    for name, ratio in (("sort", 0), ("scan", 10**12)):
        monkeypatch.setattr(mb_mod, "SCAN_RATIO", ratio)
        carver = Carver(batch)
        carved[name] = [carver.carve(idx) for idx in micro_batches]
    for idx, a, b in zip(micro_batches, carved["sort"], carved["scan"]):
        _check_micro_batch(batch, a, idx)
        for la, lb, ia, ib in zip(a.layers, b.layers, a.full_src_index, b.full_src_index):
            assert torch.equal(la.src_nid, lb.src_nid) and torch.equal(ia, ib)
            assert torch.equal(la.edge_src, lb.edge_src) and torch.equal(la.edge_id, lb.edge_id)
