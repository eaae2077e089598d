"""The synthetic generator: determinism, structure, label/feature signal, scale, options."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from betty.data import SYNTHETIC_PRESETS, SyntheticConfig, generate_synthetic, load_dataset
from betty.data.synthetic import _community_ring, _EndpointSampler
from betty.graph import Graph


def _gen(**kw):
    return generate_synthetic(dataclasses.replace(SYNTHETIC_PRESETS["synthetic"], **kw))


@pytest.fixture(scope="module")
def small():
    return _gen()


def _edge_keys(ds) -> torch.Tensor:
    src, dst = ds.graph.edges()
    return src * ds.num_nodes + dst


def _class_mean_accuracy(ds) -> tuple[float, float]:
    """Nearest class-mean classifier fitted on train, scored on test; and the
    majority-class rate on test (chance level)."""
    f, y, tr, te = ds.feat, ds.label, ds.train_idx, ds.test_idx
    k = ds.num_classes
    counts = torch.bincount(y[tr], minlength=k).clamp(min=1)
    means = torch.zeros(k, f.shape[1]).index_add_(0, y[tr], f[tr]) / counts[:, None]
    pred = torch.cdist(f[te], means).argmin(1)
    acc = float((pred == y[te]).float().mean())
    chance = float(torch.bincount(y[te], minlength=k).max()) / te.numel()
    return acc, chance


def test_same_seed_same_dataset_different_seed_differs(small):
    again = _gen()
    assert torch.equal(_edge_keys(small), _edge_keys(again))
    for field in ("feat", "label", "train_idx", "valid_idx", "test_idx"):
        assert torch.equal(getattr(small, field), getattr(again, field)), field
    other = _gen(seed=1)
    assert not torch.equal(small.feat, other.feat)
    a, b = set(_edge_keys(small).tolist()), set(_edge_keys(other).tolist())
    assert len(a ^ b) > 0.5 * len(a)  # most edges differ


def test_dataset_contract_and_exact_sizes(small):
    c = SYNTHETIC_PRESETS["synthetic"]
    g = small.graph
    assert g.idtype == torch.int64 and g.device.type == "cpu"
    assert isinstance(g, Graph)
    assert small.num_nodes == c.num_nodes
    assert small.num_edges == 2 * round(c.num_nodes * c.avg_degree / 2)
    assert small.feat.shape == (c.num_nodes, c.num_features) and small.feat.dtype == torch.float32
    assert small.label.dtype == torch.int64 and set(small.label.unique().tolist()) == set(range(c.num_classes))
    splits = torch.cat([small.train_idx, small.valid_idx, small.test_idx])
    assert torch.equal(torch.sort(splits).values, torch.arange(c.num_nodes))  # disjoint cover
    assert small.train_idx.numel() == round(c.train_fraction * c.num_nodes)
    assert small.valid_idx.numel() == round(c.valid_fraction * c.num_nodes)
    assert not small.multilabel and not small.is_ogb and small.ogb_name is None


def test_simple_symmetric_graph(small):
    src, dst = small.graph.edges()
    assert not bool((src == dst).any()), "self-loop"
    keys = _edge_keys(small)
    assert torch.unique(keys).numel() == keys.numel(), "duplicate edge"
    reverse = dst * small.num_nodes + src
    assert torch.equal(torch.sort(keys).values, torch.sort(reverse).values), "not symmetric"


def test_heavy_tailed_in_degrees(small):
    deg = small.in_degrees().double()
    assert deg.max() > 10 * deg.mean()
    assert deg.median() < deg.mean()  # right-skewed
    assert torch.unique(deg).numel() >= 100  # many distinct degree buckets
    # the top 1% of nodes hold a disproportionate share of the edge endpoints
    top = torch.topk(deg, k=small.num_nodes // 100).values.sum() / deg.sum()
    assert top > 0.05
    # a lighter tail (larger exponent) concentrates degrees
    light = _gen(degree_exponent=6.0).in_degrees().double()
    assert light.max() < deg.max() and light.std() < deg.std()


def test_labels_follow_edges(small):
    h = small.edge_homophily()
    assert h > 0.6 > 3.0 / small.num_classes
    mixed = _gen(intra_community_fraction=0.0)
    assert mixed.edge_homophily() < 0.35  # chance level: sum of squared class shares


def test_features_carry_label_signal(small):
    acc, chance = _class_mean_accuracy(small)
    assert acc > 0.45 and acc > 2 * chance
    acc0, chance0 = _class_mean_accuracy(_gen(feature_snr=0.0))
    assert acc0 < chance0 + 0.05


def test_popularity_split_trains_on_high_degree_nodes(small):
    deg = small.in_degrees().double()
    assert deg[small.train_idx].mean() > 2 * deg[small.test_idx].mean()
    rand = _gen(split_by="random")
    rdeg = rand.in_degrees().double()
    ratio = rdeg[rand.train_idx].mean() / rdeg[rand.test_idx].mean()
    assert 0.8 < ratio < 1.25


def test_scale_multiplies_nodes_and_keeps_degree():
    half = _gen(scale=0.5)
    c = SYNTHETIC_PRESETS["synthetic"]
    assert half.num_nodes == c.num_nodes // 2
    assert half.num_edges / half.num_nodes == pytest.approx(c.avg_degree, rel=1e-3)


def test_products_preset_follows_ogbn_products_statistics():
    c = SYNTHETIC_PRESETS["synthetic-products"]
    assert c.num_nodes == 2_449_029
    assert round(c.num_nodes * c.avg_degree / 2) == 61_859_140
    assert round(c.train_fraction * c.num_nodes) == 196_615
    assert round(c.valid_fraction * c.num_nodes) == 39_323
    assert (c.num_features, c.num_classes) == (100, 47)
    ds = load_dataset("synthetic-products", cache=False, scale=0.01)
    n = round(2_449_029 * 0.01)
    assert ds.num_nodes == n and ds.num_edges == 2 * round(n * c.avg_degree / 2)
    assert ds.train_idx.numel() == round(c.train_fraction * n)
    assert ds.valid_idx.numel() == round(c.valid_fraction * n)
    assert ds.test_idx.numel() == n - ds.train_idx.numel() - ds.valid_idx.numel()
    assert ds.feat.shape == (n, 100) and ds.num_classes == 47
    deg = ds.in_degrees().double()
    assert deg.max() > 10 * deg.mean()
    assert ds.edge_homophily() > 0.7


def _ring_sampler(weight: np.ndarray, num_communities: int) -> _EndpointSampler:
    """Integer weights (one stub per unit), communities = equal runs of node IDs, ring in
    ID order: stub positions are then plain arithmetic on node IDs."""
    community = np.arange(weight.size) // (weight.size // num_communities)
    return _EndpointSampler(np.random.default_rng(1), weight, community, num_communities)


def test_ring_draw_is_log_uniform_in_distance_and_symmetric():
    n, c, m = 10_000, 50, 200_000
    sampler = _ring_sampler(np.ones(n), c)
    assert np.array_equal(sampler.stub_node, np.arange(n))  # stub position = node ID
    rng = np.random.default_rng(0)
    pos = sampler.position(rng.random(m))
    v = sampler.ring_draw(pos, rng.random(m), rng.random(m) < 0.5)
    offset = (v - pos) % n
    offset = np.where(offset > n // 2, offset - n, offset)
    dist = np.abs(offset)
    near, far = n / c, n / 2
    assert dist.min() >= near and dist.max() <= far
    # equal shares in equal log-distance bins: every scale carries the same mass
    bins = np.exp(np.linspace(np.log(near), np.log(far), 5))
    assert np.allclose(np.histogram(dist, bins=bins)[0] / m, 0.25, atol=0.01)
    assert abs((offset < 0).mean() - 0.5) < 0.01
    # a uniform start lands uniformly (mod S): the far end is still drawn ∝ stubs
    assert np.allclose(np.bincount(v // 1000, minlength=10) / m, 0.1, atol=0.005)


def test_ring_draw_lands_on_nodes_in_proportion_to_their_stubs():
    n, m = 10_000, 200_000
    heavy = np.arange(n) % 10 == 0
    sampler = _ring_sampler(np.where(heavy, 10.0, 1.0), 50)
    rng = np.random.default_rng(2)
    pos = sampler.position(rng.random(m))
    v = sampler.ring_draw(pos, rng.random(m), rng.random(m) < 0.5)
    expected = 10 * heavy.sum() / (10 * heavy.sum() + (~heavy).sum())  # 0.526
    assert abs(heavy[v].mean() - expected) < 0.01


def test_community_ring_keeps_each_class_contiguous():
    class_of_community = np.arange(50) % 7
    ring = _community_ring(np.random.default_rng(0), class_of_community, 7)
    assert sorted(ring.tolist()) == list(range(50))
    along = class_of_community[ring]
    assert np.count_nonzero(np.diff(along)) == 6  # 7 classes, 7 runs


def test_locality_changes_edges_not_the_contract():
    flat, local = _gen(), _gen(cross_community_locality=1.0)
    assert local.num_edges == flat.num_edges
    assert torch.equal(local.label, flat.label)  # drawn before the edges
    assert not torch.equal(_edge_keys(local), _edge_keys(flat))
    src, dst = local.graph.edges()
    assert bool((src != dst).all())
    keys = set((src * local.num_nodes + dst).tolist())
    assert keys == set((dst * local.num_nodes + src).tolist())  # both directions
    assert local.edge_homophily() > 0.6


def test_options_are_checked():
    with pytest.raises(ValueError, match=r"'num_nodez'.*allowed options: num_nodes, avg_degree"):
        load_dataset("synthetic", cache=False, num_nodez=10)
    with pytest.raises(ValueError, match=r"intra_community_fraction=1.5 \(allowed: number in \[0, 1\]\)"):
        load_dataset("synthetic", cache=False, intra_community_fraction=1.5)
    with pytest.raises(
        ValueError, match=r"cross_community_locality=-0.1 \(allowed: number in \[0, 1\]\)"
    ):
        SyntheticConfig(cross_community_locality=-0.1)
    with pytest.raises(ValueError, match="split_by='time'"):
        SyntheticConfig(split_by="time")
    with pytest.raises(ValueError, match="train_fraction \\+ valid_fraction"):
        SyntheticConfig(train_fraction=0.7, valid_fraction=0.3)
    for key in ("scale", "avg_degree", "max_degree", "feature_snr"):  # not an OverflowError later
        with pytest.raises(ValueError, match=rf"{key}=inf \((allowed: |allowed: None or )a finite number"):
            load_dataset("synthetic", cache=False, **{key: float("inf")})


def test_unknown_dataset_lists_allowed_names():
    with pytest.raises(ValueError, match=r"name='ogbn-mag'.*synthetic, synthetic-products.*cora"):
        load_dataset("ogbn-mag")


def test_stats_are_plain_numbers(small):
    stats = small.stats()
    assert all(type(v) in (int, float) for v in stats.values()), stats
    assert stats["num_edges"] == small.num_edges
    assert stats["max_in_degree"] == int(small.in_degrees().max())
    assert stats["num_self_loops"] == 0
    assert stats["mean_in_degree"] == pytest.approx(SYNTHETIC_PRESETS["synthetic"].avg_degree)
    assert np.isfinite(stats["edge_homophily"])


def test_a_train_fraction_that_rounds_to_every_node_is_refused():
    """round(0.996 * 100) = 100 training nodes left the test split to overlap training."""
    from betty.data.synthetic_config import SyntheticConfig

    with pytest.raises(ValueError, match="train_fraction=0.996 .*leaves a test node"):
        SyntheticConfig(num_nodes=100, avg_degree=4, train_fraction=0.996, valid_fraction=0.001)


def test_a_density_the_communities_cannot_hold_is_warned_about():
    """The generator makes exactly the target edge count where it can; where the options
    ask for more edges than the communities hold, the graph says so instead of silently
    having a fraction of them."""
    import warnings

    from betty.data import load_dataset

    with pytest.warns(UserWarning, match=r"222 undirected edges, 22% of the 1,000 .*intra_community_fraction=1.0"):
        short = load_dataset("synthetic", cache=False, num_nodes=100, avg_degree=20, intra_community_fraction=1.0)
    assert short.graph.num_edges() == 2 * 222
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        full = load_dataset("synthetic", cache=False, num_nodes=100, avg_degree=20)
    assert full.graph.num_edges() == 2 * 1000
