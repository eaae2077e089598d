"""Misuse of reversible blocks must fail loudly, never corrupt silently."""

import pytest

pytestmark = pytest.mark.dgl  # RevGNN's layers are DGL's
pytest.importorskip("dgl")
import dgl  # noqa: E402

import torch
import torch.nn.functional as F
from torch import nn

from betty.models.rev import GroupedReversibleStack, RevGNN, make_coupling
from betty.models.rev_check import GradientMismatchError, assert_gradient_parity, gradient_parity
from betty.models.rev_coupling import GroupFunction, ReversibleCoupling


def _rand_graph(n: int, e: int) -> dgl.DGLGraph:
    """Random graph from torch's RNG (``dgl.rand_graph`` uses DGL's own RNG) plus self-loops."""
    src, dst = torch.randint(n, (e,)), torch.randint(n, (e,))
    return dgl.add_self_loop(dgl.graph((src, dst), num_nodes=n))


N = 30


def _graph(seed=0):
    torch.manual_seed(seed)
    return _rand_graph(N, 90)


class FunctionalDropoutF(nn.Module):
    """A group function that hides a stochastic F.dropout (invisible to module scans)."""

    def __init__(self, width):
        super().__init__()
        self.inner = GroupFunction(width)

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


def _stochastic_model(check_consistency):
    torch.manual_seed(0)
    couplings = [ReversibleCoupling([FunctionalDropoutF(4), FunctionalDropoutF(4)]) for _ in range(3)]
    return _Wrapper(GroupedReversibleStack(couplings, check_consistency=check_consistency)).double()


def test_leaf_input_to_first_block_raises():
    g = _graph()
    stack = GroupedReversibleStack([make_coupling(8, 2) for _ in range(3)])
    features = torch.randn(N, 8, requires_grad=True)
    kept = features.detach().clone()
    with pytest.raises(ValueError, match="is a leaf tensor"):
        stack(g, features)
    assert torch.equal(features.detach(), kept)  # nothing was freed or changed
    with pytest.raises(ValueError, match="requires_grad=False"):
        stack(g, torch.randn(N, 8))


def test_relu_output_as_first_input_raises():
    g = _graph()
    stack = GroupedReversibleStack([make_coupling(8, 2) for _ in range(2)])
    enc = nn.Linear(8, 8)
    with pytest.raises(ValueError, match="saved by its producer ReluBackward0"):
        stack(g, torch.relu(enc(torch.randn(N, 8))))
    with pytest.raises(ValueError, match="saved by its producer SigmoidBackward0"):
        stack(g, torch.sigmoid(enc(torch.randn(N, 8))))


def test_view_as_first_input_raises():
    g = _graph()
    stack = GroupedReversibleStack([make_coupling(8, 2) for _ in range(2)])
    h = nn.Linear(8, 16)(torch.randn(N, 8))
    with pytest.raises(ValueError, match="is a view"):
        stack(g, h[:, :8])


def test_encoder_output_is_accepted_and_freed_until_backward():
    g = _graph()
    stack = GroupedReversibleStack([make_coupling(8, 2) for _ in range(2)])
    h = nn.Linear(8, 8)(torch.randn(N, 8))
    expected = h.detach().clone()
    out = stack(g, h)
    assert h.untyped_storage().nbytes() == 0  # freed during forward
    out.sum().backward()
    assert h.untyped_storage().nbytes() == h.numel() * h.element_size()  # restored
    torch.testing.assert_close(h.detach(), expected, rtol=1e-5, atol=1e-5)


def test_reversible_output_feeds_only_one_block():
    g = _graph()
    block = GroupedReversibleStack([make_coupling(8, 2)]).blocks[0]
    h = nn.Linear(8, 8)(torch.randn(N, 8))
    y = block(g, h)
    block(g, y)
    with pytest.raises(ValueError, match="already consumed"):
        block(g, y)


def test_output_modified_in_place_raises_in_backward():
    g = _graph()
    stack = GroupedReversibleStack([make_coupling(8, 2) for _ in range(2)])
    out = stack(g, nn.Linear(8, 8)(torch.randn(N, 8)))
    loss = (out * 2).sum()
    out.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        loss.backward()


def test_nn_dropout_injected_after_construction_is_refused_in_forward():
    g = _graph()
    model = RevGNN(4, 8, 2, num_layers=3)
    model.stack.blocks[1].coupling.functions[0].norm = nn.Sequential(nn.LayerNorm(4), nn.Dropout(0.5))
    with pytest.raises(ValueError, match="nn.Dropout"):
        model(g, torch.randn(N, 4))
    model.eval()  # evaluation: dropout is the identity, nothing to refuse
    with torch.no_grad():
        assert model(g, torch.randn(N, 4)).shape == (N, 2)


def test_hidden_stochastic_dropout_fails_the_backward_consistency_check():
    g = _graph()
    model = _stochastic_model(check_consistency=True)
    loss = model(g, torch.randn(N, 4, dtype=torch.float64)).pow(2).sum()
    with pytest.raises(RuntimeError, match="not a deterministic function"):
        loss.backward()


def test_hidden_stochastic_dropout_gives_wrong_gradients_detected_by_parity_check():
    """With the runtime check off, the gradients are silently wrong: the parity check
    measures the error and assert_gradient_parity raises."""
    g = _graph()
    x = torch.randn(N, 4, dtype=torch.float64)
    model = _stochastic_model(check_consistency=False)
    report = gradient_parity(model, lambda m: m(g, x).pow(2).sum())
    assert report.max_rel_error > 0.1, report
    with pytest.raises(GradientMismatchError, match="relative error"):
        assert_gradient_parity(model, lambda m: m(g, x).pow(2).sum())


def test_stochastic_mask_fn_is_caught():
    g = _graph()
    model = RevGNN(4, 8, 2, num_layers=3, dropout=0.5).double()
    loss = model(g, torch.randn(N, 4, dtype=torch.float64),
                 mask_fn=lambda shape, ids, layer: torch.rand(shape) >= 0.5).pow(2).sum()
    with pytest.raises(RuntimeError, match="mask source that returns different masks"):
        loss.backward()


def test_deterministic_model_passes_the_parity_check():
    """Positive control for the parity check."""
    g = _graph()
    x = torch.randn(N, 4, dtype=torch.float64)
    model = RevGNN(4, 8, 2, num_layers=3, dropout=0.5).double()
    report = assert_gradient_parity(model, lambda m: m(g, x).pow(2).sum(), rtol=1e-8)
    assert report.max_rel_error < 1e-8


def test_sampled_dgl_block_is_refused():
    g = _graph()
    block = dgl.to_block(g, dst_nodes=torch.arange(10))
    stack = GroupedReversibleStack([make_coupling(8, 2)])
    h = nn.Linear(8, 8)(torch.randn(block.num_src_nodes(), 8))
    with pytest.raises(ValueError, match="DGL block"):
        stack(block, h)
