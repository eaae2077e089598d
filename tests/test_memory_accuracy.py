"""The analytic memory model against the meter, micro-batch by micro-batch.

For every model (GraphSAGE mean / gcn / pool / lstm, GAT, GAT with one output head,
the symmetric GCN) and depth 1-3, three
(graph size, hidden width) pairs cover three graph sizes and hidden 16-256 (with
features of width 40, so layer 0 runs both with and without DGL's lin_before_mp).
Each configuration trains K = 1 and K = 4 with the meter tracking model and optimizer
(one optimizer step first, so Adam's state exists) and compares every micro-batch's
measured peak with :func:`betty.memory.estimate_micro_batches` (micro-batch 0 starts without
gradients, as in train_step), on each backend (``model.backend``: DGL, and PyTorch
Geometric 2.8 whose ops the replay follows where they differ: gathered messages and
scatters, the PyG LSTM's buckets, PyG's softmax). The replay leaves out only the loss's
0-d tensors, so the estimate must be 0 to :data:`RESIDUAL_BYTES` (8) bytes under the
meter, never over. Over this grid (and K = 16, and the activation grid below) every
micro-batch is 0 to 8 bytes under, on torch 2.2.1 (DGL and PyG) and torch 2.13 (PyG),
2026-12-06; the largest relative errors per model are 0.006% to 0.032%.

Leaving one buffer kind out of the replay must break the check: on DGL without the
``fc_self`` activations the worst sage-mean error becomes 4.2% (L=2 n=300 h=16 K=4),
without the labels 2.1% (L=1 n=1500 h=256 K=1); on PyG without the
labels 1.9%, without the gathered messages 13% (sage-mean L=2 n=300 h=16 K=4), without
GAT's saved ``z[src]`` 16% (L=1 n=300 h=16 K=4), without the LSTM's mailbox indices
0.11% (L=3 n=300 h=16 K=4), each far beyond 8 bytes;
:func:`test_omitted_buffer_fails_the_check` asserts that.

The activation between layers changes what autograd keeps (ReLU its output; ELU, leaky
ReLU and GELU their input): :func:`test_estimate_follows_the_activation` holds every one
on sage-mean and GAT to the same check (L = 2, 3; with and without dropout).

Then ``k: auto`` with a budget of half the measured K = 1 peak: the search only
estimates (the model's parameters and gradients are untouched), and training with the K
it picks keeps every micro-batch's measured peak within the budget.
"""

from __future__ import annotations

import pytest
import torch

from betty.memory import MemoryMeter, estimate_micro_batches, search_k
from betty.models import ACTIVATIONS, build_model
from betty.partition import partition_batch
from betty.sampling import sample_full_batch
from betty.train import accumulate_gradients, build_optimizer, train_step
from graphs import power_law_graph

RESIDUAL_BYTES = 8
"""How far the estimate may be under the meter: the loss's two 0-d float32 tensors, which
the replay leaves out."""
TOLERANCE = {
    "dgl": {"sage-mean": 0.0015, "sage-gcn": 0.002, "sage-pool": 0.0005, "sage-lstm": 0.0001,
            "gat": 0.0025, "gat-1head": 0.0017, "gcn": 0.0007},
    "pyg": {"sage-mean": 0.0004, "sage-gcn": 0.0004, "sage-pool": 0.0001, "sage-lstm": 0.0001,
            "gat": 0.00025, "gat-1head": 0.0003, "gcn": 0.00025},
}
"""Relative tolerances per backend and model, for the checks of other steps that reuse this
grid's models (copy-ahead, mixed precision); this file's own check is :data:`RESIDUAL_BYTES`."""
BACKENDS = [pytest.param("dgl", marks=pytest.mark.dgl), pytest.param("pyg", marks=pytest.mark.pyg)]
FEATS, CLASSES = 40, 5
FANOUTS = [4, 6, 8]
# (graph nodes, hidden): three graph sizes, hidden 16..256
SIZES = [(300, 16), (800, 64), (1500, 256)]
# ("gat", "1head"): GAT with output_heads=1
MODELS = [("sage", "mean"), ("sage", "gcn"), ("sage", "pool"), ("sage", "lstm"), ("gat", "mean"),
          ("gat", "1head"), ("gcn", "mean")]
MODEL_IDS = [f"{a}-{g}" if (a, g) == ("gat", "1head") else a if a in ("gat", "gcn") else f"sage-{g}"
             for a, g in MODELS]

_GRAPHS: dict[int, tuple] = {}


def _graph(n: int):
    if n not in _GRAPHS:
        _GRAPHS[n] = power_law_graph(num_nodes=n, avg_degree=8, num_feats=FEATS,
                                     num_classes=CLASSES, seed=n)
    return _GRAPHS[n]


def _setup(arch, agg, layers, n, hidden, backend="dgl", activation=None):
    if backend == "pyg":
        pytest.importorskip("torch_geometric")
    g, feat, label, train = _graph(n)
    batch = sample_full_batch(g, train, FANOUTS[:layers], seed=1)
    torch.manual_seed(0)
    # cover hash dropout (and GAT attention dropout); not on the smallest graph, whose K=1
    # peak is too close to the dropout's fixed chunk buffers (~288 KiB per call) for half
    # of it to be reachable (test_memory_ksearch checks that case raises KSearchError)
    dropout = 0.5 if layers == 2 and n >= 800 else 0.0
    model = build_model(arch, FEATS, CLASSES, hidden=hidden, layers=layers,
                        aggregator=agg if arch == "sage" else "mean", heads=2,
                        output_heads=1 if agg == "1head" else None, dropout=dropout,
                        attn_dropout=dropout / 2, backend=backend, activation=activation).train()
    assert model.backend_name == backend
    opt = build_optimizer("adam", model.parameters(), 1e-3)
    ones = torch.zeros(batch.num_outputs, dtype=torch.int64)
    train_step(model, opt, batch, ones, feat, label, dropout_key=7)  # Adam state exists
    meter = MemoryMeter("cpu")
    meter.track(model, opt)
    return batch, feat, label, model, opt, meter


def _measure(model, opt, meter, batch, groups, k, feat, label):
    opt.zero_grad(set_to_none=True)  # what train_step does before accumulating
    result = accumulate_gradients(model, batch, groups, feat, label, k=k, meter=meter,
                                  dropout_key=11)
    return [m.peak_bytes for m in result.micro]


def _failures(model, opt, meter, batch, feat, label, k: int, where: str):
    """``(measured peaks, messages of the micro-batches whose estimate is over the meter
    or more than :data:`RESIDUAL_BYTES` under it)`` for a K-way random split."""
    groups = partition_batch(batch, k, "random", seed=3).groups
    measured = _measure(model, opt, meter, batch, groups, k, feat, label)
    estimated = [e.peak for e in estimate_micro_batches(batch, groups, k, model, opt)]
    bad = []
    for i, (est, meas) in enumerate(zip(estimated, measured)):
        if not 0 <= meas - est <= RESIDUAL_BYTES:
            bad.append(f"{where} K={k} micro-batch {i}: estimated {est}, measured {meas}, "
                       f"error {(est - meas) / meas:+.3%}")
    return measured, bad


@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("arch,agg", MODELS, ids=MODEL_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_estimate_matches_meter_and_auto_k_fits(backend, arch, agg, layers):
    for n, hidden in SIZES:
        batch, feat, label, model, opt, meter = _setup(arch, agg, layers, n, hidden, backend)
        k1_peak = None
        for k in (1, 4):
            measured, bad = _failures(model, opt, meter, batch, feat, label, k, f"n={n} hidden={hidden}")
            assert not bad, bad
            if k == 1:
                k1_peak = measured[0]

        budget = k1_peak // 2
        before = [p.detach().clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        found = search_k(batch, model, opt, memory_budget=budget, safety_margin=0.05,
                         method="random", seed=5)
        assert all(p.grad is None for p in model.parameters()), "the search must not train"
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert found.k > 1 and found.tried[0][0] == 1
        assert found.max_peak <= budget * 0.95
        measured = _measure(model, opt, meter, batch, found.partition.groups, found.k, feat, label)
        assert max(measured) <= budget, (
            f"n={n} hidden={hidden}: K={found.k} measured {max(measured)} > budget {budget}")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("arch,agg", [("sage", "mean"), ("gat", "mean")], ids=["sage-mean", "gat"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_estimate_follows_the_activation(backend, arch, agg, activation):
    """Every activation between layers, on the two models it changes most (relu saves its
    output, elu/leaky_relu/gelu their input): the replay stays within
    :data:`RESIDUAL_BYTES` of the meter at depth 2 and 3, with and without dropout."""
    for layers, (n, hidden) in [(2, SIZES[0]), (2, SIZES[1]), (3, SIZES[0])]:
        batch, feat, label, model, opt, meter = _setup(arch, agg, layers, n, hidden, backend, activation)
        assert model.activation_name == activation
        for k in (1, 4):
            _, bad = _failures(model, opt, meter, batch, feat, label, k,
                               f"{activation} L={layers} n={n} hidden={hidden}")
            assert not bad, bad


def test_replay_activation_lists_match_the_models():
    from betty.memory import spec as memory_spec
    from betty.models import DEFAULT_ACTIVATION
    from betty.models.base import SAVES_RESULT

    assert memory_spec.ACTIVATIONS == ACTIVATIONS and memory_spec.SAVES_RESULT == SAVES_RESULT
    assert memory_spec.DEFAULT_ACTIVATION == DEFAULT_ACTIVATION


def _fc_self(comp, name):
    return comp == "activations" and name.endswith("fc_self")


# (backend, what is left out, which allocations, model, layers, graph nodes, hidden, K)
OMISSIONS = [
    ("dgl", "fc_self activations", _fc_self, ("sage", "mean"), 2, 300, 16, 4),
    ("dgl", "labels", lambda comp, name: name == "labels", ("sage", "mean"), 1, 1500, 256, 1),
    ("pyg", "labels", lambda comp, name: name == "labels", ("sage", "mean"), 1, 1500, 256, 1),
    # PyG only: the (E, W) gathered messages of scatter and their gradients
    ("pyg", "gathered messages", lambda comp, name: name.endswith(("messages", "(gather)")),
     ("sage", "mean"), 2, 300, 16, 4),
    # PyG only: GAT's gathered z[src], saved for the attention's gradient
    ("pyg", "GAT z[src]", lambda comp, name: name.endswith("z[src]"), ("gat", "mean"), 1, 300, 16, 4),
    # PyG only: the per-bucket LSTM mailbox indices, kept for the gather's backward
    ("pyg", "LSTM mailbox indices", lambda comp, name: "mailbox index" in name,
     ("sage", "lstm"), 3, 300, 16, 4),
    # the GCN's carried source out-degrees; its normalised sources h * src_norm, which the
    # forward's local keeps until the layer returns
    ("dgl", "GCN source out-degrees", lambda comp, name: name.endswith("source out-degrees"),
     ("gcn", "mean"), 2, 300, 16, 4),
    ("pyg", "GCN normalised sources", lambda comp, name: name.endswith("h * src_norm"),
     ("gcn", "mean"), 2, 300, 16, 4),

]


@pytest.mark.parametrize(
    "backend,what,omit,model,layers,n,hidden,k",
    [pytest.param(*o, marks=getattr(pytest.mark, o[0])) for o in OMISSIONS],
    ids=[f"{o[0]}-{o[1]}" for o in OMISSIONS])
def test_omitted_buffer_fails_the_check(monkeypatch, backend, what, omit, model, layers, n, hidden, k):
    """The check is tight enough to see a missing buffer kind: the same
    configuration passes with the full replay and fails when the replay allocates 0
    bytes for ``what``."""
    from betty.memory.timeline import Timeline

    batch, feat, label, net, opt, meter = _setup(*model, layers, n, hidden, backend)
    _, bad = _failures(net, opt, meter, batch, feat, label, k, "full replay")
    assert not bad, bad

    alloc = Timeline.alloc
    left_out = []

    def alloc_without(self, nbytes, component, name):
        if omit(component, name):
            left_out.append(name)
            nbytes = 0
        return alloc(self, nbytes, component, name)

    monkeypatch.setattr(Timeline, "alloc", alloc_without)
    _, bad = _failures(net, opt, meter, batch, feat, label, k, f"without {what}")
    assert left_out, f"the replay allocated no {what}: the omission tests nothing"
    assert bad, f"leaving the {what} out of the replay still passes the {RESIDUAL_BYTES}-byte check"


@pytest.mark.parametrize("backend", BACKENDS)
def test_lstm_micro_batches_without_some_degree_bucket(backend):
    """K = 16 micro-batches of one batch hold different in-degree buckets: a micro-batch runs LSTM
    calls, and sums their weight and input gradients, only for the degrees it has (the
    replay must not charge it for the others)."""
    from betty.memory.sizes import split_sizes

    batch, feat, label, model, opt, meter = _setup("sage", "lstm", 2, 300, 64, backend)
    k = 16
    groups = partition_batch(batch, k, "random", seed=3).groups
    counts = split_sizes(batch, groups, k).degree_counts  # per layer (micro-batches, degrees)
    assert any(((c == 0) & (c.sum(0) > 0)).any() for c in counts), "tests nothing"
    _, bad = _failures(model, opt, meter, batch, feat, label, k, "L=2 n=300 h=64")
    assert not bad, bad


@pytest.mark.parametrize("backend", BACKENDS)
def test_lstm_float64_estimate_matches_meter(backend):
    """SAGE-LSTM in float64 (``precision="64"``) on the host: torch has no oneDNN LSTM for
    float64 and runs its native per-step LSTM (gates, cell and hidden state per step),
    which the replay follows op by op; every micro-batch's estimate is within
    :data:`TOLERANCE` of the meter (with the constants fitted to oneDNN's float32
    workspace, 1.7-2.9x over it, torch 2.2.1 and 2.13, 2026-12-06)."""
    tol = TOLERANCE[backend]["sage-lstm"]
    bad = []
    for layers, (n, hidden) in [(1, SIZES[0]), (2, SIZES[0]), (2, SIZES[1])]:
        if backend == "pyg":
            pytest.importorskip("torch_geometric")
        g, feat, label, train = _graph(n)
        feat = feat.double()
        batch = sample_full_batch(g, train, FANOUTS[:layers], seed=1)
        torch.manual_seed(0)
        model = build_model("sage", FEATS, CLASSES, hidden=hidden, layers=layers, aggregator="lstm",
                            backend=backend).double().train()
        opt = build_optimizer("adam", model.parameters(), 1e-3)
        ones = torch.zeros(batch.num_outputs, dtype=torch.int64)
        train_step(model, opt, batch, ones, feat, label, dropout_key=7, precision="64",
                   dtype=torch.float64)  # Adam state exists
        meter = MemoryMeter("cpu")
        meter.track(model, opt)
        for k in (1, 4):
            groups = partition_batch(batch, k, "random", seed=3).groups
            opt.zero_grad(set_to_none=True)
            res = accumulate_gradients(model, batch, groups, feat, label, k=k, meter=meter,
                                       dropout_key=11, precision="64", dtype=torch.float64)
            ests = estimate_micro_batches(batch, groups, k, model, opt, precision="64",
                                          dtype=torch.float64)
            for i, (e, m) in enumerate(zip(ests, res.micro)):
                err = abs(e.peak - m.peak_bytes) / m.peak_bytes
                if err > tol:
                    bad.append(f"L={layers} n={n} h={hidden} K={k} micro-batch {i}: estimated "
                               f"{e.peak}, measured {m.peak_bytes} ({err:+.3%})")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_micro_batches_without_edges(backend, precision):
    """The outputs without in-edges in micro-batches of their own, whose blocks have no
    edges in any layer: there DGL runs betty's ``EdgelessPoolSAGEConv`` (``fc_self``
    beside ``fc_neigh`` of zeros; no ``fc_pool``, max or their gradients), and
    ``fc_pool``'s ``.grad`` does not exist until a micro-batch with edges creates it;
    PyG's pool runs as on any block. With those micro-batches first (two of them, the
    first one after ``zero_grad``) and last of K = 4, every micro-batch's estimate is
    within :data:`RESIDUAL_BYTES` of the meter."""
    from betty.memory.sizes import split_sizes

    k = 4
    bad = []
    for layers, (n, hidden) in [(1, SIZES[0]), (2, SIZES[0]), (3, SIZES[1])]:
        batch, feat, label, model, opt, meter = _setup("sage", "pool", layers, n, hidden, backend)
        isolated = batch.layers[-1].in_degrees() == 0
        rest = torch.arange(batch.num_outputs)
        arrangements = {"first": torch.where(isolated, rest % 2, 2 + rest % 2),
                        "last": torch.where(isolated, k - 1, rest % (k - 1))}
        for where, groups in arrangements.items():
            edgeless = 0 if where == "first" else k - 1
            sizes = split_sizes(batch, groups, k)
            assert all(e[edgeless] == 0 for e in sizes.num_edges), "tests nothing"
            opt.zero_grad(set_to_none=True)
            res = accumulate_gradients(model, batch, groups, feat, label, k=k, meter=meter,
                                       dropout_key=11, precision=precision)
            ests = estimate_micro_batches(batch, groups, k, model, opt, precision=precision)
            for i, (est, m) in enumerate(zip(ests, res.micro)):
                if not 0 <= m.peak_bytes - est.peak <= RESIDUAL_BYTES:
                    bad.append(f"L={layers} n={n} h={hidden} edgeless {where}, micro-batch {i}: "
                               f"estimated {est.peak}, measured {m.peak_bytes}, error "
                               f"{(est.peak - m.peak_bytes) / m.peak_bytes:+.3%}")
    assert not bad, "\n".join(bad)
