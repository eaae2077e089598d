"""The backend boundary: resolution of ``auto``, clear refusals for a missing backend
(spec validation names the backend and its install command), RevGNN accepted on both."""

from __future__ import annotations

import pytest
import torch

from betty import backends
from betty.batch import LayerEdges
from workflow.spec import SpecError
from workflow.specfile import load_spec


# Loading a spec imports betty.data, which needs DGL until the DGL-free data layer
# (branch i11a) lands; then drop this marker so these run in .venv-pyg too.
spec_needs_dgl = pytest.mark.dgl


def _missing(monkeypatch, *names):
    real = backends.available.__wrapped__
    monkeypatch.setattr(backends, "available",
                        lambda name, import_check=True: name not in names and real(name, import_check))


def test_auto_prefers_dgl_else_pyg(monkeypatch):
    expected = "dgl" if backends.available("dgl") else "pyg"
    assert backends.resolve_backend("auto") == expected
    _missing(monkeypatch, "dgl")
    assert backends.resolve_backend("auto") == "pyg"


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="auto.*dgl.*pyg"):
        backends.resolve_backend("jax")


@spec_needs_dgl
@pytest.mark.parametrize("name", ["dgl", "pyg"])
def test_missing_backend_fails_spec_validation_with_install_command(monkeypatch, name):
    _missing(monkeypatch, name)
    with pytest.raises(SpecError) as err:
        load_spec("tiny", [f"model.backend={name}"])
    text = str(err.value)
    assert "model.backend" in text and repr(name) in text
    assert f"pip install 'betty[{name}]'" in text


@spec_needs_dgl
def test_no_backend_at_all(monkeypatch):
    _missing(monkeypatch, "dgl", "pyg")
    with pytest.raises(SpecError, match=r"betty\[dgl\].*betty\[pyg\]"):
        load_spec("tiny")


def test_revgnn_accepted_on_pyg():
    pytest.importorskip("torch_geometric")
    spec = load_spec("synthetic_revgnn", ["model.backend=pyg"]).spec
    assert (spec.model.arch, spec.model.backend) == ("revgnn", "pyg")


@spec_needs_dgl
def test_unknown_backend_in_spec():
    with pytest.raises(SpecError, match="unknown backend; allowed: 'auto', 'dgl', 'pyg'"):
        load_spec("tiny", ["model.backend=jax"])


def test_pyg_block_keeps_edge_order_and_isolated_destinations():
    pytest.importorskip("torch_geometric")
    layer = LayerEdges(src_nid=torch.tensor([7, 3, 9, 1]), num_dst=3,
                       edge_src=torch.tensor([3, 2, 0]), edge_dst=torch.tensor([0, 0, 2]),
                       edge_id=torch.tensor([5, 6, 7]))
    block = backends.get_backend("pyg").make_block(layer)
    assert block.size == (4, 3)
    assert block.edge_index.tolist() == [[3, 2, 0], [0, 0, 2]]
    assert block.in_degrees().tolist() == [2, 0, 1]
    narrow = LayerEdges(src_nid=layer.src_nid, num_dst=3, edge_src=layer.edge_src.int(),
                        edge_dst=layer.edge_dst.int(), edge_id=layer.edge_id)
    assert backends.get_backend("pyg").make_block(narrow).edge_index.dtype == torch.int64  # scatter's index


def test_the_lstm_aggregator_asks_for_cpu_autocast_without_a_deprecated_call():
    """torch 2.13 deprecates ``is_autocast_cpu_enabled``; every CPU forward warned."""
    import warnings

    from betty.backends.lstm import AutocastLSTM

    lstm = AutocastLSTM(4, 3, batch_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = lstm(torch.randn(2, 5, 4))
    assert out.dtype == torch.float32


@spec_needs_dgl
@pytest.mark.parametrize("arch", ["sage", "gat"])
def test_workflow_builds_the_model_on_the_spec_backend(arch):
    pytest.importorskip("torch_geometric")
    from types import SimpleNamespace

    from workflow.components import build_model

    rspec = load_spec("tiny", [f"model.arch={arch}", "model.backend=pyg"])
    model = build_model(rspec, SimpleNamespace(num_features=6, num_classes=3))
    assert model.backend_name == "pyg"
    assert all(type(layer).__module__.startswith("betty") for layer in model.layers)



@pytest.mark.parametrize("backend", __import__("graphs").backend_params())
def test_node_subgraph_takes_increasing_node_ids_only(backend):
    """A boolean mask was read as node IDs 0 and 1 by PyG; repeated IDs gave each backend
    another subgraph. Both now take the contract's increasing IDs and refuse the rest."""
    from betty.backends import get_backend
    from betty.graph import Graph

    ops = get_backend(backend)
    ring = Graph(torch.tensor([0, 1, 2, 3, 4]), torch.tensor([1, 2, 3, 4, 0]), 5)
    graph = ops.full_graph(ring)
    part = ops.node_subgraph(graph, torch.tensor([2, 3, 4]))
    assert part.num_nodes() == 3 and part.num_edges() == 2
    for ids, message in ((torch.tensor([False, False, True, True, True]), "1-D integer tensor"),
                         (torch.tensor([2, 2, 3]), "strictly increasing"),
                         (torch.tensor([3, 2]), "strictly increasing"),
                         (torch.tensor([2, 7]), r"in \[0, 5\)"),
                         (torch.tensor([[2, 3]]), "1-D integer tensor")):
        with pytest.raises(ValueError, match=message):
            ops.node_subgraph(graph, ids)
