"""Reversible gradients equal residual (and checkpointed residual) gradients, same weights,
on each backend (every test runs once per installed backend)."""

import pytest
import torch
from graphs import rand_whole_graph

from betty.rev.model import RevGNN
from betty.rev.check import assert_gradient_parity, gradient_parity


N, IN, OUT = 40, 6, 3


def _data(seed: int, backend: str):
    torch.manual_seed(seed)
    g = rand_whole_graph(N, 160, backend)
    x = torch.randn(N, IN, dtype=torch.float64)
    y = torch.randint(0, OUT, (N,))
    return g, x, y


def _grads(model, g, x, y, mask):
    model.zero_grad(set_to_none=True)
    out = model(g, x, dropout_mask=mask)
    torch.nn.functional.cross_entropy(out, y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_fixed_mask_parity(model, g, x, y, *, mask_seed: int, p: float = 0.2) -> None:
    """Reversible and residual gradients of the cross-entropy agree (relative 1e-8) under
    one given ``(N, 8)`` keep-mask (drawn from its own seeded generator)."""
    mask = torch.rand(N, 8, generator=torch.Generator().manual_seed(mask_seed)) >= p
    report = assert_gradient_parity(
        model, lambda m: torch.nn.functional.cross_entropy(m(g, x, dropout_mask=mask), y), rtol=1e-8)
    assert report.max_rel_error < 1e-8


def _max_rel(a, b):
    return max(((a[n] - b[n]).norm() / b[n].norm()).item() for n in b)


@pytest.mark.parametrize("conv", ["gcn", "sage", "gat"])
@pytest.mark.parametrize("groups", [2, 3])
def test_reversible_equals_residual_and_checkpoint(backend, conv, groups):
    g, x, y = _data(0, backend)
    model = RevGNN(IN, 12, OUT, num_layers=6, num_groups=groups, conv=conv, dropout=0.3, heads=2, backend=backend).double()
    model.train()
    mask = torch.rand(N, 12) >= 0.3  # bool keep-mask, scaled by 1/(1-p) by the model
    rev = _grads(model, g, x, y, mask)
    model.set_mode(reversible=False)
    res = _grads(model, g, x, y, mask)
    model.set_mode(reversible=False, checkpoint=True)
    ckpt = _grads(model, g, x, y, mask)
    assert _max_rel(rev, res) < 1e-8
    assert _max_rel(ckpt, res) < 1e-12
    # the mask is really applied: another mask gives other gradients
    model.set_mode(reversible=True)
    other = _grads(model, g, x, y, torch.ones(N, 12, dtype=torch.bool))
    assert _max_rel(other, res) > 1e-3


def test_gat_concat_heads_parity(backend):
    g, x, y = _data(1, backend)
    model = RevGNN(IN, 16, OUT, num_layers=4, conv="gat", heads=4, gat_merge="concat", dropout=0.2, backend=backend).double()
    _assert_fixed_mask_parity(model, g, x, y, mask_seed=3)


def test_default_shared_mask_parity_under_same_seed(backend):
    """Model-sampled shared mask: same RNG state -> same mask in both runs."""
    g, x, y = _data(2, backend)
    model = RevGNN(IN, 8, OUT, num_layers=5, conv="sage", dropout=0.5, backend=backend).double()
    report = gradient_parity(model, lambda m: torch.nn.functional.cross_entropy(m(g, x), y))
    assert report.max_rel_error < 1e-8


def test_parity_check_restores_the_mode_it_found(backend):
    """A residual network with checkpointing stays checkpointed after the check (its
    memory depends on it)."""
    g, x, y = _data(2, backend)
    model = RevGNN(IN, 8, OUT, num_layers=3, conv="sage", backend=backend).double()
    model.set_mode(reversible=False, checkpoint=True)
    gradient_parity(model, lambda m: torch.nn.functional.cross_entropy(m(g, x), y))
    assert (model.reversible, model.checkpoint) == (False, True)


def test_deterministic_mask_fn_is_called_per_layer_and_matches(backend):
    g, x, y = _data(3, backend)
    calls = []

    def mask_fn(shape, node_ids, layer):
        calls.append(layer)
        gen = torch.Generator().manual_seed(1000 + layer)  # keyed by layer: deterministic
        return torch.rand(shape, generator=gen) >= 0.25

    model = RevGNN(IN, 8, OUT, num_layers=4, dropout=0.25, mask_fn=mask_fn, backend=backend).double()
    report = gradient_parity(model, lambda m: torch.nn.functional.cross_entropy(m(g, x), y))
    assert report.max_rel_error < 1e-8
    # reversible run: forward 0..3 + head 4, then twice per block in backward
    # (reconstruction, recomputation: regenerated, not stored); residual: 0..3 + head 4
    assert [calls.count(layer) for layer in range(5)] == [4, 4, 4, 4, 2]


def test_weight_tied_parity_and_shared_parameters(backend):
    g, x, y = _data(4, backend)
    model = RevGNN(IN, 8, OUT, num_layers=7, weight_tied=True, dropout=0.2, backend=backend).double()
    assert len(model.stack.blocks) == 1
    _assert_fixed_mask_parity(model, g, x, y, mask_seed=5)


def test_input_gradient_through_reversible_stack(backend):
    """dL/dx (through encoder and blocks) matches the residual network."""
    g, x, y = _data(5, backend)
    model = RevGNN(IN, 8, OUT, num_layers=5, backend=backend).double()
    grads = []
    for reversible in (True, False):
        model.set_mode(reversible=reversible)
        xi = x.clone().requires_grad_()
        torch.nn.functional.cross_entropy(model(g, xi), y).backward()
        grads.append(xi.grad)
    assert ((grads[0] - grads[1]).norm() / grads[1].norm()).item() < 1e-10


def test_second_backward_with_retain_graph(backend):
    """The last block keeps its output, so a retained graph can be differentiated twice."""
    g, x, y = _data(6, backend)
    model = RevGNN(IN, 8, OUT, num_layers=4, backend=backend).double()
    loss = torch.nn.functional.cross_entropy(model(g, x), y)
    loss.backward(retain_graph=True)
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * first[n], rtol=1e-10, atol=1e-12)


def test_gradcheck_reversible_model_parameters(backend):
    """Finite differences agree with the reversible backward (float64, tiny graph)."""
    torch.manual_seed(7)
    g = rand_whole_graph(8, 16, backend)
    x = torch.randn(8, 3, dtype=torch.float64)
    model = RevGNN(3, 4, 2, num_layers=3, dropout=0.5, conv="sage", backend=backend).double()
    mask = torch.rand(8, 4, generator=torch.Generator().manual_seed(1)) >= 0.5
    weights = torch.linspace(-1, 1, 16, dtype=torch.float64).view(8, 2)

    def loss(*params):  # the parameters themselves are gradcheck's inputs (perturbed in place)
        return (model(g, x, dropout_mask=mask) * weights).sum()

    # (torch.func.functional_call cannot be used: the reversible backward recomputes the
    # blocks with the module's parameters after functional_call has restored them)
    assert torch.autograd.gradcheck(loss, tuple(model.parameters()), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_batchnorm_gradients_exact_but_running_stats_updated_three_times(backend):
    """Training-mode BatchNorm normalises with batch statistics, a deterministic function
    of the input, so reversible gradients stay exact; its running statistics are updated
    in the forward pass, the reconstruction and the recomputation (3x per step)."""
    g, x, y = _data(8, backend)
    with pytest.warns(RuntimeWarning, match="three times"):
        model = RevGNN(IN, 8, OUT, num_layers=3, norm="batch", backend=backend).double()
    bn = model.stack.blocks[0].coupling.functions[0].norm
    counts = []
    for reversible in (True, False):
        model.set_mode(reversible=reversible)
        before = int(bn.num_batches_tracked)
        torch.nn.functional.cross_entropy(model(g, x), y).backward()
        counts.append(int(bn.num_batches_tracked) - before)
    assert counts == [3, 1]
    report = gradient_parity(model, lambda m: torch.nn.functional.cross_entropy(m(g, x), y))
    assert report.max_rel_error < 1e-8
