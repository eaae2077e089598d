"""Sparse incidences of a sampled batch against a brute-force set walk over its edges."""

import numpy as np
import pytest
import torch

from betty.partition.incidence import (
    layer_incidence,
    multi_hop_incidence,
    output_layer_incidence,
    reachability,
)
from betty.partition.planted import planted_community_graph
from betty.sampling import sample_full_batch


def _batch(fanouts, num_outputs=40, seed=0):
    graph, _ = planted_community_graph(400, 4, avg_degree=6.0, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    outputs = torch.sort(torch.randperm(400, generator=gen)[:num_outputs]).values
    return sample_full_batch(graph, outputs, fanouts, seed=seed)


def _brute_force_reach(batch):
    """Per layer, {output position: set of source local indices} by walking edges."""
    n_layers = batch.num_layers
    needs = [None] * n_layers
    # sources (local, layer l) needed by each destination (local, layer l), self included
    per_layer_needs = []
    for layer in batch.layers:
        table = {d: {d} for d in range(layer.num_dst)}
        for s, d in zip(layer.edge_src.tolist(), layer.edge_dst.tolist()):
            table[d].add(s)
        per_layer_needs.append(table)
    current = {j: {j} for j in range(batch.num_outputs)}  # dst sets at the top layer
    for l in reversed(range(n_layers)):
        table = per_layer_needs[l]
        current = {j: set().union(*(table[d] for d in dsts)) for j, dsts in current.items()}
        needs[l] = current
    return needs


def _columns_as_sets(mat):
    csc = mat.tocsc()
    return {j: set(csc.indices[csc.indptr[j]:csc.indptr[j + 1]].tolist())
            for j in range(mat.shape[1])}


@pytest.mark.parametrize("fanouts", [[3, 4], [2, 3, 2], [-1]])
def test_multi_hop_incidence_matches_brute_force(fanouts):
    batch = _batch(fanouts)
    inc = multi_hop_incidence(batch)
    assert inc.shape == (batch.layers[0].num_src, batch.num_outputs)
    assert set(np.unique(inc.data).tolist()) == {1}
    expected = _brute_force_reach(batch)
    assert _columns_as_sets(inc) == expected[0]
    for l, reach in enumerate(reachability(batch)):
        assert reach.shape == (batch.layers[l].num_src, batch.num_outputs)
        assert _columns_as_sets(reach) == expected[l]


def test_output_layer_incidence():
    batch = _batch([3, 4], seed=1)
    top = output_layer_incidence(batch)
    assert _columns_as_sets(top) == _brute_force_reach(batch)[-1]


def test_layer_incidence_counts_parallel_edges_once():
    batch = _batch([4], seed=2)
    layer = batch.layers[0]
    doubled = type(layer)(
        src_nid=layer.src_nid,
        num_dst=layer.num_dst,
        edge_src=torch.cat([layer.edge_src, layer.edge_src]),
        edge_dst=torch.cat([layer.edge_dst, layer.edge_dst]),
        edge_id=torch.cat([layer.edge_id, layer.edge_id]),
    )
    a, b = layer_incidence(layer), layer_incidence(doubled)
    assert (a != b).nnz == 0 and b.data.max() == 1
    # every destination needs itself
    assert np.all(b.diagonal()[: layer.num_dst] == 1)
