"""Sparse incidences of a sampled batch against a brute-force set walk over its edges,
and the layer incidence and its transpose (the needed sources) against a dense
construction from their definition, with parallel edges and self-loops, on the edge
order the sampler and carving give and on any other order."""

import numpy as np
import pytest
import torch

from betty.batch import LayerEdges
from betty.graph import Graph
from betty.microbatch import carve
from betty.partition.incidence import (
    layer_incidence,
    multi_hop_incidence,
    needed_sources,
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


def _dense_incidence(layer: LayerEdges) -> np.ndarray:
    """``A[s, d] = 1`` iff ``s == d`` or some edge ``s -> d``: the definition, densely."""
    a = np.zeros((layer.num_src, layer.num_dst), dtype=np.int32)
    a[np.arange(layer.num_dst), np.arange(layer.num_dst)] = 1
    a[layer.edge_src.numpy(), layer.edge_dst.numpy()] = 1
    return a


def _multigraph(num_nodes: int = 60, num_edges: int = 500, seed: int = 0) -> Graph:
    """A random graph with parallel edges and self-loops."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, num_nodes, (num_edges,), generator=gen)
    dst = torch.randint(0, num_nodes, (num_edges,), generator=gen)
    loops = torch.arange(0, num_nodes, 3)
    dup = torch.arange(0, num_edges, 4)
    return Graph(torch.cat([src, loops, src[dup]]), torch.cat([dst, loops, dst[dup]]), num_nodes)


def _check(layer: LayerEdges) -> None:
    dense = _dense_incidence(layer)
    a = layer_incidence(layer)
    assert a.shape == (layer.num_src, layer.num_dst)
    np.testing.assert_array_equal(a.data, 1)  # no explicit zeros, no summed duplicates
    np.testing.assert_array_equal(a.toarray(), dense)
    n = needed_sources(layer)
    assert n.shape == (layer.num_dst, layer.num_src)
    # every entry is an edge's source or the diagonal, once per edge plus once per row
    assert n.nnz == layer.num_edges + layer.num_dst
    np.testing.assert_array_equal(n.toarray() > 0, dense.T > 0)
    np.testing.assert_array_equal(n.indices[n.indptr[:-1]], np.arange(layer.num_dst))


def test_sampled_layers_match_the_definition():
    g = _multigraph()
    batch = sample_full_batch(g, torch.arange(0, 60, 2), [-1, 5], seed=1)
    layer = batch.layers[0]
    src, dst = layer.edge_src, layer.edge_dst
    assert bool((src == dst).any()), "the test needs a self-loop"
    pairs = dst * layer.num_src + src
    assert pairs.unique().numel() < pairs.numel(), "the test needs parallel edges"
    for layer in batch.layers:
        _check(layer)


def test_carved_layers_match_the_definition():
    batch = sample_full_batch(_multigraph(seed=2), torch.arange(0, 60, 3), [-1, -1], seed=2)
    micro_batch = carve(batch, torch.tensor([4, 0, 7, 2]))
    for layer in micro_batch.layers:
        _check(layer)


def test_other_edge_orders_match_the_definition():
    batch = sample_full_batch(_multigraph(seed=3), torch.arange(0, 60, 2), [-1, -1], seed=3)
    for layer in batch.layers:
        perm = torch.randperm(layer.num_edges, generator=torch.Generator().manual_seed(0))
        shuffled = LayerEdges(src_nid=layer.src_nid, num_dst=layer.num_dst,
                              edge_src=layer.edge_src[perm], edge_dst=layer.edge_dst[perm],
                              edge_id=layer.edge_id[perm])
        assert bool((shuffled.edge_dst[1:] < shuffled.edge_dst[:-1]).any())
        _check(shuffled)
        np.testing.assert_array_equal(layer_incidence(shuffled).toarray(),
                                      layer_incidence(layer).toarray())
