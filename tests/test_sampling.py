"""betty's own neighbour sampler: structure, the without-replacement rule, uniformity,
reproducibility (no DGL needed except for the comparison marked ``dgl``)."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from betty.graph import Graph
from betty.sampling import sample_full_batch, uniform_subsets
from graphs import power_law_graph


@pytest.fixture(scope="module")
def graph():
    """A power-law graph with its edge IDs shuffled, so ascending edge ID is not
    ascending source ID (the canonical order must come from the sampler)."""
    g = power_law_graph(num_nodes=400, avg_degree=7, seed=3)[0]
    perm = torch.randperm(g.num_edges(), generator=torch.Generator().manual_seed(0))
    return Graph(g.src[perm], g.dst[perm], g.num_nodes())


def _edge_triples(layer):
    src = layer.src_nid[layer.edge_src]
    dst = layer.dst_nid[layer.edge_dst]
    return src, dst, layer.edge_id


@pytest.mark.parametrize("fanouts", [[3, 5], [-1, 4], [2, -1, 6]])
def test_blocks_follow_the_rule(graph, fanouts):
    outputs = torch.arange(0, 400, 3)
    batch = sample_full_batch(graph, outputs, fanouts, seed=7)
    assert torch.equal(batch.output_nid, outputs)
    deg = graph.in_degrees()
    for layer, fanout in zip(batch.layers, fanouts):
        assert torch.equal(layer.src_nid[: layer.num_dst], layer.dst_nid)
        rest = layer.src_nid[layer.num_dst:]
        assert bool((rest[1:] > rest[:-1]).all())  # other sources ascending
        assert torch.unique(layer.src_nid).numel() == layer.num_src
        src, dst, eid = _edge_triples(layer)
        # every sampled edge is a real edge of the graph, named by its ID
        assert torch.equal(graph.src[eid], src) and torch.equal(graph.dst[eid], dst)
        # without replacement: an edge at most once; count min(fanout, degree)
        assert torch.unique(eid).numel() == eid.numel()
        want = deg[layer.dst_nid] if fanout == -1 else deg[layer.dst_nid].clamp(max=fanout)
        assert torch.equal(layer.in_degrees(), want)
        # canonical order: by destination, then by source global ID
        key = layer.edge_dst * graph.num_nodes() + src
        assert bool((key[1:] >= key[:-1]).all())
        # every source is needed: a destination or an endpoint of a sampled edge
        used = torch.zeros(layer.num_src, dtype=torch.bool)
        used[: layer.num_dst] = True
        used[layer.edge_src] = True
        assert bool(used.all())


def test_seeded_reproducible(graph):
    outputs = torch.arange(0, 400, 2)
    a = sample_full_batch(graph, outputs, [4, 4], seed=11)
    b = sample_full_batch(graph, outputs, [4, 4], seed=11)
    c = sample_full_batch(graph, outputs, [4, 4], seed=12)
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.edge_id, lb.edge_id) and torch.equal(la.src_nid, lb.src_nid)
    assert not torch.equal(a.layers[-1].edge_id, c.layers[-1].edge_id)


def test_same_batch_on_any_thread_count(graph):
    outputs = torch.arange(0, 400, 2)
    before = torch.get_num_threads()
    batches = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            batches.append(sample_full_batch(graph, outputs, [4, 4], seed=5))
    finally:
        torch.set_num_threads(before)
    for la, lb in zip(*(b.layers for b in batches)):
        assert torch.equal(la.edge_id, lb.edge_id) and torch.equal(la.src_nid, lb.src_nid)


def test_uniform_subsets_are_uniform():
    """Chi-square over all C(6, 2) = 15 subsets, and C(7, 3) = 35 subsets."""
    gen = torch.Generator().manual_seed(0)
    for d, k in ((6, 2), (7, 3)):
        rows = uniform_subsets(torch.full((60000,), d, dtype=torch.int64), k, gen)
        assert bool((rows[:, 1:] > rows[:, :-1]).all())  # distinct, ascending
        assert int(rows.min()) >= 0 and int(rows.max()) < d
        counts = Counter(map(tuple, rows.tolist()))
        subsets = list(itertools.combinations(range(d), k))
        assert set(counts) == set(subsets)
        observed = np.array([counts[s] for s in subsets])
        assert stats.chisquare(observed).pvalue > 1e-4


def test_sampled_edges_uniform_per_node():
    """A star: node 0 has 10 in-edges, fanout 4. Over seeds every edge is kept with
    probability 4/10 and the kept sets are uniform over the C(10, 4) = 210 subsets."""
    g = Graph(torch.arange(1, 11), torch.zeros(10, dtype=torch.int64), 11)
    kept = Counter()
    for seed in range(4000):
        batch = sample_full_batch(g, torch.tensor([0]), [4], seed=seed)
        eids = batch.layers[0].edge_id
        assert eids.numel() == 4 and torch.unique(eids).numel() == 4
        kept[tuple(sorted(eids.tolist()))] += 1
    per_edge = Counter(e for s, c in kept.items() for e in s for _ in range(c))
    assert stats.chisquare([per_edge[e] for e in range(10)]).pvalue > 1e-4
    assert len(kept) > 190  # nearly every subset seen in 4000 draws of 210


def test_rejects_bad_arguments(graph):
    with pytest.raises(ValueError, match="distinct"):
        sample_full_batch(graph, torch.tensor([1, 1]), [2])
    with pytest.raises(ValueError, match="fanout"):
        sample_full_batch(graph, torch.tensor([1]), [0])
    with pytest.raises(ValueError, match=r"\[0, 400\)"):
        sample_full_batch(graph, torch.tensor([400]), [2])


@pytest.mark.dgl
def test_same_rule_as_dgl(graph):
    """DGL's sample_neighbors keeps the same number of in-edges per node (the subsets
    themselves differ: another random stream), and every one of its edges exists."""
    import dgl

    outputs = torch.arange(0, 400, 2)
    ours = sample_full_batch(graph, outputs, [5], seed=0).layers[0]
    dgl.seed(0)
    frontier = dgl.sampling.sample_neighbors(graph.to_dgl(), outputs, 5)
    _, v = frontier.edges()
    theirs = torch.bincount(v, minlength=400)[outputs]
    assert torch.equal(ours.in_degrees(), theirs)



def test_data_and_sampling_import_without_dgl_or_pyg():
    """betty.graph, betty.batch, betty.sampling and betty.data import (and load a
    dataset, and sample) with DGL and PyG made unimportable."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['dgl'] = None; sys.modules['torch_geometric'] = None\n"
        "import betty.graph, betty.batch, betty.sampling, betty.data, betty.data.registry\n"
        "from betty.data import load_dataset\n"
        "from betty.sampling import sample_full_batch\n"
        "ds = load_dataset('synthetic', cache=False, scale=0.05)\n"
        "b = sample_full_batch(ds.graph, ds.train_idx, [3, 4])\n"
        "print(b.num_outputs == ds.train_idx.numel())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_uniform_subsets_int32_and_int64_paths_draw_the_same_picks():
    """A degree of 2^31 or more switches the picks to int64; every other row's draws (the
    same uniforms: column c of the (k, n) draws) must not change with it."""
    rng = np.random.default_rng(4)
    rest = rng.integers(12, 500, size=2000)
    for k in (1, 3, 11):
        small = uniform_subsets(torch.from_numpy(np.r_[40, rest]), k, torch.Generator().manual_seed(9))
        huge = uniform_subsets(torch.from_numpy(np.r_[2**31 + 5, rest]), k,
                               torch.Generator().manual_seed(9))
        assert small.dtype == huge.dtype == torch.int64
        assert torch.equal(small[1:], huge[1:])
        assert int(huge[0].max()) < 2**31 + 5 and len(set(huge[0].tolist())) == k


@pytest.mark.parametrize("outputs, words", [(torch.tensor([1.7, 3.2]), "float32"),
                                            (torch.zeros(10, dtype=torch.bool), "mask.nonzero"),
                                            (torch.tensor([[1, 2]]), "a 2-D")])
def test_outputs_must_be_integer_node_ids(outputs, words):
    """A float ID was truncated (1.7 became node 1); a mask or a matrix failed far away."""
    g, *_ = power_law_graph(num_nodes=10, avg_degree=3, seed=0)
    with pytest.raises(ValueError, match=words):
        sample_full_batch(g, outputs, [2])
    assert sample_full_batch(g, np.array([1, 3], dtype=np.int32), [2]).num_outputs == 2
