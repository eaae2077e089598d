"""Full-graph / K-partition training and multi-view inference for reversible GNNs, on
each backend (every test runs once per installed backend)."""

import numpy as np
import pytest
import torch
from graphs import rand_whole_graph, whole_graph
from torch import nn

from betty.backends import get_backend

from betty.rev.engine import train_step_parts
from betty.rev.model import RevGNN
from betty.rev.training import (
    GraphPart,
    cluster_partition,
    features_on,
    full_graph_inference,
    multiview_inference,
)


def _clustered_graph(sizes, intra_edges, inter_edges=0, seed=0, *, backend: str):
    """Dense random clusters of the given sizes, plus ``inter_edges`` random edges."""
    torch.manual_seed(seed)
    offsets = np.cumsum([0] + list(sizes))
    src, dst = [], []
    for start, size in zip(offsets[:-1], sizes):
        src.append(torch.randint(size, (intra_edges,)) + int(start))
        dst.append(torch.randint(size, (intra_edges,)) + int(start))
    n = int(offsets[-1])
    src.append(torch.randint(n, (inter_edges,)))
    dst.append(torch.randint(n, (inter_edges,)))
    return whole_graph(torch.cat(src), torch.cat(dst), n, backend)


def _global_mask_fn(shape, node_ids, layer):
    """Deterministic keep-mask keyed by (global node ID, column, layer), p ~ 0.3."""
    cols = torch.arange(shape[1], dtype=torch.float64)
    u = torch.sin(node_ids.double()[:, None] * 12.9898 + cols[None, :] * 78.233 + layer * 37.719)
    return (u * 43758.5453).frac().abs() >= 0.3


@pytest.mark.parametrize("method", ["random", "metis"])
def test_partition_covers_nodes_once_with_induced_subgraphs(backend, method):
    torch.manual_seed(0)
    g = _clustered_graph([25, 30, 20, 25], intra_edges=120, inter_edges=30, backend=backend)
    parts = cluster_partition(g, 4, method=method, seed=1)
    ids = torch.cat([p.node_ids for p in parts])
    assert sorted(ids.tolist()) == list(range(g.num_nodes()))
    src, dst = g.edges()
    part_of = torch.empty(g.num_nodes(), dtype=torch.long)
    for i, p in enumerate(parts):
        part_of[p.node_ids] = i
        assert torch.equal(get_backend(backend).graph_node_ids(p.graph), p.node_ids)
        assert bool((p.node_ids[1:] > p.node_ids[:-1]).all())
    for i, p in enumerate(parts):  # induced: exactly the edges with both ends in the part
        both = (part_of[src] == i) & (part_of[dst] == i)
        assert p.graph.num_edges() == int(both.sum())
        s, d = p.graph.edges()
        local_pairs = set(zip(p.node_ids[s].tolist(), p.node_ids[d].tolist()))
        assert local_pairs == set(zip(src[both].tolist(), dst[both].tolist()))
    if method == "random":
        assert sorted(len(p.node_ids) for p in parts) == [25, 25, 25, 25]


def test_metis_cuts_fewer_edges_than_random(backend):
    g = _clustered_graph([40, 40, 40, 40], intra_edges=300, inter_edges=20, backend=backend)
    src, dst = g.edges()

    def cut(parts):
        part_of = torch.empty(g.num_nodes(), dtype=torch.long)
        for i, p in enumerate(parts):
            part_of[p.node_ids] = i
        return int((part_of[src] != part_of[dst]).sum())

    metis, random = cut(cluster_partition(g, 4, "metis", seed=0)), cut(cluster_partition(g, 4, "random", seed=0))
    assert metis <= 40 < random  # at most the 20 planted cross edges (both directions)


def test_partition_arguments(backend):
    g = rand_whole_graph(10, 20, backend)
    with pytest.raises(ValueError, match=r"k must be in \[1, num_nodes=10\]"):
        cluster_partition(g, 11)
    with pytest.raises(ValueError, match="method must be one of"):
        cluster_partition(g, 2, method="louvain")
    assert cluster_partition(g, 1)[0].graph.num_edges() == g.num_edges()


def _components_setup(*, backend: str):
    g = _clustered_graph([20, 15, 25], intra_edges=60, inter_edges=0, seed=3, backend=backend)
    n = g.num_nodes()
    torch.manual_seed(4)
    feat = torch.randn(n, 5, dtype=torch.float64)
    label = torch.randint(0, 3, (n,))
    train_mask = torch.rand(n) < 0.6
    bounds = [0, 20, 35, 60]
    parts = [
        GraphPart(get_backend(backend).node_subgraph(g, torch.arange(a, b)), torch.arange(a, b))
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    return g, feat, label, train_mask, parts


def test_k_parts_without_cut_edges_equal_full_graph_training(backend):
    """Parts = connected components, dropout keyed by global node ID: accumulating the K
    part gradients reproduces the full-graph gradient of the mean training loss."""
    g, feat, label, train_mask, parts = _components_setup(backend=backend)
    torch.manual_seed(5)
    model = RevGNN(5, 8, 3, num_layers=4, dropout=0.3, mask_fn=_global_mask_fn, backend=backend).double()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    total = train_step_parts(model, opt, parts, feat, label, train_mask, loss_fn=loss_fn).loss
    part_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    full = [GraphPart(g, torch.arange(g.num_nodes()))]
    total_full = train_step_parts(model, opt, full, feat, label, train_mask, loss_fn=loss_fn).loss
    for n, p in model.named_parameters():
        torch.testing.assert_close(part_grads[n], p.grad, rtol=1e-10, atol=1e-12)
    assert total == pytest.approx(total_full, rel=1e-12)
    model.zero_grad()
    out = model(g, feat)
    ref = nn.functional.cross_entropy(out[train_mask], label[train_mask])
    assert total_full == pytest.approx(ref.item(), rel=1e-12)


def test_cut_edges_change_the_gradient(backend):
    """Control: with edges across parts, K-partition training is a different computation."""
    g = _clustered_graph([30, 30], intra_edges=100, inter_edges=60, seed=6, backend=backend)
    n = g.num_nodes()
    feat = torch.randn(n, 5, dtype=torch.float64)
    label = torch.randint(0, 3, (n,))
    train_mask = torch.ones(n, dtype=torch.bool)
    model = RevGNN(5, 8, 3, num_layers=3, backend=backend).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    train_step_parts(model, opt, cluster_partition(g, 2, "metis"), feat, label, train_mask, loss_fn=loss_fn)
    part = model.encoder.weight.grad.clone()
    train_step_parts(model, opt, [GraphPart(g, torch.arange(n))], feat, label, train_mask, loss_fn=loss_fn)
    assert (part - model.encoder.weight.grad).norm() > 1e-6 * part.norm()


def test_partition_training_reduces_loss(backend):
    g = _clustered_graph([50, 50, 50], intra_edges=200, inter_edges=40, seed=7, backend=backend)
    n = g.num_nodes()
    feat = torch.randn(n, 5)
    label = (feat[:, 0] > 0).long() + (feat[:, 1] > 0).long()
    train_mask = torch.rand(n) < 0.7
    model = RevGNN(5, 16, 3, num_layers=4, dropout=0.1, backend=backend)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    losses = [
        train_step_parts(model, opt, cluster_partition(g, 3, "random", seed=step), feat, label,
                         train_mask, loss_fn=loss_fn, clip_grad_norm=1.0).loss
        for step in range(12)
    ]
    assert losses[-1] < 0.8 * losses[0], losses


def test_train_step_argument_checks(backend):
    g, feat, label, train_mask, parts = _components_setup(backend=backend)
    model = RevGNN(5, 8, 3, num_layers=2, backend=backend).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="reduction='sum'"):
        train_step_parts(model, opt, parts, feat, label, train_mask, loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="train_mask must be bool"):
        train_step_parts(model, opt, parts, feat, label, train_mask.long(),
                         loss_fn=nn.CrossEntropyLoss(reduction="sum"))
    with pytest.raises(ValueError, match="selects no training nodes"):
        train_step_parts(model, opt, parts, feat, label, torch.zeros_like(train_mask),
                         loss_fn=nn.CrossEntropyLoss(reduction="sum"))


def test_multiview_inference_averages_partition_predictions(backend):
    g = _clustered_graph([30, 30], intra_edges=100, inter_edges=40, seed=8, backend=backend)
    n = g.num_nodes()
    feat = torch.randn(n, 5, dtype=torch.float64)
    model = RevGNN(5, 8, 3, num_layers=3, dropout=0.5, backend=backend).double()
    full = full_graph_inference(model, g, feat)
    assert not model.training
    torch.testing.assert_close(multiview_inference(model, g, feat, k=1, num_views=2), full)
    views = []
    with torch.no_grad():
        for v in range(3):
            out = torch.empty(n, 3, dtype=torch.float64)
            for part in cluster_partition(g, 2, "random", seed=10 + v):
                out[part.node_ids] = torch.sigmoid(model(part.graph, feat[part.node_ids]))
            views.append(out)
    expected = torch.stack(views).mean(0)
    got = multiview_inference(model, g, feat, k=2, num_views=3, seed=10, transform=torch.sigmoid)
    torch.testing.assert_close(got, expected)
    assert (got - torch.sigmoid(full)).abs().max() > 1e-6  # cut edges change predictions


def test_inference_casts_features_as_they_move(backend):
    """``dtype``: float32 features in a float64 model give what features cast
    beforehand give, bit for bit, and the cast is made chunk by chunk on the way to
    the device: the host holds no cast copy of the whole matrix."""
    from betty.memory.trace import AllocationTrace

    g = _clustered_graph([30, 30], intra_edges=100, inter_edges=40, seed=3, backend=backend)
    feat = torch.randn(g.num_nodes(), 5)
    model = RevGNN(5, 8, 3, num_layers=2, backend=backend).double()
    wide = feat.double()
    assert torch.equal(full_graph_inference(model, g, feat, dtype=torch.float64),
                       full_graph_inference(model, g, wide))
    assert torch.equal(multiview_inference(model, g, feat, k=2, num_views=2, seed=4, dtype=torch.float64),
                       multiview_inference(model, g, wide, k=2, num_views=2, seed=4))
    assert features_on(wide) is wide and torch.equal(features_on(feat, "cpu", torch.float64, chunk_rows=7), wide)
    with AllocationTrace(device="cpu") as trace:
        moved = features_on(feat, "meta", torch.float64, chunk_rows=16)
    assert moved.device.type == "meta" and moved.dtype == torch.float64 and moved.shape == feat.shape
    assert max((e.nbytes for e in trace.events if e.kind == "alloc"), default=0) <= 16 * 5 * 8


def test_clip_grad_norm_bounds_the_step(backend):
    """SGD with lr 1: the update is the accumulated gradient scaled as
    ``torch.nn.utils.clip_grad_norm_`` scales it, ``clip / (norm + 1e-6)``, where
    ``norm`` is the unclipped gradient's global norm (taken from the same step without
    clipping)."""
    g, feat, label, train_mask, parts = _components_setup(backend=backend)

    def step_norm(clip):
        torch.manual_seed(0)
        model = RevGNN(5, 8, 3, num_layers=2, backend=backend).double()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        before = [p.detach().clone() for p in model.parameters()]
        train_step_parts(model, opt, parts, feat, label, train_mask, clip_grad_norm=clip)
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.detach() - b)
                                                     for p, b in zip(model.parameters(), before)])).item()

    norm = step_norm(None)
    assert norm > 1e-2
    assert step_norm(1e-3) == pytest.approx(norm * 1e-3 / (norm + 1e-6), rel=1e-9)
    with pytest.raises(ValueError, match="clip_grad_norm is for one process"):
        train_step_parts(RevGNN(5, 8, 3, num_layers=2, backend=backend).double(), None, parts, feat, label,
                         train_mask, clip_grad_norm=1.0, parallel=object())
