"""Scoring a model on a dataset's splits (:func:`betty.evaluation.evaluate_model`): the
inference each model and mode runs, the metric names, and the refused arguments (each
test runs once per installed backend)."""

from __future__ import annotations

import pytest
import torch
from graphs import power_law_graph

from betty.data import GraphDataset
from betty.evaluation import evaluate_model, is_rev_model, metric_suffix, split_nodes
from betty.inference import evaluate_predictions, layerwise_inference, sampled_inference
from betty.models import build_model
from betty.rev.training import backend_graph, full_graph_inference, multiview_inference

CLASSES = 4


def _dataset(*, multilabel: bool = False, empty_test: bool = False) -> GraphDataset:
    g, feat, label, _ = power_law_graph(num_nodes=120, avg_degree=8, num_feats=6,
                                        num_classes=CLASSES, seed=2)
    perm = torch.randperm(120, generator=torch.Generator().manual_seed(5))
    if multilabel:
        label = torch.nn.functional.one_hot(label, CLASSES).float()
        label[::3, 0] = 1.0  # every task has both classes
    test = perm[:0] if empty_test else perm[90:]
    return GraphDataset(name="eval-test", graph=g, feat=feat, label=label, train_idx=perm[:60],
                        valid_idx=perm[60:90], test_idx=test, num_classes=CLASSES, multilabel=multilabel)


def _sage(backend):
    torch.manual_seed(0)
    return build_model("sage", 6, CLASSES, hidden=8, layers=2, backend=backend)


def _revgnn(backend, *, deq: bool = False):
    """A RevGNN with sharp logits (weights x 10): which partition a node's neighbours fall
    in changes its prediction, so the multi-view options change the scores."""
    torch.manual_seed(0)
    model = build_model("revgnn", 6, CLASSES, hidden=8, layers=2, groups=2, dropout=0.3, deq=deq,
                        backend=backend)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10.0)
    return model


def _scores(logits, ds, split):
    idx = split_nodes(ds, split)
    return evaluate_predictions(logits[idx], ds.label[idx], multilabel=ds.multilabel)[metric_suffix(ds)]


def test_sage_full_and_sampled_inference(backend):
    ds, model = _dataset(), _sage(backend)
    assert not is_rev_model(model)
    calls = []
    got = evaluate_model(model, ds, progress=lambda *a: calls.append(a), chunk_size=50)
    logits = layerwise_inference(model, ds.graph, ds.feat)
    assert got == {"valid_acc": _scores(logits, ds, "valid"), "test_acc": _scores(logits, ds, "test")}
    assert calls[-1] == (1, 120, 120) and len(calls) == 2 * 3  # 2 layers x 3 chunks
    # sampled inference with every neighbour is full-neighbour inference
    assert evaluate_model(model, ds, inference="sampled", fanouts=[-1, -1], chunk_size=7) == pytest.approx(got)
    one = evaluate_model(model, ds, splits=("valid",), inference="sampled", fanouts=[1, 1], seed=3, chunk_size=8)
    valid = split_nodes(ds, "valid")

    def sampled(seed, fanouts=(1, 1)):
        out = sampled_inference(model, ds.graph, ds.feat, valid, list(fanouts), seed=seed, chunk_size=8)
        return {"valid_acc": evaluate_predictions(out, ds.label[valid])["acc"]}

    assert one == sampled(3) and sampled(3) != sampled(0)  # the seed counts
    assert sampled(3) != sampled(3, (-1, -1))  # and the fanouts
    # the compute dtype: float64 on a float64 model
    model64 = _sage(backend).double()
    double = evaluate_model(model64, ds, dtype=torch.float64)
    logits64 = layerwise_inference(model64, ds.graph, ds.feat.double())
    assert logits64.dtype == torch.float64
    assert double == {"valid_acc": _scores(logits64, ds, "valid"), "test_acc": _scores(logits64, ds, "test")}
    assert evaluate_model(model, _dataset(empty_test=True)).keys() == {"valid_acc"}  # no test nodes
    assert evaluate_model(model, ds, splits=()) == {}


def test_revgnn_full_and_multiview_inference(backend):
    ds, model = _dataset(), _revgnn(backend)
    assert is_rev_model(model) and is_rev_model(_revgnn(backend, deq=True))
    graph = backend_graph(model, ds.graph)

    def expected(data, k, views, seed=0, transform=lambda o: torch.softmax(o, dim=1)):
        out = multiview_inference(model, graph, data.feat, k, views, seed=seed, transform=transform)
        return {f"{s}_{metric_suffix(data)}": _scores(out, data, s) for s in ("valid", "test")}

    full = full_graph_inference(model, graph, ds.feat)
    got = evaluate_model(model, ds, train_k=3)  # train_k: the multi-view default only
    assert got == {"valid_acc": _scores(full, ds, "valid"), "test_acc": _scores(full, ds, "test")}
    multi = evaluate_model(model, ds, inference="multiview", views=2, parts=3, seed=7, train_k=5)
    assert multi == expected(ds, 3, 2, seed=7)
    # each option changes these scores (else the checks below could not tell them apart)
    others = [expected(ds, 3, 2, seed=7, transform=torch.sigmoid), expected(ds, 2, 2, seed=7),
              expected(ds, 3, 2, seed=0), expected(ds, 3, 10, seed=7)]
    assert all(other != multi for other in others)
    assert evaluate_model(model, ds, inference="multiview", views=2, train_k=3, seed=7) == multi
    assert evaluate_model(model, ds, inference="multiview", parts=3, seed=7) == others[3]  # 10 views
    # more parts than nodes: one node per part
    assert evaluate_model(model, ds, inference="multiview", parts=500, views=1) == expected(ds, 120, 1)
    # multi-label data: mean ROC-AUC over tasks, of averaged sigmoids
    ml = _dataset(multilabel=True)
    got = evaluate_model(model, ml, inference="multiview", views=2, parts=2)
    assert set(got) == {"valid_rocauc", "test_rocauc"} and got == expected(ml, 2, 2, transform=torch.sigmoid)


@pytest.mark.parametrize(("rev", "kwargs", "message"), [
    (False, {"inference": "layerwise"}, "inference must be one of full, sampled, multiview, got 'layerwise'"),
    (True, {"inference": "bogus"}, "inference must be one of full, sampled, multiview, got 'bogus'"),
    (False, {"inference": "multiview", "parts": 2},
     "inference 'multiview' does not apply to a GraphSAGE; allowed: full, sampled"),
    (True, {"inference": "sampled", "fanouts": [2, 2]},
     "inference 'sampled' does not apply to a RevGNN; allowed: full, multiview"),
    (False, {"inference": "sampled"}, "inference 'sampled' needs fanouts"),
    (False, {"inference": "sampled", "fanouts": [2, 0]}, "fanouts must be ints >= 1 or -1"),
    (False, {"inference": "sampled", "fanouts": [2]}, "fanouts must list one fanout per layer: 2"),
    (False, {"fanouts": [2, 2]}, "fanouts apply to inference 'sampled' only"),
    (True, {"views": 3}, "views applies to inference 'multiview' only"),
    (True, {"inference": "multiview"}, "inference 'multiview' needs parts"),
    (True, {"inference": "multiview", "parts": 0}, "parts must be an int >= 1 or None, got 0"),
    (True, {"inference": "multiview", "parts": 2, "views": 0}, "views must be an int >= 1"),
    (False, {"chunk_size": 0}, "chunk_size must be an int >= 1, got 0"),
    (False, {"splits": ("valid", "dev")}, "splits: 'dev' is not a split; allowed: train, valid, test"),
    (False, {"splits": "valid"}, "splits must be a sequence of split names"),
    (False, {"dtype": torch.int64}, "dtype must be a floating torch.dtype"),
    (False, {"seed": 1.5}, "seed must be an int"),
    (False, {"progress": 3}, "progress must be a callable"),
])
def test_bad_arguments_are_named(backend, rev, kwargs, message):
    model = _revgnn(backend) if rev else _sage(backend)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        evaluate_model(model, _dataset(), **kwargs)


def test_split_nodes_names_the_splits():
    ds = _dataset()
    assert torch.equal(split_nodes(ds, "test"), ds.test_idx)
    with pytest.raises(ValueError, match="split must be one of train, valid, test, got 'dev'"):
        split_nodes(ds, "dev")


def test_predictions_are_scored_against_labels_of_their_own_shape():
    """OGB's ``(n, 1)`` class labels score as ``(n,)`` ones (a broadcast ``(n, n)``
    comparison halved a perfect accuracy); shapes that cannot be meant are refused."""
    logits = torch.eye(4)[[0, 1, 2, 3, 0, 1]]
    label = torch.tensor([0, 1, 2, 3, 0, 1])
    assert evaluate_predictions(logits, label) == {"acc": 1.0}
    assert evaluate_predictions(logits, label.view(-1, 1)) == {"acc": 1.0}
    with pytest.raises(ValueError, match=r"class labels must be \(n,\) or \(n, 1\), got shape \(6, 2\)"):
        evaluate_predictions(logits, torch.zeros(6, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="multi-label targets"):
        evaluate_predictions(torch.rand(6, 3), torch.ones(6, 2), multilabel=True)
    with pytest.raises(ValueError, match=r"logits must be \(n, C\)"):
        evaluate_predictions(torch.rand(6), label)


@pytest.mark.parametrize("multilabel", [False, True])
def test_scores_of_a_diverged_model_are_nan(multilabel):
    """Logits with a NaN (or infinite) entry score NaN: an argmax over NaN rows names
    class 0, which would pass off the share of class 0 as the model's accuracy and let
    best-validation selection keep NaN weights."""
    import math

    label = torch.tensor([[0, 1], [1, 0], [1, 1]]) if multilabel else torch.tensor([0, 0, 1])
    logits = torch.full((3, 2), float("nan"))
    key, score = next(iter(evaluate_predictions(logits, label, multilabel=multilabel).items()))
    assert key == ("rocauc" if multilabel else "acc") and math.isnan(score)
    logits = torch.tensor([[float("inf"), 0.0], [1.0, 0.0], [0.0, 1.0]])
    assert math.isnan(next(iter(evaluate_predictions(logits, label, multilabel=multilabel).values())))
