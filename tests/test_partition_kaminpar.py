"""The REG cut by KaMinPar (``partition.partitioner: kaminpar``): a valid balanced K-way
split, reproducible on one thread, the choice key validated, and exact K-way gradients.

KaMinPar has manylinux wheels for CPython 3.11-3.13 (both environments here install it
through ``betty[kaminpar]``); the tests that run it skip only where ``import kaminpar``
fails.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from betty.models import build_model
from betty.models.dropout import dropout_key
from betty.partition import partition_batch, split_metrics
from betty.partition.kaminpar_cut import KAMINPAR_EPSILON, cut_threads, kaminpar_cut, write_parhip
from betty.partition.planted import planted_community_graph
from betty.partition.reg import redundancy_graph
from betty.partition.incidence import output_layer_incidence
from betty.reference import full_batch_reference
from betty.sampling import sample_full_batch
from betty.train import accumulate_gradients, gradients, max_relative_difference
from graphs import power_law_graph

from betty.partition.kaminpar_cut import kaminpar_available

needs_kaminpar = pytest.mark.skipif(
    not kaminpar_available(), reason="kaminpar is not installed (pip install 'betty[kaminpar]')")


@pytest.fixture(scope="module")
def planted():
    graph, community = planted_community_graph(1200, 8, avg_degree=12.0, intra_fraction=0.95, seed=0)
    gen = torch.Generator().manual_seed(0)
    outputs = torch.sort(torch.randperm(1200, generator=gen)[:600]).values
    return graph, community, sample_full_batch(graph, outputs, [4, 4], seed=0)


def _options(**extra):
    return {"partitioner": "kaminpar", "trainer_threads": 0, **extra}


@needs_kaminpar
def test_parhip_file_is_read_back_as_written(tmp_path):
    """The graph KaMinPar loads has the CSR's neighbours, vertex and edge weights."""
    import kaminpar

    rng = np.random.default_rng(0)
    a = sp.random(300, 300, density=0.03, random_state=0, format="csr")
    a = sp.triu(a, 1)
    a.data = rng.integers(1, 50, a.nnz).astype(np.float64)
    a = sp.csr_matrix(a + a.T).astype(np.int64)
    a.sort_indices()
    vw = rng.integers(1, 9, 300)
    for big in (False, True):  # 32-bit fields, and 64-bit weights when they do not fit
        ew = a.data * (2**33 if big else 1)
        path = str(tmp_path / f"g{big}.parhip")
        write_parhip(path, a, vw, ew)
        g = kaminpar.load_graph(path, kaminpar.GraphFileFormat.PARHIP)
        assert (g.n(), g.m()) == (300, a.nnz)
        for u in (0, 7, 150, 299):
            got = g.neighbors(u)
            lo, hi = a.indptr[u], a.indptr[u + 1]
            assert [v for v, _ in got] == a.indices[lo:hi].tolist()
            assert [w for _, w in got] == ew[lo:hi].tolist()
            assert g.node_weight(u) == vw[u]


@needs_kaminpar
@pytest.mark.parametrize("weighted", [True, False])
def test_kaminpar_cut_is_a_balanced_k_way_partition(planted, weighted):
    _, community, batch = planted
    reg, _ = redundancy_graph(output_layer_incidence(batch))
    heavy = (community[batch.output_nid] < 2).numpy()
    vw = np.where(heavy, 5, 1).astype(np.int64)
    for k in (2, 8, 16):
        groups, cut = kaminpar_cut(reg, k, vweights=vw, use_edge_weights=weighted, seed=1)
        assert groups.shape == (batch.num_outputs,) and groups.min() >= 0 and groups.max() < k
        load = np.bincount(groups, weights=vw, minlength=k)
        assert load.max() <= (1 + KAMINPAR_EPSILON) * math.ceil(vw.sum() / k)
        # the reported cut is the graph's: weight (or count) of edges between micro-batches, once
        coo = sp.triu(reg, 1).tocoo()
        between = groups[coo.row] != groups[coo.col]
        assert cut == int((coo.data if weighted else np.ones_like(coo.data))[between].sum())


@needs_kaminpar
def test_reg_with_kaminpar_splits_every_output_once_and_balances(planted):
    graph, community, batch = planted
    n = batch.num_outputs
    weights = torch.where(community[batch.output_nid] < 2, 9.0, 1.0).to(torch.float64)
    for k in (3, 8):
        res = partition_batch(batch, k, "reg", seed=0, weights=weights, options=_options())
        assert res.info["partitioner"] == "kaminpar"
        assert res.groups.shape == (n,) and set(res.groups.tolist()) == set(range(k))
        per_micro_batch = torch.bincount(res.groups, weights=weights, minlength=k)
        assert per_micro_batch.max() <= 1.1 * per_micro_batch.mean()


@needs_kaminpar
def test_kaminpar_is_reproducible_on_one_thread_and_follows_the_seed(planted):
    _, _, batch = planted
    run = lambda seed: partition_batch(  # noqa: E731
        batch, 8, "reg", seed=seed, options=_options(deterministic=True))
    first = run(5)
    assert first.info["cut_threads"] == 1
    assert torch.equal(first.groups, run(5).groups)
    # on one fixed REG (the seed also orders the hub rings of C), KaMinPar's seed alone
    reg, _ = redundancy_graph(output_layer_incidence(batch))
    cut = lambda seed: kaminpar_cut(reg, 8, use_edge_weights=True, seed=seed)[0]  # noqa: E731
    assert np.array_equal(cut(5), cut(5))
    assert any(not np.array_equal(cut(5), cut(s)) for s in (6, 7, 8))


@needs_kaminpar
def test_kaminpar_cut_quality_is_metis_like_on_planted_communities(planted):
    _, _, batch = planted
    red = {p: split_metrics(batch, partition_batch(batch, 8, "reg", seed=0, options=_options(
        partitioner=p, deterministic=True)).groups, 8)["redundancy"] for p in ("metis", "kaminpar")}
    rand = split_metrics(batch, partition_batch(batch, 8, "random", seed=0).groups, 8)["redundancy"]
    assert red["kaminpar"] < 0.8 * rand
    assert red["kaminpar"] <= 1.05 * red["metis"]


def test_partitioner_choice_is_validated(planted):
    _, _, batch = planted
    with pytest.raises(ValueError, match=r"partition option partitioner must be one of \['metis', 'kaminpar'\], got 'kahip'"):
        partition_batch(batch, 2, "reg", options={"partitioner": "kahip"})
    from pydantic import ValidationError

    from workflow.spec import PartitionSection

    assert PartitionSection().partitioner == "metis"
    assert PartitionSection(partitioner="kaminpar").partitioner == "kaminpar"
    with pytest.raises(ValidationError, match="unknown partition.partitioner; allowed: 'metis', 'kaminpar'"):
        PartitionSection(partitioner="kahip")


def test_cut_threads_take_the_cores_the_trainer_leaves(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert cut_threads(4, cores=16) == 12
    assert cut_threads(16, cores=16) == 1
    assert cut_threads(0, cores=3) == 3
    assert cut_threads(2, cores=16, deterministic=True) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks cutting at once share what their trainers leave
    assert cut_threads(4, cores=16) == 4


@needs_kaminpar
@pytest.mark.parametrize("dropout", [0.0, 0.5], ids=["nodrop", "drop"])
def test_k_way_gradient_with_a_kaminpar_split_equals_full_batch(dropout):
    g, feat, label, train = power_law_graph(num_nodes=600, avg_degree=8, seed=0)
    batch = sample_full_batch(g, train, [5, 8], seed=0)
    torch.manual_seed(0)
    model = build_model("sage", 12, 5, hidden=16, layers=2, aggregator="mean",
                        dropout=dropout).to(torch.float64).train()
    key = dropout_key(0, 1)
    ref = full_batch_reference(model, batch, feat, label, dropout_key=key, dtype=torch.float64)
    for k in (2, 7):
        groups = partition_batch(batch, k, "reg", seed=3, options=_options()).groups
        assert len(set(groups.tolist())) == k
        model.zero_grad(set_to_none=True)
        result = accumulate_gradients(model, batch, groups, feat, label, k=k, dropout_key=key,
                                      dtype=torch.float64)
        err = max_relative_difference(gradients(model), ref.grads)
        assert err < 1e-10, f"K={k}: relative gradient error {err:.3e}"
        assert result.loss == pytest.approx(ref.loss, rel=1e-10, abs=0)
