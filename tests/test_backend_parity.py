"""Cross-backend parity: the same weights on the same sampled blocks give the same
outputs and gradients on the DGL and the PyG backend (float64, 1e-10 relative), for
every GraphSAGE aggregator, GAT (also with one output head) and the symmetric GCN, dropout
included (node- and edge-keyed masks).
Needs both frameworks (``.venv`` has both)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch_geometric")
pytest.importorskip("dgl")

from betty.microbatch import carve  # noqa: E402
from betty.models import build_model  # noqa: E402
from betty.models.dropout import dropout_key  # noqa: E402
from betty.sampling import sample_full_batch  # noqa: E402
from betty.train import gradients, max_relative_difference  # noqa: E402
from graphs import power_law_graph  # noqa: E402

pytestmark = [pytest.mark.dgl, pytest.mark.pyg]

# (arch, aggregator or variant): "1head" is GAT with output_heads=1
MODELS = [("sage", "mean"), ("sage", "gcn"), ("sage", "pool"), ("sage", "lstm"), ("gat", None),
          ("gat", "1head"), ("gcn", None)]
TOL = 1e-10


@pytest.fixture(scope="module")
def batch_data():
    g, feat, label, train = power_law_graph(num_nodes=500, avg_degree=8, seed=1)
    batch = sample_full_batch(g, train, [5, 10], seed=0)
    mb = carve(batch, torch.arange(batch.num_outputs))
    assert int((mb.layers[-1].in_degrees() == 0).sum()) > 0, "test needs zero-in-degree outputs"
    assert len(set(mb.layers[0].in_degrees().tolist())) > 3, "test needs several LSTM degree buckets"
    return mb, feat[mb.input_nid].double(), label[mb.output_nid]


def _model(arch, agg, backend, in_feats, hidden, dropout):
    torch.manual_seed(0)
    return build_model(arch, in_feats, 5, hidden=hidden, layers=2,
                       aggregator=agg if arch == "sage" else "mean", heads=2,
                       output_heads=1 if agg == "1head" else None, dropout=dropout,
                       attn_dropout=dropout / 2, backend=backend).double().train()


def _run(model, mb, x, label):
    model.zero_grad(set_to_none=True)
    out = model(model.make_blocks(mb.layers), x,
                src_nids=[layer.src_nid for layer in mb.layers],
                edge_ids=[layer.edge_id for layer in mb.layers], dropout_key=dropout_key(0, 3))
    torch.nn.functional.cross_entropy(out, label, reduction="sum").backward()
    return out.detach(), gradients(model)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


# in=12: hidden=16 aggregates then projects on layer 0 (DGL's order for in <= out) and
# projects then aggregates on layer 1 (16 > 5); hidden=8 projects first on both layers.
@pytest.mark.parametrize("hidden", [8, 16])
@pytest.mark.parametrize("dropout", [0.0, 0.5], ids=["nodrop", "drop"])
@pytest.mark.parametrize("arch,agg", MODELS, ids=[f"{a}-{g}" if g else a for a, g in MODELS])
def test_same_weights_same_blocks_same_outputs_and_gradients(batch_data, arch, agg, dropout, hidden):
    mb, x, label = batch_data
    dgl_model = _model(arch, agg, "dgl", x.shape[1], hidden, dropout)
    pyg_model = _model(arch, agg, "pyg", x.shape[1], hidden, dropout)
    assert dgl_model.backend_name == "dgl" and pyg_model.backend_name == "pyg"
    dgl_state = dgl_model.state_dict()
    assert {k: v.shape for k, v in pyg_model.state_dict().items()} == {k: v.shape for k, v in dgl_state.items()}
    pyg_model.load_state_dict(dgl_state, strict=True)
    out_d, grad_d = _run(dgl_model, mb, x, label)
    out_p, grad_p = _run(pyg_model, mb, x, label)
    assert float(out_d.abs().max()) > 0
    assert _rel(out_p, out_d) < TOL
    assert set(grad_p) == set(grad_d)
    err = max_relative_difference(grad_p, grad_d)
    assert err < TOL, f"relative gradient difference {err:.3e}"


def test_same_seed_same_initial_weights():
    """Both backends build their layers in DGL's order, so one seed gives one model."""
    for arch, agg in MODELS:
        a = _model(arch, agg, "dgl", 12, 16, 0.0).state_dict()
        b = _model(arch, agg, "pyg", 12, 16, 0.0).state_dict()
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), (arch, agg)


def test_layerwise_inference_matches(batch_data):
    """Full-neighbour layer-wise inference gives the same logits on both backends."""
    from betty.inference import layerwise_inference

    g, feat, _, _ = power_law_graph(num_nodes=300, avg_degree=6, seed=2)
    for arch, agg in (("sage", "lstm"), ("gat", None), ("gcn", None)):
        dgl_model = _model(arch, agg, "dgl", feat.shape[1], 8, 0.0)
        pyg_model = _model(arch, agg, "pyg", feat.shape[1], 8, 0.0)
        pyg_model.load_state_dict(dgl_model.state_dict())
        a = layerwise_inference(dgl_model, g, feat.double(), chunk_size=64)
        b = layerwise_inference(pyg_model, g, feat.double(), chunk_size=64)
        assert _rel(b, a) < TOL


@pytest.mark.parametrize("arch,agg", MODELS, ids=[f"{a}-{g}" if g else a for a, g in MODELS])
def test_parity_on_a_graph_with_self_loops(arch, agg):
    """``dataset.self_loops``: the same outputs and gradients on a self-looped graph."""
    from betty.graph import Graph

    g, feat, label, train = power_law_graph(num_nodes=300, avg_degree=6, seed=4)
    looped = g.with_self_loops()
    assert looped.num_edges() > g.num_edges()
    batch = sample_full_batch(looped, train, [4, 6], seed=0)
    mb = carve(batch, torch.arange(batch.num_outputs))
    x, y = feat[mb.input_nid].double(), label[mb.output_nid]
    dgl_model = _model(arch, agg, "dgl", x.shape[1], 8, 0.5)
    pyg_model = _model(arch, agg, "pyg", x.shape[1], 8, 0.5)
    pyg_model.load_state_dict(dgl_model.state_dict(), strict=True)
    out_d, grad_d = _run(dgl_model, mb, x, y)
    out_p, grad_p = _run(pyg_model, mb, x, y)
    assert _rel(out_p, out_d) < TOL
    assert max_relative_difference(grad_p, grad_d) < TOL
    assert isinstance(looped, Graph)


def test_gat_output_heads_shapes():
    """``output_heads`` sets the last layer's heads only (hidden layers keep ``heads``)."""
    model = build_model("gat", 12, 5, hidden=8, layers=2, heads=4, output_heads=1, backend="pyg")
    assert tuple(model.layers[0].attn_l.shape) == (1, 4, 8)
    assert tuple(model.layers[1].attn_l.shape) == (1, 1, 5)
    assert tuple(model.layers[1].fc.weight.shape) == (5, 32)
    default = build_model("gat", 12, 5, hidden=8, layers=2, heads=4, backend="pyg")
    assert tuple(default.layers[1].attn_l.shape) == (1, 4, 5)
