"""The redundancy-embedded graph C = BᵀB (diagonal removed) and its hub cap."""

import itertools

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from betty.partition.incidence import output_layer_incidence
from betty.partition.planted import planted_community_graph
from betty.partition.reg import redundancy_graph
from betty.sampling import sample_full_batch


def _batch(seed, num_outputs=50, fanouts=(3, 5)):
    graph, _ = planted_community_graph(300, 3, avg_degree=8.0, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    outputs = torch.sort(torch.randperm(300, generator=gen)[:num_outputs]).values
    return sample_full_batch(graph, outputs, list(fanouts), seed=seed)


def _sources_of_outputs(batch):
    """Global IDs of the output-layer sources each output needs (itself + neighbours)."""
    top = batch.layers[-1]
    src = {j: {int(top.src_nid[j])} for j in range(top.num_dst)}
    for s, d in zip(top.edge_src.tolist(), top.edge_dst.tolist()):
        src[d].add(int(top.src_nid[s]))
    return src


def _brute_force_shared(batch):
    src = _sources_of_outputs(batch)
    n = batch.num_outputs
    c = np.zeros((n, n), dtype=np.int64)
    for i, j in itertools.combinations(range(n), 2):
        c[i, j] = c[j, i] = len(src[i] & src[j])
    return c


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reg_equals_brute_force_shared_neighbour_count(seed):
    batch = _batch(seed)
    expected = _brute_force_shared(batch)
    assert expected.sum() > 0  # the test graph does share neighbours
    b = output_layer_incidence(batch)
    max_deg = int(np.diff(b.indptr).max())
    for cap, chunk in itertools.product((None, max_deg, max_deg + 10), (1, 1 << 24)):
        # the cap never bites here; chunk=1 builds C one row at a time
        c, stats = redundancy_graph(b, max_hub_degree=cap, seed=seed, chunk_pairs=chunk)
        assert c.dtype == np.int32
        np.testing.assert_array_equal(c.toarray(), expected)
        assert stats["hub_sources"] == 0
        assert stats["pairs_built"] == stats["pairs_exact"]


def test_hub_cap_replaces_cliques_by_rings():
    batch = _batch(3, num_outputs=120, fanouts=(3, 10))
    b = output_layer_incidence(batch)
    deg = np.diff(b.indptr)
    cap, links = 4, 1
    hub = deg > cap
    assert hub.sum() >= 3, "test graph needs a few hub sources"
    c, stats = redundancy_graph(b, max_hub_degree=cap, hub_links=links, seed=0)

    small = b[~hub]
    exact_small = (small.T @ small).toarray()
    np.fill_diagonal(exact_small, 0)
    ring = c.toarray() - exact_small
    assert (ring >= 0).all()
    # every hub source adds exactly 2 * hub_links * d ordered ring entries
    assert ring.sum() == 2 * links * deg[hub].sum()
    assert stats["pairs_built"] == (deg[~hub] * (deg[~hub] - 1)).sum() + 2 * links * deg[hub].sum()
    assert stats["pairs_built"] <= b.nnz * max(cap, 2 * links)
    assert stats["hub_sources"] == hub.sum()
    # the ring keeps each hub's outputs connected
    ring_graph = sp.csr_matrix(ring > 0)
    hub_rows = b[hub]
    for r in range(hub_rows.shape[0]):
        members = hub_rows.indices[hub_rows.indptr[r]:hub_rows.indptr[r + 1]]
        sub = ring_graph[members][:, members]
        n_comp, _ = sp.csgraph.connected_components(sub, directed=False)
        assert n_comp == 1
    np.testing.assert_array_equal(c.toarray(), c.toarray().T)
    assert (c.diagonal() == 0).all()


def test_hub_ring_is_seeded():
    batch = _batch(4, num_outputs=120, fanouts=(3, 10))
    b = output_layer_incidence(batch)
    c0, _ = redundancy_graph(b, max_hub_degree=4, seed=0)
    c0b, _ = redundancy_graph(b, max_hub_degree=4, seed=0)
    c1, _ = redundancy_graph(b, max_hub_degree=4, seed=1)
    assert (c0 != c0b).nnz == 0
    assert (c0 != c1).nnz > 0


@pytest.mark.parametrize("chunk_pairs", [1, 50, 1000])
def test_chunked_construction_equals_one_pass(chunk_pairs):
    batch = _batch(5, num_outputs=120, fanouts=(3, 10))
    b = output_layer_incidence(batch)
    for cap in (None, 4):  # with and without hub rings
        whole, whole_stats = redundancy_graph(b, max_hub_degree=cap, seed=1)
        chunked, stats = redundancy_graph(b, max_hub_degree=cap, seed=1,
                                          chunk_pairs=chunk_pairs)
        assert whole_stats["chunks"] == 1 and stats["chunks"] > 1
        assert (whole != chunked).nnz == 0
        assert {k: v for k, v in stats.items() if k != "chunks"} == {
            k: v for k, v in whole_stats.items() if k != "chunks"}


def test_redundancy_graph_rejects_bad_options():
    b = sp.csr_matrix(np.ones((3, 4), dtype=np.int32))
    with pytest.raises(ValueError, match="max_hub_degree"):
        redundancy_graph(b, max_hub_degree=0)
    with pytest.raises(ValueError, match="hub_links"):
        redundancy_graph(b, hub_links=0)
    with pytest.raises(ValueError, match="chunk_pairs"):
        redundancy_graph(b, chunk_pairs=0)


@pytest.mark.parametrize("shape", [(3, 0), (0, 4)])
def test_redundancy_graph_without_outputs_or_sources(shape):
    c, stats = redundancy_graph(sp.csr_matrix(shape, dtype=np.int32), chunk_pairs=1)
    assert c.shape == (shape[1], shape[1]) and c.nnz == 0
    assert stats["pairs_built"] == 0 and stats["reg_nnz"] == 0


def test_short_hub_rings_do_not_create_self_loops():
    b = sp.csr_matrix(np.ones((3, 4), dtype=np.int32))  # 3 sources shared by 4 outputs
    c, stats = redundancy_graph(b, max_hub_degree=1, hub_links=2)
    dense = c.toarray()
    assert (np.diag(dense) == 0).all() and (dense == dense.T).all()
    assert (dense[~np.eye(4, dtype=bool)] > 0).all()  # every pair still linked
    assert stats["hub_sources"] == 3


def _reference_reg(b, cap, links, seed):
    """C = Sᵀ S + Hᵀ Q by plain scipy products (S: the non-hub rows of B; H: one-hot
    rows of the hub pins' outputs; Q: their ring neighbours), diagonal dropped."""
    from betty.partition.reg import _hub_ring_layout

    deg = np.diff(b.indptr)
    hub = deg > cap
    small = b[~hub].astype(np.int64)
    ref = small.T @ small
    members, partners, _ = _hub_ring_layout(b[hub], links, np.random.default_rng(seed))
    n_out = b.shape[1]
    pins = np.arange(members.size)
    h = sp.csr_matrix((np.ones(members.size, np.int64), (pins, members)),
                      shape=(members.size, n_out))
    q = sp.csr_matrix((np.ones(partners.size, np.int64),
                       (np.repeat(pins, partners.shape[1]), partners.ravel())),
                      shape=(members.size, n_out))
    ref = sp.lil_matrix(ref + h.T @ q)
    ref.setdiag(0)
    return sp.csr_matrix(ref)


@pytest.mark.parametrize("chunk_pairs", [1, 50, 1 << 24])
def test_reg_equals_the_reference_products_in_either_dtype(chunk_pairs):
    batch = _batch(6, num_outputs=120, fanouts=(3, 10))
    b = output_layer_incidence(batch)
    ref = _reference_reg(b, cap=4, links=2, seed=3)
    assert ref.nnz > 0
    one_pass, _ = redundancy_graph(b, max_hub_degree=4, hub_links=2, seed=3)
    for dtype in (np.int32, np.int64):
        c, _ = redundancy_graph(b, max_hub_degree=4, hub_links=2, seed=3,
                                chunk_pairs=chunk_pairs, dtype=dtype)
        assert c.indices.dtype == c.data.dtype == c.indptr.dtype == dtype
        np.testing.assert_array_equal(c.toarray(), ref.toarray())
        # the same entries in the same order as the one-pass int32 build: METIS reads them
        np.testing.assert_array_equal(c.indptr, one_pass.indptr)
        np.testing.assert_array_equal(c.indices, one_pass.indices)
        np.testing.assert_array_equal(c.data, one_pass.data)


def test_redundancy_graph_rejects_other_dtypes():
    b = sp.csr_matrix(np.ones((3, 4), dtype=np.int32))
    with pytest.raises(ValueError, match="dtype"):
        redundancy_graph(b, dtype=np.float64)


def test_metis_reads_the_cached_reg_arrays_and_splits_as_the_int32_reg(monkeypatch):
    import pymetis

    from betty.partition import partition_batch
    from betty.partition.balance import fill_empty_micro_batches
    from betty.partition.metis_cut import metis_cut

    batch = _batch(7, num_outputs=120, fanouts=(3, 10))
    calls = []
    real = pymetis.part_graph

    def spy(nparts, adjacency=None, **kwargs):
        calls.append((adjacency, kwargs["eweights"]))
        return real(nparts, adjacency=adjacency, **kwargs)

    monkeypatch.setattr(pymetis, "part_graph", spy)
    result = partition_batch(batch, 4, "reg", seed=2)
    (cached,) = [v for key, v in batch._derived.items() if key[0] == "redundancy_graph"]
    c = cached[0]
    (adjacency, eweights), = calls
    assert adjacency.adjacent is c.indices and eweights is c.data  # no widened copies
    c32, _ = redundancy_graph(output_layer_incidence(batch), seed=2)
    groups, _ = metis_cut(c32, 4, vweights=np.ones(c32.shape[0], np.int32),
                          use_edge_weights=True, seed=2)
    assert torch.equal(result.groups, fill_empty_micro_batches(groups, 4)[0])
