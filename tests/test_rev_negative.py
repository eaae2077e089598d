"""Misuse of reversible blocks must fail loudly, never corrupt silently (on each backend:
every test runs once per installed backend)."""

import pytest
import torch
import torch.nn.functional as F
from graphs import rand_whole_graph
from torch import nn

from betty.batch import LayerEdges
from betty.backends import get_backend

from betty.rev.model import GroupedReversibleStack, RevGNN, make_coupling
from betty.rev.check import GradientMismatchError, assert_gradient_parity, gradient_parity
from betty.rev.coupling import GroupFunction, ReversibleCoupling


N = 30


def _graph(seed=0, *, backend: str):
    torch.manual_seed(seed)
    return rand_whole_graph(N, 90, backend)


class FunctionalDropoutF(nn.Module):
    """A group function that hides a stochastic F.dropout (invisible to module scans)."""

    def __init__(self, width, *, backend: str):
        super().__init__()
        self.inner = GroupFunction(width, backend=backend)

    def forward(self, graph, h, mask=None):
        return self.inner(graph, F.dropout(h, 0.5, training=True), mask)


class _Wrapper(nn.Module):
    """Minimal model with the set_mode/reversible interface over a custom stack."""

    def __init__(self, stack):
        super().__init__()
        self.encoder = nn.Linear(4, 8)
        self.stack = stack

    @property
    def reversible(self):
        return self.stack.reversible

    def set_mode(self, *, reversible, checkpoint=False):
        self.stack.set_mode(reversible=reversible, checkpoint=checkpoint)

    def forward(self, g, x):
        return self.stack(g, self.encoder(x))


def _stochastic_model(check_consistency, *, backend: str):
    torch.manual_seed(0)
    couplings = [ReversibleCoupling([FunctionalDropoutF(4, backend=backend),
                                     FunctionalDropoutF(4, backend=backend)]) for _ in range(3)]
    return _Wrapper(GroupedReversibleStack(couplings, check_consistency=check_consistency)).double()


def test_leaf_input_to_first_block_raises(backend):
    g = _graph(backend=backend)
    stack = GroupedReversibleStack([make_coupling(8, 2, backend=backend) for _ in range(3)])
    features = torch.randn(N, 8, requires_grad=True)
    kept = features.detach().clone()
    with pytest.raises(ValueError, match="is a leaf tensor"):
        stack(g, features)
    assert torch.equal(features.detach(), kept)  # nothing was freed or changed
    with pytest.raises(ValueError, match="requires_grad=False"):
        stack(g, torch.randn(N, 8))


def test_relu_output_as_first_input_raises(backend):
    g = _graph(backend=backend)
    stack = GroupedReversibleStack([make_coupling(8, 2, backend=backend) for _ in range(2)])
    enc = nn.Linear(8, 8)
    with pytest.raises(ValueError, match="saved by its producer ReluBackward0"):
        stack(g, torch.relu(enc(torch.randn(N, 8))))
    with pytest.raises(ValueError, match="saved by its producer SigmoidBackward0"):
        stack(g, torch.sigmoid(enc(torch.randn(N, 8))))


def test_view_as_first_input_raises(backend):
    g = _graph(backend=backend)
    stack = GroupedReversibleStack([make_coupling(8, 2, backend=backend) for _ in range(2)])
    h = nn.Linear(8, 16)(torch.randn(N, 8))
    with pytest.raises(ValueError, match="is a view"):
        stack(g, h[:, :8])


def test_encoder_output_is_accepted_and_freed_until_backward(backend):
    g = _graph(backend=backend)
    stack = GroupedReversibleStack([make_coupling(8, 2, backend=backend) for _ in range(2)])
    h = nn.Linear(8, 8)(torch.randn(N, 8))
    expected = h.detach().clone()
    out = stack(g, h)
    assert h.untyped_storage().nbytes() == 0  # freed during forward
    out.sum().backward()
    assert h.untyped_storage().nbytes() == h.numel() * h.element_size()  # restored
    torch.testing.assert_close(h.detach(), expected, rtol=1e-5, atol=1e-5)


def test_reversible_output_feeds_only_one_block(backend):
    g = _graph(backend=backend)
    block = GroupedReversibleStack([make_coupling(8, 2, backend=backend)]).blocks[0]
    h = nn.Linear(8, 8)(torch.randn(N, 8))
    y = block(g, h)
    block(g, y)
    with pytest.raises(ValueError, match="already consumed"):
        block(g, y)


def test_output_modified_in_place_raises_in_backward(backend):
    g = _graph(backend=backend)
    stack = GroupedReversibleStack([make_coupling(8, 2, backend=backend) for _ in range(2)])
    out = stack(g, nn.Linear(8, 8)(torch.randn(N, 8)))
    loss = (out * 2).sum()
    out.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        loss.backward()


def test_nn_dropout_injected_after_construction_is_refused_in_forward(backend):
    g = _graph(backend=backend)
    model = RevGNN(4, 8, 2, num_layers=3, backend=backend)
    model.stack.blocks[1].coupling.functions[0].norm = nn.Sequential(nn.LayerNorm(4), nn.Dropout(0.5))
    with pytest.raises(ValueError, match="nn.Dropout"):
        model(g, torch.randn(N, 4))
    model.eval()  # evaluation: dropout is the identity, nothing to refuse
    with torch.no_grad():
        assert model(g, torch.randn(N, 4)).shape == (N, 2)


def test_hidden_stochastic_dropout_fails_the_backward_consistency_check(backend):
    g = _graph(backend=backend)
    model = _stochastic_model(check_consistency=True, backend=backend)
    loss = model(g, torch.randn(N, 4, dtype=torch.float64)).pow(2).sum()
    with pytest.raises(RuntimeError, match="not a deterministic function"):
        loss.backward()


def test_hidden_stochastic_dropout_gives_wrong_gradients_detected_by_parity_check(backend):
    """With the runtime check off, the gradients are silently wrong: the parity check
    measures the error and assert_gradient_parity raises."""
    g = _graph(backend=backend)
    x = torch.randn(N, 4, dtype=torch.float64)
    model = _stochastic_model(check_consistency=False, backend=backend)
    report = gradient_parity(model, lambda m: m(g, x).pow(2).sum())
    assert report.max_rel_error > 0.1, report
    with pytest.raises(GradientMismatchError, match="relative error"):
        assert_gradient_parity(model, lambda m: m(g, x).pow(2).sum())


def test_stochastic_mask_fn_is_caught(backend):
    g = _graph(backend=backend)
    model = RevGNN(4, 8, 2, num_layers=3, dropout=0.5, backend=backend).double()
    loss = model(g, torch.randn(N, 4, dtype=torch.float64),
                 mask_fn=lambda shape, ids, layer: torch.rand(shape) >= 0.5).pow(2).sum()
    with pytest.raises(RuntimeError, match="mask source that returns different masks"):
        loss.backward()


def test_deterministic_model_passes_the_parity_check(backend):
    """Positive control for the parity check."""
    g = _graph(backend=backend)
    x = torch.randn(N, 4, dtype=torch.float64)
    model = RevGNN(4, 8, 2, num_layers=3, dropout=0.5, backend=backend).double()
    report = assert_gradient_parity(model, lambda m: m(g, x).pow(2).sum(), rtol=1e-8)
    assert report.max_rel_error < 1e-8


def test_sampled_block_is_refused(backend):
    layer = LayerEdges(src_nid=torch.tensor([7, 3, 9, 1]), num_dst=2,
                       edge_src=torch.tensor([2, 3, 0]), edge_dst=torch.tensor([0, 0, 1]),
                       edge_id=torch.tensor([5, 6, 7]))
    block = get_backend(backend).make_block(layer)
    stack = GroupedReversibleStack([make_coupling(8, 2, backend=backend)])
    h = nn.Linear(8, 8)(torch.randn(4, 8))
    label = {"dgl": "DGL", "pyg": "PyG"}[backend]
    with pytest.raises(ValueError, match=f"{label} block"):
        stack(block, h)
