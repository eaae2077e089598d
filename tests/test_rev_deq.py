"""Weight-tied reversible model and the deep-equilibrium variant: training and gradients,
on each backend (the model tests run once per installed backend)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from graphs import rand_whole_graph

from betty.rev.model import RevGNN
from betty.rev.deq import RevGNNDEQ, anderson_iteration, fixed_point_iteration


def _task(n=60, seed=0, dtype=torch.float64, *, backend: str):
    """Labels that depend on the features of a node and of its neighbours."""
    torch.manual_seed(seed)
    g = rand_whole_graph(n, 3 * n, backend)
    x = torch.randn(n, 6, dtype=dtype)
    with torch.no_grad():
        src, dst = g.edges()  # mean over in-neighbours (every node has a self-loop)
        smooth = torch.zeros_like(x).index_add_(0, dst, x[src]) / torch.bincount(dst, minlength=n)[:, None]
    y = (x[:, 0] + smooth[:, 1] > 0).long() + (x[:, 2] > 0.5).long()
    return g, x, y


def _train(model, g, x, y, steps=12, lr=0.02):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(g, x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_weight_tied_reversible_trains(backend):
    g, x, y = _task(backend=backend)
    model = RevGNN(6, 8, 3, num_layers=10, weight_tied=True, dropout=0.1, backend=backend).double()
    losses = _train(model, g, x, y)
    assert losses[-1] < 0.85 * losses[0], losses


def test_weight_tied_gradcheck(backend):
    torch.manual_seed(1)
    g = rand_whole_graph(8, 16, backend)
    x = torch.randn(8, 3, dtype=torch.float64)
    model = RevGNN(3, 4, 2, num_layers=4, weight_tied=True, dropout=0.5, conv="gcn", backend=backend).double()
    mask = torch.rand(8, 4, generator=torch.Generator().manual_seed(2)) >= 0.5
    weights = torch.linspace(-1, 1, 16, dtype=torch.float64).view(8, 2)
    assert torch.autograd.gradcheck(
        lambda *params: (model(g, x, dropout_mask=mask) * weights).sum(),
        tuple(model.parameters()), eps=1e-6, atol=1e-7, rtol=1e-5,
    )


@pytest.mark.parametrize(
    "conv, solver, backward_solver",
    [("gcn", "anderson", "anderson"), ("gat", "anderson", "anderson")],
)
def test_deq_trains_and_reports_convergence(backend, conv, solver, backward_solver):
    g, x, y = _task(seed=0, backend=backend)
    model = RevGNNDEQ(
        6, 8, 3, conv=conv, dropout=0.1, tol=1e-8, max_iter=200, backward_tol=1e-8,
        backward_max_iter=200, solver=solver, backward_solver=backward_solver, backend=backend
    ).double()
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    losses = []
    for _ in range(12):
        opt.zero_grad()
        loss = F.cross_entropy(model(g, x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        assert model.last_forward_stats.converged, model.last_forward_stats
        assert model.last_forward_stats.residual < 1e-8
        assert model.last_backward_stats.converged, model.last_backward_stats
    assert losses[-1] < 0.85 * losses[0], losses


def _deq_gradcheck(model, g, x, mask):
    weights = torch.linspace(-1, 1, 2 * x.shape[0], dtype=torch.float64).view(-1, 2)
    xi = x.clone().requires_grad_()
    return torch.autograd.gradcheck(
        lambda xin, *params: (model(g, xin, dropout_mask=mask) * weights).sum(),
        (xi, *model.parameters()), eps=1e-6, atol=1e-6, rtol=1e-4, raise_exception=False,
        fast_mode=True,  # random projections of the Jacobian: seconds instead of minutes
    )


def test_deq_gradcheck_implicit_gradient(backend):
    torch.manual_seed(4)
    g = rand_whole_graph(8, 16, backend)
    x = torch.randn(8, 3, dtype=torch.float64)
    mask = torch.rand(8, 4, generator=torch.Generator().manual_seed(5)) >= 0.3
    model = RevGNNDEQ(3, 4, 2, conv="gcn", dropout=0.3, tol=1e-13, max_iter=500,
                      backward_tol=1e-13, backward_max_iter=500, backend=backend).double()
    assert _deq_gradcheck(model, g, x, mask)
    assert model.last_forward_stats.converged and model.last_backward_stats.converged


def _directional_error(model, g, x, mask, eps=1e-6):
    """|<grad L, d> - (L(theta + eps d) - L(theta - eps d)) / (2 eps)| / |...| for a
    random direction d over all parameters (central finite difference)."""
    weights = torch.linspace(-1, 1, 2 * x.shape[0], dtype=torch.float64).view(-1, 2)
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(11)
    direction = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
    model.zero_grad()
    (model(g, x, dropout_mask=mask) * weights).sum().backward()
    analytic = sum((p.grad * d).sum() for p, d in zip(params, direction)).item()
    values = []
    with torch.no_grad():
        for sign in (1, -1):
            for p, d in zip(params, direction):
                p.add_(sign * eps * d)
            values.append((model(g, x, dropout_mask=mask) * weights).sum().item())
            for p, d in zip(params, direction):
                p.sub_(sign * eps * d)
    numeric = (values[0] - values[1]) / (2 * eps)
    return abs(analytic - numeric) / abs(numeric)


def test_deq_finite_difference_needs_the_backward_solve(backend):
    """Negative control: one backward iteration (g = v, the 'Jacobian-free' shortcut) is
    not the implicit gradient, and a finite-difference check notices; with the solve
    the same check agrees to ~1e-8."""
    errors = {}
    for backward_max_iter in (1, 500):
        torch.manual_seed(4)
        g = rand_whole_graph(8, 16, backend)
        x = torch.randn(8, 3, dtype=torch.float64)
        mask = torch.rand(8, 4, generator=torch.Generator().manual_seed(5)) >= 0.3
        model = RevGNNDEQ(3, 4, 2, conv="gcn", dropout=0.3, tol=1e-13, max_iter=500,
                          backward_tol=1e-13, backward_max_iter=backward_max_iter,
                          backward_solver="picard", backend=backend).double()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            errors[backward_max_iter] = _directional_error(model, g, x, mask)
    assert errors[500] < 1e-6, errors
    assert errors[1] > 1e-3, errors


def test_deq_warns_when_a_solve_hits_its_cap(backend):
    g, x, y = _task(seed=5, backend=backend)
    model = RevGNNDEQ(6, 8, 3, max_iter=2, tol=1e-12, backend=backend).double()
    with pytest.warns(RuntimeWarning, match="forward solve stopped at max_iter=2"):
        model(g, x)
    assert model.last_forward_stats.iterations == 2 and not model.last_forward_stats.converged


def test_deq_rejects_bad_arguments(backend):
    with pytest.raises(ValueError, match="norm must be 'layer' or 'none'"):
        RevGNNDEQ(4, 8, 2, norm="batch", backend=backend)
    with pytest.raises(ValueError, match="solver must be one of"):
        RevGNNDEQ(4, 8, 2, solver="broyden", backend=backend)
    with pytest.raises(ValueError, match="max_iter must be >= 1"):
        RevGNNDEQ(4, 8, 2, max_iter=0, backend=backend)


def test_solvers_find_the_fixed_point_of_a_linear_contraction():
    torch.manual_seed(6)
    a = torch.randn(20, 20, dtype=torch.float64)
    a = 0.9 * a / torch.linalg.matrix_norm(a, 2)
    b = torch.randn(20, dtype=torch.float64)
    exact = torch.linalg.solve(torch.eye(20, dtype=torch.float64) - a, b)
    for solve in (fixed_point_iteration, anderson_iteration):
        z, stats = solve(lambda z: a @ z + b, torch.zeros(20, dtype=torch.float64), tol=1e-12, max_iter=1000)
        assert stats.converged
        torch.testing.assert_close(z, exact, rtol=1e-9, atol=1e-9)
    # Anderson is a Krylov-type solver: far fewer steps than Picard here
    _, picard = fixed_point_iteration(lambda z: a @ z + b, torch.zeros(20, dtype=torch.float64), tol=1e-12, max_iter=1000)
    _, anderson = anderson_iteration(lambda z: a @ z + b, torch.zeros(20, dtype=torch.float64), tol=1e-12, max_iter=1000)
    assert anderson.iterations < picard.iterations


def test_the_memory_model_refuses_a_deq_by_name():
    """The reversible memory model has no DEQ replay: asked for one, it says so (a
    TypeError naming the model), before reading any attribute the DEQ lacks."""
    from betty.rev.memory import RevModelShape

    with pytest.raises(TypeError, match="RevGNNDEQ has no reversible block stack"):
        RevModelShape.of(RevGNNDEQ(8, 16, 3, conv="gcn"))
