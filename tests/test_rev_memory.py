"""Training memory versus depth, measured with betty.memory.meter, and a 1001-layer run.

Setup: N = 4096 nodes, hidden 8 (C = 2 groups of width 4), float32, GCN, SGD (no
optimizer state). One (N, hidden) activation is 128 KiB while one block's parameters are
2 x (4*4 + 4 + 2*4) floats = 224 B, so activations dominate the peak even at depth 512
(parameters + gradients grow by ~0.23 MB from depth 8 to 512; the reversible peak is
~1.7 MB). The claim is about activation memory: a reversible network's peak grows only
by its parameters and gradients, a residual network keeps several activations per block.
"""

import time

import pytest

import torch
from graphs import backend_params, whole_graph

from betty.backends import backend_of_graph
from betty.memory.meter import MemoryMeter
from betty.rev.model import RevGNN
from betty.rev.engine import train_step_parts
from betty.rev.training import cluster_partition

N, HIDDEN, IN, OUT = 4096, 8, 8, 4
ACTIVATION_BYTES = N * HIDDEN * 4  # one (N, hidden) float32 tensor


@pytest.fixture(scope="module", params=backend_params())
def graph_and_features(request):
    """The same random graph (plus self-loops) as each backend's whole graph."""
    torch.manual_seed(0)
    src, dst = torch.randint(N, (4 * N,)), torch.randint(N, (4 * N,))
    g = whole_graph(src, dst, N, request.param)
    if request.param == "dgl":
        g.create_formats_()  # sparse formats built outside the measured step
    return g, torch.randn(N, IN)


def measure_step(g, x, depth, mode):
    """Peak bytes of zero_grad + forward + backward + SGD step, and parameter bytes."""
    torch.manual_seed(1)
    model = RevGNN(IN, HIDDEN, OUT, num_layers=depth, dropout=0.1,
                   reversible=mode == "reversible", checkpoint=mode == "checkpoint",
                   backend=backend_of_graph(g).name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    meter = MemoryMeter("cpu")
    meter.track(model, opt)
    with meter.measure() as reading:
        opt.zero_grad(set_to_none=True)
        loss = model(g, x).pow(2).mean()
        loss.backward()
        opt.step()
        del loss
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return reading.peak_bytes, param_bytes


def test_reversible_memory_grows_only_by_parameters(graph_and_features):
    g, x = graph_and_features
    lo, hi = 4, 16
    extra = hi - lo
    rev_lo, p_lo = measure_step(g, x, lo, "reversible")
    rev_hi, p_hi = measure_step(g, x, hi, "reversible")
    res_lo, _ = measure_step(g, x, lo, "residual")
    res_hi, _ = measure_step(g, x, hi, "residual")
    ck_lo, _ = measure_step(g, x, lo, "checkpoint")
    ck_hi, _ = measure_step(g, x, hi, "checkpoint")
    # reversible: the extra blocks cost their parameters and gradients, nothing else
    assert rev_hi - rev_lo <= 2 * (p_hi - p_lo) + 0.02 * rev_lo, (rev_lo, rev_hi, p_lo, p_hi)
    # residual: every extra block keeps several (N, hidden) activations
    assert res_hi - res_lo >= extra * 2 * ACTIVATION_BYTES, (res_lo, res_hi)
    # checkpointing keeps each block's input (one activation per block), less than residual
    assert extra * ACTIVATION_BYTES <= ck_hi - ck_lo < (res_hi - res_lo) / 2, (ck_lo, ck_hi, res_lo, res_hi)
    assert rev_lo < res_lo


@pytest.mark.slow
def test_depth_512_versus_8(graph_and_features):
    g, x = graph_and_features
    rev8, _ = measure_step(g, x, 8, "reversible")
    rev512, _ = measure_step(g, x, 512, "reversible")
    res8, _ = measure_step(g, x, 8, "residual")
    res512, _ = measure_step(g, x, 512, "residual")
    assert rev512 <= 1.3 * rev8, (rev8, rev512)
    assert res512 >= 20 * res8, (res8, res512)


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params())
def test_revgnn_deep_1001_layers_80_channels_trains_one_epoch(backend):
    """RevGNN-Deep's shape (1001 blocks x 80 channels, C = 2, dropout 0.1) on a small
    synthetic graph: one epoch = one optimizer step over K = 2 random parts."""
    torch.manual_seed(2)
    n = 600
    src, dst = torch.randint(n, (3 * n,)), torch.randint(n, (3 * n,))
    g = whole_graph(src, dst, n, backend)
    feat = torch.randn(n, 16)
    label = (feat[:, 0] > 0).long()
    train_mask = torch.rand(n) < 0.5
    model = RevGNN(16, 80, 2, num_layers=1001, num_groups=2, dropout=0.1, backend=backend)
    before = [p.detach().clone() for p in (model.stack.blocks[0].coupling.functions[0].conv.conv.weight,
                                            model.stack.blocks[-1].coupling.functions[1].conv.conv.weight)]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    parts = cluster_partition(g, 2, "random", seed=0)
    start = time.perf_counter()
    loss = train_step_parts(model, opt, parts, feat, label, train_mask, clip_grad_norm=1.0).loss
    elapsed = time.perf_counter() - start
    print(f"1001-layer x 80-channel epoch (2 parts of {n // 2} nodes): {elapsed:.1f} s, loss {loss:.4f}")
    assert torch.isfinite(torch.tensor(loss))
    after = (model.stack.blocks[0].coupling.functions[0].conv.conv.weight,
             model.stack.blocks[-1].coupling.functions[1].conv.conv.weight)
    assert all(not torch.equal(a, b) for a, b in zip(before, after))  # first and last blocks learned
