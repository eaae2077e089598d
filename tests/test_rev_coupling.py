"""Grouped reversible coupling: exact inverse, mask handling, construction checks, on
each backend (every test runs once per installed backend)."""

import pytest
import torch
from graphs import rand_whole_graph
from torch import nn

from betty.rev.model import GroupedReversibleStack, RevGNN, make_coupling
from betty.rev.coupling import (
    GroupFunction,
    ReversibleCoupling,
    find_stochastic_modules,
    split_group_masks,
)


def _graph(n: int = 30, e: int = 90, seed: int = 0, *, backend: str):
    """Random graph from torch's RNG (seeded) plus self-loops, as ``backend``'s whole graph."""
    torch.manual_seed(seed)
    return rand_whole_graph(n, e, backend)


@pytest.mark.parametrize("conv", ["gcn", "sage", "gat"])
@pytest.mark.parametrize("groups", [2, 3, 4])
def test_coupling_inverse_recovers_input(backend, conv, groups):
    g = _graph(backend=backend)
    coupling = make_coupling(12, groups, conv, heads=2, backend=backend).double()
    x = torch.randn(30, 12, dtype=torch.float64)
    mask = (torch.rand(30, 12) > 0.3).double() / 0.7
    with torch.no_grad():
        y = coupling(g, x, mask)
        x_rec = coupling.inverse(g, y, mask)
    assert (y - x).abs().max() > 1e-3  # the coupling does something
    assert (x_rec - x).abs().max() < 1e-13


def test_coupling_matches_the_formula_for_three_groups(backend):
    """X'_0 = X_2 + X_3; X'_i = f_i(X'_{i-1}) + X_i, written out by hand."""
    g = _graph(backend=backend)
    coupling = make_coupling(9, 3, "sage", backend=backend).double()
    x = torch.randn(30, 9, dtype=torch.float64)
    f = coupling.functions
    x1, x2, x3 = x.split(3, dim=1)
    y1 = f[0](g, x2 + x3) + x1
    y2 = f[1](g, y1) + x2
    y3 = f[2](g, y2) + x3
    torch.testing.assert_close(coupling(g, x), torch.cat([y1, y2, y3], dim=1), rtol=0, atol=0)


def test_reconstruction_after_100_blocks_float64(backend):
    g = _graph(40, 160, backend=backend)
    stack = GroupedReversibleStack([make_coupling(8, 2, "gcn", backend=backend) for _ in range(100)]).double()
    x = torch.randn(40, 8, dtype=torch.float64)
    mask = (torch.rand(40, 8) > 0.2).double() / 0.8
    with torch.no_grad():
        y = stack(g, x.clone(), mask)
        x_rec = stack.inverse(g, y, mask)
    assert (y - x).abs().max() > 1e-2
    err = (x_rec - x).abs().max().item()
    assert err < 1e-10, err


def test_inverse_with_a_different_mask_is_wrong(backend):
    """Negative control for the reconstruction test: the mask matters."""
    g = _graph(backend=backend)
    stack = GroupedReversibleStack([make_coupling(8, 2, "gcn", backend=backend) for _ in range(5)]).double()
    x = torch.randn(30, 8, dtype=torch.float64)
    mask = (torch.rand(30, 8) > 0.5).double() * 2
    with torch.no_grad():
        y = stack(g, x.clone(), mask)
        x_wrong = stack.inverse(g, y, torch.ones_like(mask))
    assert (x_wrong - x).abs().max() > 1e-3


def test_group_masks_split_or_shared():
    m_full = torch.arange(12.0).reshape(2, 6)
    parts = split_group_masks(m_full, 3, 2)
    assert [p.tolist() for p in parts] == [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]]
    m_group = torch.ones(2, 2)
    assert all(p is m_group for p in split_group_masks(m_group, 3, 2))
    assert split_group_masks(None, 3, 2) == [None, None, None]
    with pytest.raises(ValueError, match="fits neither"):
        split_group_masks(torch.ones(2, 5), 3, 2)


def test_per_group_mask_equals_repeated_full_mask(backend):
    g = _graph(backend=backend)
    coupling = make_coupling(8, 2, "gcn", backend=backend).double()
    x = torch.randn(30, 8, dtype=torch.float64)
    m = (torch.rand(30, 4) > 0.5).double() * 2
    with torch.no_grad():
        torch.testing.assert_close(coupling(g, x, m), coupling(g, x, m.repeat(1, 2)))


def test_construction_refuses_stochastic_dropout(backend):
    class DropoutF(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = GroupFunction(4, backend=backend)
            self.drop = nn.Dropout(0.5)

        def forward(self, graph, h, mask=None):
            return self.inner(graph, self.drop(h), mask)

    with pytest.raises(ValueError, match="nn.Dropout"):
        ReversibleCoupling([DropoutF(), DropoutF()])
    assert find_stochastic_modules(DropoutF()) == ["drop"]
    # DGL convs hold nn.Dropout(p=0) modules: harmless, accepted
    assert find_stochastic_modules(make_coupling(8, 2, "gat", backend=backend)) == []


def test_batchnorm_warns_about_statistics(backend):
    with pytest.warns(RuntimeWarning, match="three times per training step"):
        make_coupling(8, 2, "gcn", norm="batch", backend=backend)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(hidden=10, num_groups=3), "divisible"),
        (dict(hidden=8, num_groups=1), "num_groups must be >= 2"),
        (dict(hidden=8, num_groups=2, conv="gin"), "conv must be one of"),
        (dict(hidden=8, num_groups=2, norm="group"), "norm must be one of"),
        (dict(hidden=8, num_groups=2, conv="gat", heads=3, gat_merge="concat"), "heads to divide"),
    ],
)
def test_bad_arguments_are_named(backend, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_coupling(**kwargs, backend=backend)


def test_model_argument_errors(backend):
    with pytest.raises(ValueError, match=r"dropout must be a probability in \[0, 1 - 2\^-24\]"):
        RevGNN(4, 8, 2, num_layers=2, dropout=1.0, backend=backend)
    with pytest.raises(ValueError, match="checkpoint=True applies to the residual"):
        RevGNN(4, 8, 2, num_layers=2, reversible=True, checkpoint=True, backend=backend)
    model = RevGNN(4, 8, 2, num_layers=2, backend=backend)
    with pytest.raises(ValueError, match=r"x must be \(num_nodes=30, in_feats=4\)"):
        model(_graph(backend=backend), torch.randn(30, 5))


def test_architecture_reports_what_an_estimator_needs(backend):
    deep = RevGNN(8, 80, 112, num_layers=1001, num_groups=2, dropout=0.1, backend=backend)  # RevGNN-Deep
    arch = deep.architecture()
    assert (arch.num_layers, arch.num_groups, arch.group_width) == (1001, 2, 40)
    assert arch.conv == "gcn" and arch.reversible and not arch.weight_tied
    # per group: LayerNorm 2*40 + GraphConv 40*40 + 40
    per_block = 2 * (2 * 40 + 40 * 40 + 40)
    assert arch.num_parameters == 1001 * per_block + (8 * 80 + 80) + 2 * 80 + (80 * 112 + 112)
    tied = RevGNN(8, 80, 112, num_layers=1001, weight_tied=True, backend=backend).architecture()
    assert tied.weight_tied and tied.num_distinct_blocks == 1
    assert tied.num_parameters == per_block + (8 * 80 + 80) + 2 * 80 + (80 * 112 + 112)


def test_reset_parameters_changes_weights(backend):
    torch.manual_seed(0)
    model = RevGNN(4, 8, 2, num_layers=3, conv="gat", backend=backend)
    before = [p.detach().clone() for p in model.parameters()]
    model.reset_parameters()
    changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters())]
    assert sum(changed) >= len(changed) // 2


@pytest.mark.parametrize("deq", [False, True], ids=["revgnn", "deq"])
def test_reset_parameters_redraws_the_construction_init(backend, deq):
    """RevGNN and RevGNNDEQ share one frame (encoder -> body -> norm -> decoder) for both
    construction and reset_parameters, in the same order: under one seed, reset gives the
    constructor's weights back (GCN layers draw the same way in both; SAGE/GAT do not)."""
    from betty.rev.deq import RevGNNDEQ

    def build():
        torch.manual_seed(3)
        if deq:
            return RevGNNDEQ(5, 8, 3, conv="gcn", backend=backend)
        return RevGNN(5, 8, 3, num_layers=3, conv="gcn", backend=backend)

    fresh = build().state_dict()
    model = build()
    torch.manual_seed(3)
    model.reset_parameters()
    assert list(model.state_dict()) == list(fresh)
    for name, value in model.state_dict().items():
        assert torch.equal(value, fresh[name]), name
