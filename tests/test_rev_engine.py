"""The reversible epoch loop (betty.rev.engine): exactness of K-part accumulation where it
is mathematically true, deterministic dropout, training, memory records, K search."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.dgl  # RevGNN's layers are DGL's
pytest.importorskip("dgl")
import dgl  # noqa: E402

import torch

from betty.data.types import GraphDataset
from betty.graph import as_graph
from betty.memory import MemoryMeter
from betty.models import build_model
from betty.models.dropout import hash_keep_mask
from betty.rev.training import GraphPart, cluster_partition
from betty.rev.engine import (
    RevPlan,
    RevTrainer,
    SharedHashMasks,
    backward_parts,
    cluster_seed,
    edges_kept_fraction,
)

FEATS, CLASSES, TASKS = 6, 4, 3


def _components_graph(sizes, edges_per_node=4, seed=0):
    """Disjoint random clusters (one connected component each, with self-loops)."""
    gen = torch.Generator().manual_seed(seed)
    offsets = np.cumsum([0] + list(sizes))
    src, dst = [], []
    for start, size in zip(offsets[:-1], sizes):
        ring = torch.arange(size)  # a ring makes each cluster connected
        src += [ring + int(start), torch.randint(size, (edges_per_node * size,), generator=gen) + int(start)]
        dst += [(ring + 1) % size + int(start), torch.randint(size, (edges_per_node * size,), generator=gen) + int(start)]
    g = dgl.graph((torch.cat(src), torch.cat(dst)), num_nodes=int(offsets[-1]))
    return dgl.add_self_loop(g), offsets


def _data(n, multilabel, seed=0):
    gen = torch.Generator().manual_seed(seed)
    feat = torch.randn(n, FEATS, generator=gen, dtype=torch.float64)
    if multilabel:
        label = (torch.rand(n, TASKS, generator=gen) < 0.4).double()
    else:
        label = torch.randint(CLASSES, (n,), generator=gen)
    train = torch.rand(n, generator=gen) < 0.6
    return feat, label, train


def _parts(graph, groups):
    return [GraphPart(dgl.node_subgraph(graph, ids), ids) for ids in groups]


def _grads(model, parts, feat, label, train, multilabel, p):
    model.zero_grad(set_to_none=True)
    head = model.num_layers
    factory = (lambda: SharedHashMasks(p, key=1234, head_layer=head, dtype=torch.float64)) if p else None
    records, correct = backward_parts(model, parts, feat, label, train, multilabel=multilabel,
                                      dtype=torch.float64, mask_factory=factory)
    return {n: q.grad.clone() for n, q in model.named_parameters()}, sum(r.loss for r in records), correct


def _max_rel_diff(a, b):
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)) for n in b)


@pytest.mark.parametrize("conv,multilabel", [("gcn", False), ("sage", True), ("gat", False)])
def test_parts_that_cut_no_edge_give_the_full_graph_gradient(conv, multilabel):
    """Parts = unions of connected components: every node keeps all its neighbours, and
    the hash masks follow the node, so the accumulated gradient is the full-graph one."""
    g, off = _components_graph([9, 12, 7, 10])
    feat, label, train = _data(g.num_nodes(), multilabel)
    torch.manual_seed(0)
    model = build_model("revgnn", FEATS, TASKS if multilabel else CLASSES, hidden=8, layers=4,
                        conv=conv, heads=2, dropout=0.2).double()
    full = cluster_partition(g, 1)
    ids = torch.arange(g.num_nodes())
    comps = [ids[off[i]:off[i + 1]] for i in range(4)]
    split = _parts(g, [torch.cat([comps[0], comps[2]]), comps[1], comps[3]])
    g_full, loss_full, correct_full = _grads(model, full, feat, label, train, multilabel, 0.2)
    g_parts, loss_parts, correct_parts = _grads(model, split, feat, label, train, multilabel, 0.2)
    assert loss_parts == pytest.approx(loss_full, rel=1e-12)
    assert correct_parts == pytest.approx(correct_full)
    assert _max_rel_diff(g_parts, g_full) < 1e-9


def test_parts_that_cut_edges_change_the_gradient():
    """Random parts of a connected graph drop the edges between them: a different
    model, so the gradient differs (documented, not a bug)."""
    g, _ = _components_graph([40])
    feat, label, train = _data(g.num_nodes(), False)
    torch.manual_seed(0)
    model = build_model("revgnn", FEATS, CLASSES, hidden=8, layers=3).double()
    parts = cluster_partition(g, 3, "random", seed=1)
    assert edges_kept_fraction(parts, g.num_edges()) < 0.6
    g_full, _, _ = _grads(model, cluster_partition(g, 1), feat, label, train, False, 0.0)
    g_parts, _, _ = _grads(model, parts, feat, label, train, False, 0.0)
    assert _max_rel_diff(g_parts, g_full) > 1e-3


def test_shared_hash_masks_follow_the_node_and_are_shared_by_blocks():
    p, key, width = 0.3, 99, 16
    ids = torch.tensor([5, 17, 3, 250])
    masks = SharedHashMasks(p, key, head_layer=6)
    block = masks((4, width), ids, 0)
    assert masks((4, width), ids, 5) is block  # one tensor for every block
    head = masks((4, width), ids, 6)
    assert not torch.equal(head, block)
    expected = hash_keep_mask(ids, width, p, key, 0).to(torch.float32) * (1.0 / (1.0 - p))
    assert torch.equal(block, expected)
    other = SharedHashMasks(p, key, head_layer=6)((2, width), torch.tensor([250, 5]), 2)
    assert torch.equal(other, block[[3, 0]])  # same node, same mask row, in any part
    big = SharedHashMasks(p, key, head_layer=1)((20000, 8), torch.arange(20000), 0)
    assert float((big > 0).float().mean()) == pytest.approx(1 - p, abs=0.01)


def _dataset(n=240, multilabel=False, seed=0):
    g, _ = _components_graph([n // 3] * 3, edges_per_node=3, seed=seed)
    # a few cross-cluster edges: one connected graph
    gen = torch.Generator().manual_seed(seed + 1)
    g = dgl.add_edges(g, torch.randint(n, (n // 4,), generator=gen), torch.randint(n, (n // 4,), generator=gen))
    label = torch.arange(n) * CLASSES // n  # cluster-correlated classes
    feat = torch.randn(n, FEATS, generator=gen) + torch.nn.functional.one_hot(label, FEATS).float()
    if multilabel:
        label = torch.nn.functional.one_hot(label, CLASSES)[:, :TASKS].float()
    perm = torch.randperm(n, generator=gen)
    return GraphDataset(name="rev-test", graph=as_graph(g), feat=feat, label=label, train_idx=perm[: n // 2],
                        valid_idx=perm[n // 2: 3 * n // 4], test_idx=perm[3 * n // 4:],
                        num_classes=TASKS if multilabel else CLASSES, multilabel=multilabel)


def _trainer(ds, plan, *, seed=0, meter=False, deq=False, dropout=0.1, layers=6):
    torch.manual_seed(seed)
    model = build_model("revgnn", ds.num_features, ds.num_classes, hidden=16, layers=layers,
                        dropout=dropout, deq=deq)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    m = None
    if meter:
        m = MemoryMeter("cpu")
        m.track(model, opt)
    return RevTrainer(model, opt, ds, plan, seed=seed, meter=m), model


def test_trainer_learns_and_records_memory_per_part():
    ds = _dataset()
    trainer, _ = _trainer(ds, RevPlan("random", 3), meter=True)
    records = [trainer.train_epoch(e) for e in range(8)]
    assert records[-1].loss < 0.8 * records[0].loss
    assert records[-1].train_acc > records[0].train_acc
    metrics = records[-1].metrics()
    assert {"loss", "train_acc", "k", "edges_kept_fraction", "time_partition_s", "time_compute_s",
            "epoch_time_s", "peak_mem_measured_bytes", "peak_mem_estimated_bytes",
            "mem_estimate_error"} <= set(metrics)
    assert metrics["k"] == 3 and len(records[-1].parts) == 3
    # random clusters are re-drawn every epoch, seeded by (seed, epoch)
    assert all(r.repartitioned for r in records)
    assert not torch.equal(trainer.split(0)[0][0].node_ids, trainer.split(1)[0][0].node_ids)
    assert cluster_seed(0, 1) != cluster_seed(0, 2)
    # one meter region per part; after the first step (Adam state exists) the reversible
    # estimator matches the measurement per part
    for rec in records[1:]:
        for part in rec.parts:
            assert part.peak_bytes and part.estimated_bytes
            assert abs(part.estimated_bytes - part.peak_bytes) <= 0.05 * part.peak_bytes, part


def test_training_is_reproducible_and_metis_split_is_kept():
    ds = _dataset()
    a, model_a = _trainer(ds, RevPlan("metis", 3))
    b, model_b = _trainer(ds, RevPlan("metis", 3))
    ra = [a.train_epoch(e) for e in range(2)]
    rb = [b.train_epoch(e) for e in range(2)]
    assert [r.loss for r in ra] == [r.loss for r in rb]
    assert all(torch.equal(p, q) for p, q in zip(model_a.parameters(), model_b.parameters()))
    assert [r.repartitioned for r in ra] == [True, False]


def test_multilabel_and_deq_train():
    ds = _dataset(multilabel=True)
    trainer, _ = _trainer(ds, RevPlan("random", 2), meter=True)
    first, last = trainer.train_epoch(0), [trainer.train_epoch(e) for e in range(1, 5)][-1]
    assert last.loss < first.loss and 0.0 <= last.train_acc <= 1.0
    deq, _ = _trainer(_dataset(), RevPlan("random", 2), deq=True, meter=True)
    rec = deq.train_epoch(0)
    assert rec.peak_mem_measured_bytes and rec.peak_mem_estimated_bytes is None  # no DEQ estimator
    with pytest.raises(ValueError, match="k='auto' needs the reversible memory estimator"):
        _trainer(_dataset(), RevPlan("random", "auto", memory_budget=10**9), deq=True)


def test_plan_and_trainer_refuse_what_they_cannot_honour():
    """A plan's K and budget are checked as the sampled plan's are (NumPy integers are
    integers, ``True`` is not; a budget is a finite byte count); a budget is refused where
    no estimate could hold a split to it, and a model in another dtype than the trainer's."""
    assert RevPlan("random", np.int64(2)).k == 2
    for bad, match in ((dict(k=True), "k must be an integer"),
                       (dict(k=2, memory_budget="1GiB"), "memory_budget must be a finite number"),
                       (dict(k=2, memory_budget=0.5), "memory_budget must be a finite number of bytes >= 1, got 0.5"),
                       (dict(k=2, safety_margin=float("nan")), "safety_margin must be a number in")):
        with pytest.raises(ValueError, match=match):
            RevPlan("random", **bad)
    with pytest.raises(ValueError, match="a memory_budget needs the memory estimates"):
        _trainer(_dataset(), RevPlan("random", 2, memory_budget=10**9), deq=True)
    ds = _dataset()
    model = build_model("revgnn", ds.num_features, ds.num_classes, hidden=16, layers=2).double()
    with pytest.raises(ValueError, match="parameters are torch.float64 but the trainer's dtype is torch.float32"):
        RevTrainer(model, torch.optim.Adam(model.parameters()), ds, RevPlan("random", 2))


def test_k_auto_picks_the_smallest_fitting_k():
    ds = _dataset(n=300)
    probe, _ = _trainer(ds, RevPlan("random", 1))
    whole = probe.estimate(cluster_partition(ds.graph.to_dgl(), 1))[0]
    budget = int(whole * 0.9)  # the full graph does not fit
    searches = []
    trainer, _ = _trainer(ds, RevPlan("random", "auto", memory_budget=budget, safety_margin=0.0))
    trainer.on_search = searches.append
    parts, estimates, _ = trainer.split(0)
    assert trainer.k == len(parts) > 1 and len(searches) == 1
    assert max(estimates) <= budget
    assert searches[0].tried[trainer.k - 1] > budget  # K - 1 was estimated and did not fit
    rec = trainer.train_epoch(1)
    assert rec.k == trainer.k


def test_k_auto_rechecks_every_fresh_random_split(monkeypatch):
    """Each epoch's new random split is estimated against the budget; one that does not
    fit (here: its estimate inflated past the budget) runs the search again, so no epoch
    trains a split estimated over budget."""
    import betty.rev.engine as rev_engine

    ds = _dataset(n=300)
    probe, _ = _trainer(ds, RevPlan("random", 1))
    whole = probe.estimate(cluster_partition(ds.graph.to_dgl(), 1))[0]
    budget = int(whole * 0.6)
    searches = []
    trainer, _ = _trainer(ds, RevPlan("random", "auto", memory_budget=budget, safety_margin=0.0))
    trainer.on_search = searches.append
    trainer.split(0)
    assert len(searches) == 1
    parts, estimates, fresh = trainer.split(1)  # a fresh split that fits: no new search
    assert fresh and len(searches) == 1 and max(estimates) <= budget
    real = rev_engine.estimate_parts
    calls = []

    def inflated(*args, **kwargs):  # every fresh split now looks 3x larger
        calls.append(1)
        return [3 * e for e in real(*args, **kwargs)]

    monkeypatch.setattr(rev_engine, "estimate_parts", inflated)
    parts, estimates, fresh = trainer.split(2)
    assert calls and len(searches) == 2  # the split was checked, then searched again
    assert max(estimates) <= budget and len(parts) == trainer.k
    assert trainer.last_split_times["ksearch_s"] is not None


def test_inference_casts_features_to_the_models_dtype():
    """bfloat16 host features, a float32 RevGNN, no dtype given: full-graph and multi-view
    inference cast them as training does."""
    from betty.evaluation import evaluate_model

    ds = _dataset()
    model = build_model("revgnn", ds.num_features, ds.num_classes, hidden=16, layers=2).float()
    low = GraphDataset(**{**ds.__dict__, "feat": ds.feat.bfloat16()})
    cast = GraphDataset(**{**ds.__dict__, "feat": low.feat.float()})
    for options in ({}, {"inference": "multiview", "views": 2, "parts": 2}):
        assert evaluate_model(model, low, **options) == evaluate_model(model, cast, **options)


def test_batch_norm_is_refused_on_several_ranks():
    """Each rank would update the running statistics from its own parts: the ranks' models
    would drift apart and from the one-process model."""
    ds = _dataset()
    with pytest.warns(RuntimeWarning, match="three times"):
        model = build_model("revgnn", ds.num_features, ds.num_classes, hidden=16, layers=2, norm="batch")
    trainer = RevTrainer(model, torch.optim.Adam(model.parameters()), ds, RevPlan("random", 2))
    with pytest.raises(ValueError, match="batch normalisation"):
        trainer.parallel = object()  # any DataParallel: refused before it is used
    with pytest.raises(ValueError, match="batch normalisation"):
        RevTrainer(model, torch.optim.Adam(model.parameters()), ds, RevPlan("random", 2), parallel=object())
    trainer.parallel = None
