"""Splits measured by the library: a trainer's first split (sampled batch and RevGNN
clusters) and the sweep over methods x K with its skip rules (``max_k``, a failing method,
``time_limit_s``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from betty.partition import PARTITIONERS, Split, measure_batch_split, sweep_batch, sweep_grid
from betty.partition.planted import planted_community_graph
from betty.partition.sweep import SWEEP_COLUMNS, sweep_plan
from betty.sampling import sample_full_batch


@pytest.fixture(scope="module")
def batch_and_graph():
    """A 40-output batch (K up to 40; 64 is above it), fanouts (3, 3)."""
    graph, _ = planted_community_graph(300, 4, avg_degree=6.0, seed=0)
    outputs = torch.arange(0, 300, 300 // 40)[:40]
    return sample_full_batch(graph, outputs, [3, 3], seed=0), graph


def test_sweep_skips_failing_and_slow_methods(batch_and_graph, monkeypatch):
    batch, graph = batch_and_graph

    def broken(batch, k, **kw):
        raise RuntimeError("cannot cut this graph")

    monkeypatch.setitem(PARTITIONERS, "broken", broken)
    rows, skipped = sweep_batch(batch, [2, 4, 8, 64], ["range", "broken"], seed=0, graph=graph)
    assert [(r["method"], r["k"]) for r in rows] == [("range", 2), ("range", 4), ("range", 8), ("broken", 2)]
    assert "cannot cut this graph" in rows[-1]["error"] and "K=2" in skipped["broken"]
    assert all(r["redundancy"] >= 1.0 for r in rows[:3])
    assert all(set(r) <= set(SWEEP_COLUMNS) for r in rows)
    rows, skipped = sweep_batch(batch, [2, 4], ["range"], seed=0, graph=graph, time_limit_s=1e-9)
    assert len(rows) == 1 and "time_limit_s" in skipped["range"]


@pytest.mark.parametrize("ks", [[0, 2, 4], [-1], [2.5], [True]])
def test_sweep_refuses_ks_that_are_not_integers_from_1(batch_and_graph, ks):
    """K = 0 used to be recorded as every method's failure, its larger Ks then skipped."""
    batch, graph = batch_and_graph
    with pytest.raises(ValueError, match="ks must be integers >= 1"):
        sweep_batch(batch, ks, ["range"], graph=graph)
    rows, _ = sweep_batch(batch, [np.int64(2), 1], ["range"], graph=graph)  # NumPy integers and K = 1 count
    assert [r["k"] for r in rows] == [1, 2]


def test_sweep_bounded_by_max_k_the_same_everywhere(batch_and_graph):
    batch, graph = batch_and_graph
    rows, skipped = sweep_batch(batch, [2, 4, 8, 16], ["range", "random"], seed=0, graph=graph,
                                max_k={"range": 4})
    assert [(r["method"], r["k"]) for r in rows] == [("range", 2), ("range", 4), ("random", 2), ("random", 4),
                                                     ("random", 8), ("random", 16)]
    assert skipped == {"range": "K=8,16 skipped: above sweep.max_k.range=4"}
    rows, skipped = sweep_batch(batch, [2, 4, 8], ["random"], seed=0, graph=graph, time_limit_s=1e-9)
    assert "K=4,8 skipped" in skipped["random"] and "machine-dependent" in skipped["random"]


def test_sweep_grid_skip_rules_reasons_and_progress():
    """The loop alone, on a fake measure: the cap drops Ks up front, a failure or a slow K
    cuts the method short (its reason first), a slow last K cuts nothing, and every K,
    tried or not, counts once in the progress."""
    def measure(method: str, k: int) -> dict:
        if method == "fails" and k == 4:
            raise ValueError("no cut")
        return {"figure": k}

    calls, notes = [], []
    rows, skipped = sweep_grid(["ok", "fails", "capped"], [2, 4, 8], measure, max_k={"fails": 4, "capped": 2},
                               progress=lambda done, total: calls.append((done, total)),
                               on_skip=lambda method, reason: notes.append((method, reason)))
    assert rows == [{"method": "ok", "k": 2, "figure": 2}, {"method": "ok", "k": 4, "figure": 4},
                    {"method": "ok", "k": 8, "figure": 8}, {"method": "fails", "k": 2, "figure": 2},
                    {"method": "fails", "k": 4, "error": "ValueError: no cut"},
                    {"method": "capped", "k": 2, "figure": 2}]
    assert skipped == {"fails": "failed at K=4: ValueError: no cut; K=8 skipped: above sweep.max_k.fails=4",
                       "capped": "K=4,8 skipped: above sweep.max_k.capped=2"}
    assert notes == list(skipped.items())
    assert calls == [(0, 9), (1, 9), (2, 9), (3, 9), (4, 9), (5, 9), (6, 9), (7, 9), (9, 9)]
    rows, skipped = sweep_grid(["slow"], [2, 4, 8], measure, time_limit_s=0.0, max_k={"slow": 4})
    assert [r["k"] for r in rows] == [2]
    assert skipped["slow"].startswith("K=2 took ") and skipped["slow"].endswith(
        " > sweep.time_limit_s=0.0 (machine-dependent); K=4 skipped; K=8 skipped: above sweep.max_k.slow=4")
    rows, skipped = sweep_grid(["slow"], [8], measure, time_limit_s=0.0)
    assert [r["k"] for r in rows] == [8] and skipped == {}
    assert sweep_plan([2, 4], "other", {"slow": 2}) == ([2, 4], None)


def test_measure_batch_split_is_the_trainers_first_split(backend):
    from betty.engine import PartitionPlan, Trainer
    from betty.models import build_model
    from distributed_cases import CLASSES, FEATS, dataset

    ds = dataset()
    torch.manual_seed(0)
    model = build_model("sage", FEATS, CLASSES, hidden=8, layers=2, backend=backend)
    trainer = Trainer(model, torch.optim.Adam(model.parameters()), ds, [4, 6], PartitionPlan("random", 3))
    batch = trainer.sample(0, 0)
    split = measure_batch_split(trainer, batch)
    groups = trainer.partition(batch, 0, 0)[0].groups
    assert isinstance(split, Split) and split.micro_batch_key == "micro"
    assert split.report["method"] == "random" and split.report["k"] == 3
    assert split.report["peak_mem_estimated_bytes"] == max(r["estimated_bytes"] for r in split.rows)
    assert [r["micro"] for r in split.rows] == [0, 1, 2]
    assert sum(r["num_outputs"] for r in split.rows) == batch.num_outputs
    assert (split.arrays["groups"] == groups.numpy()).all()
    assert (split.arrays["outputs"] == batch.output_nid.numpy()).all()
    metrics = split.metrics()
    assert {"redundancy_layer0", "redundancy_layer1"} <= set(metrics) and "redundancy_per_layer" not in metrics
    assert "method" not in metrics and metrics["k"] == 3
    assert split.summary.startswith("random K=3: redundancy ")
    assert split.batch is batch

    # the trainer's own: the same split of batch 0, sampled when not given
    mine = trainer.measure_split()
    assert mine.rows == split.rows and (mine.arrays["groups"] == split.arrays["groups"]).all()
    assert (mine.batch.output_nid == batch.output_nid).all()
    rows, skipped = trainer.sweep([2, 3], ["range"], seed=0)
    assert [(r["method"], r["k"]) for r in rows] == [("range", 2), ("range", 3)] and skipped == {}

    def figures(rows):
        return [(r["redundancy"], r["imbalance"], r["max_inputs_per_micro_batch"]) for r in rows]

    assert figures(rows) == figures(sweep_batch(batch, [2, 3], ["range"], seed=0)[0])  # batch 0 by default
    other = trainer.sample(1, 0)  # a batch given is the one split
    given = trainer.sweep([2, 3], ["range"], batch=other, seed=0)[0]
    assert figures(given) == figures(sweep_batch(other, [2, 3], ["range"], seed=0)[0]) != figures(rows)


def test_cluster_split_and_sweep(backend):
    from betty.models import build_model
    from betty.rev.engine import RevPlan, RevTrainer
    from betty.rev.sweep import CLUSTER_SWEEP_COLUMNS, measure_cluster_split, sweep_clusters
    from distributed_cases import CLASSES, FEATS, dataset

    ds = dataset()
    torch.manual_seed(0)
    model = build_model("revgnn", FEATS, CLASSES, hidden=8, layers=3, backend=backend)
    trainer = RevTrainer(model, torch.optim.Adam(model.parameters()), ds, RevPlan("random", 2))
    split = measure_cluster_split(trainer)
    n = ds.num_nodes
    assert split.micro_batch_key == "part" and split.report["k"] == 2 and sum(split.report["part_nodes"]) == n
    assert split.report["edges_kept_fraction"] + split.report["edges_dropped_fraction"] == pytest.approx(1.0)
    assert sorted(set(split.arrays["part"].tolist())) == [0, 1] and split.arrays["part"].shape == (n,)
    assert [r["num_nodes"] for r in split.rows] == split.report["part_nodes"]
    assert split.summary.startswith("random clusters K=2: ")
    assert {"part_nodes", "part_edges"}.isdisjoint(split.metrics())  # lists, not scalars

    rows, skipped = sweep_clusters(trainer, [4, 2, n + 1], ["random", "metis"], seed=0, max_k={"metis": 2})
    assert [(r["method"], r["k"]) for r in rows] == [("random", 2), ("random", 4), ("metis", 2)]
    assert skipped == {"metis": "K=4 skipped: above sweep.max_k.metis=2"}
    assert all(set(r) <= set(CLUSTER_SWEEP_COLUMNS) and 0 < r["edges_kept_fraction"] <= 1 for r in rows)
    assert all(r["peak_estimated_bytes"] > 0 for r in rows)
    with pytest.raises(ValueError, match=r"ks must be integers >= 1, got \[0, 2\]"):
        sweep_clusters(trainer, [0, 2], ["random"])

    # the trainer's own, as the sampled engine's (RevGNN takes no batch)
    assert trainer.measure_split().rows == split.rows
    assert [(r["method"], r["k"]) for r in trainer.sweep([2], ["random"], seed=0)[0]] == [("random", 2)]
    with pytest.raises(ValueError, match="samples no batches"):
        trainer.measure_split(batch=object())
    with pytest.raises(ValueError, match="samples no batches"):
        trainer.sweep([2], batch=object())
