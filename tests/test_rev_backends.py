"""RevGNN on both backends: the same weights (one seed, one state_dict) give the same
outputs and gradients on a DGL graph and on a PyG ``PygGraph`` (float64, 1e-10 relative),
and the K-part split is the same node/edge partition on both (edge order may differ:
DGL's ``node_subgraph`` has its own order, which changes sums only by rounding)."""

import pytest
import torch

pytest.importorskip("dgl")
pytest.importorskip("torch_geometric")

from betty.backends import backend_of_graph, get_backend  # noqa: E402
from betty.graph import Graph  # noqa: E402
from betty.rev.model import RevGNN  # noqa: E402
from betty.rev.deq import RevGNNDEQ  # noqa: E402
from betty.rev.training import backend_graph, cluster_partition  # noqa: E402

pytestmark = pytest.mark.dgl  # needs both frameworks

RTOL = 1e-10


def _graph(n: int = 40, e: int = 160, seed: int = 0) -> Graph:
    """Random directed graph with self-loops on every node but the last three (zero in-degree
    nodes occur in partition subgraphs)."""
    gen = torch.Generator().manual_seed(seed)
    src, dst = torch.randint(n - 3, (e,), generator=gen), torch.randint(n - 3, (e,), generator=gen)
    loops = torch.arange(n - 3)
    return Graph(torch.cat([src, loops]), torch.cat([dst, loops]), n)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    scale = max(float(a.abs().max()), 1e-30)
    assert float((a - b).abs().max()) <= RTOL * scale, float((a - b).abs().max()) / scale


def _pair(cls, seed: int, **kwargs):
    models = {}
    for name in ("dgl", "pyg"):
        torch.manual_seed(seed)
        models[name] = cls(backend=name, **kwargs).double()
    return models


def _run(model, graph, x, y, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(graph, x, **kwargs)
    torch.nn.functional.cross_entropy(out, y, reduction="sum").backward()
    return out.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


CASES = [
    dict(conv="gcn"), dict(conv="sage"), dict(conv="gat", heads=2),
    dict(conv="gat", heads=2, gat_merge="concat"), dict(conv="gcn", weight_tied=True),
    dict(conv="sage", reversible=False), dict(conv="gcn", reversible=False, checkpoint=True),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_revgnn_same_weights_outputs_gradients(kw):
    g = _graph()
    x = torch.randn(g.num_nodes(), 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = torch.randint(3, (g.num_nodes(),), generator=torch.Generator().manual_seed(2))
    models = _pair(RevGNN, 0, in_feats=6, hidden=8, out_feats=3, num_layers=3, dropout=0.3, **kw)
    sd_dgl, sd_pyg = models["dgl"].state_dict(), models["pyg"].state_dict()
    assert list(sd_dgl) == list(sd_pyg)  # same names, same construction order
    for k in sd_dgl:
        assert torch.equal(sd_dgl[k], sd_pyg[k]), k  # one seed, same initialisation
    mask = (torch.rand(g.num_nodes(), 8, generator=torch.Generator().manual_seed(3)) >= 0.3)
    res = {}
    for name, model in models.items():
        graph = backend_graph(model, g)
        assert backend_of_graph(graph).name == name
        model.train()
        res[name] = _run(model, graph, x, y, dropout_mask=mask)
    _close(res["dgl"][0], res["pyg"][0])
    for k, grad in res["dgl"][1].items():
        _close(grad, res["pyg"][1][k])


def test_state_dict_loads_across_backends():
    g = _graph()
    x = torch.randn(g.num_nodes(), 5, dtype=torch.float64)
    torch.manual_seed(7)
    src = RevGNN(5, 8, 3, 2, conv="gat", heads=2, backend="dgl").double().eval()
    torch.manual_seed(99)  # different init, then overwritten
    dst = RevGNN(5, 8, 3, 2, conv="gat", heads=2, backend="pyg").double().eval()
    dst.load_state_dict(src.state_dict())
    with torch.no_grad():
        _close(src(backend_graph(src, g), x), dst(backend_graph(dst, g), x))


def test_deq_same_outputs_gradients():
    g = _graph()
    x = torch.randn(g.num_nodes(), 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = torch.randint(3, (g.num_nodes(),), generator=torch.Generator().manual_seed(2))
    models = _pair(RevGNNDEQ, 0, in_feats=6, hidden=8, out_feats=3, conv="gcn", tol=1e-12,
                   backward_tol=1e-12, max_iter=200, backward_max_iter=200)
    res = {name: _run(m.train(), backend_graph(m, g), x, y) for name, m in models.items()}
    _close(res["dgl"][0], res["pyg"][0])
    for k, grad in res["dgl"][1].items():
        _close(grad, res["pyg"][1][k])


@pytest.mark.parametrize("method", ["random", "metis"])
def test_partition_same_on_both_backends(method):
    g = _graph(60, 200)
    parts = {name: cluster_partition(get_backend(name).full_graph(g), 4, method, seed=5)
             for name in ("dgl", "pyg")}
    assert len(parts["dgl"]) == len(parts["pyg"])
    for a, b in zip(parts["dgl"], parts["pyg"]):
        assert torch.equal(a.node_ids, b.node_ids)
        assert torch.equal(get_backend("pyg").graph_node_ids(b.graph), b.node_ids)
        assert a.graph.num_edges() == b.graph.num_edges()
        n = a.node_ids.numel()
        sa, da = a.graph.edges()
        sb, db = b.graph.edges()
        assert torch.equal((da * n + sa).sort().values, (db * n + sb).sort().values)  # same edges


def test_model_refuses_other_backends_graph():
    g = _graph()
    model = RevGNN(4, 8, 2, 2, backend="pyg")
    with pytest.raises(ValueError, match="built for backend 'pyg' but got a dgl graph"):
        model(get_backend("dgl").full_graph(g), torch.randn(g.num_nodes(), 4))
