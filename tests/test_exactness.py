"""K-way gradient accumulation equals the full-batch gradient, for every model, on both
backends (DGL and PyG: the same test, parametrized; the PyG half runs in ``.venv-pyg``).

The full batch is sampled once. The reference is :func:`betty.reference.full_batch_reference`:
the model run on the sampler's own blocks (no partitioning, no carving), with the same
node-keyed dropout, canonical neighbour order and its own loss normalisation. K-way
accumulation for K = 1, 2, 3, 7 (range, random and reg splits; every method at K = 3) must agree with it to
1e-10 relative in float64, 1e-5 in float32, zero-in-degree outputs included.
"""

from __future__ import annotations

import pytest
import torch

from betty.models import build_model
from betty.models.dropout import dropout_key
from betty.partition import partition_batch
from betty.reference import full_batch_reference
from betty.sampling import sample_full_batch
from betty.train import accumulate_gradients, gradients, max_relative_difference, train_step, build_optimizer
from graphs import power_law_graph

# (arch, aggregator or variant): "1head" is GAT with output_heads=1
MODELS = [("sage", "mean"), ("sage", "gcn"), ("sage", "pool"), ("sage", "lstm"), ("gat", None),
          ("gat", "1head"), ("gcn", None)]
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
FANOUTS = {2: [5, 8], 3: [4, 6, 8]}
BACKENDS = [pytest.param("dgl", marks=pytest.mark.dgl), pytest.param("pyg", marks=pytest.mark.pyg)]


@pytest.fixture(scope="module")
def graph_data():
    g, feat, label, train = power_law_graph(num_nodes=600, avg_degree=8, seed=0)
    assert int((g.in_degrees()[train] == 0).sum()) > 0, "test needs zero-in-degree outputs"
    assert int(g.in_degrees().max()) > 10 * float(g.in_degrees().float().mean())
    return g, feat, label, train


def _make_model(arch, agg, layers, dropout, dtype, dropout_mode="deterministic", backend="auto"):
    torch.manual_seed(0)
    model = build_model(arch, 12, 5, hidden=16, layers=layers,
                        aggregator=agg if arch == "sage" else "mean", heads=2,
                        output_heads=1 if agg == "1head" else None, dropout=dropout,
                        attn_dropout=dropout / 2, dropout_mode=dropout_mode, backend=backend)
    assert backend == "auto" or model.backend_name == backend
    return model.to(dtype).train()


def _grads(model, batch, feat, label, k, method, dtype, key=dropout_key(0, 1)):
    model.zero_grad(set_to_none=True)
    groups = partition_batch(batch, k, method, seed=3).groups
    result = accumulate_gradients(model, batch, groups, feat, label, k=k, dropout_key=key, dtype=dtype)
    assert result.k == k
    return result.loss, gradients(model)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("dropout", [0.0, 0.5], ids=["nodrop", "drop"])
@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("arch,agg", MODELS, ids=[f"{a}-{g}" if g else a for a, g in MODELS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_k_way_gradient_equals_full_batch(graph_data, backend, arch, agg, layers, dropout, dtype):
    pytest.importorskip("dgl" if backend == "dgl" else "torch_geometric")
    g, feat, label, train = graph_data
    batch = sample_full_batch(g, train, FANOUTS[layers], seed=0)
    assert int((batch.layers[-1].in_degrees() == 0).sum()) > 0, "needs zero-in-degree outputs"
    model = _make_model(arch, agg, layers, dropout, dtype, backend=backend)
    ref = full_batch_reference(model, batch, feat, label, dropout_key=dropout_key(0, 1), dtype=dtype)
    zero = [name for name, v in ref.grads.items() if float(v.abs().sum()) == 0]
    assert not zero, f"parameters without gradient: {zero}"
    for method in ("range", "random", "reg"):
        for k in (1, 2, 3, 7):
            loss_k, grad_k = _grads(model, batch, feat, label, k, method, dtype)
            err = max_relative_difference(grad_k, ref.grads)
            assert err < TOL[dtype], f"{method} K={k}: relative gradient error {err:.3e}"
            assert loss_k == pytest.approx(ref.loss, rel=TOL[dtype], abs=0)


def test_standard_dropout_is_not_exact(graph_data):
    """Negative control: per-call dropout masks break K-way equality, so the exactness
    test above is able to fail."""
    g, feat, label, train = graph_data
    batch = sample_full_batch(g, train, FANOUTS[2], seed=0)
    model = _make_model("sage", "mean", 2, 0.5, torch.float64, dropout_mode="standard")
    ref = full_batch_reference(model, batch, feat, label, dropout_key=dropout_key(0, 1),
                               dtype=torch.float64)
    _, grad_4 = _grads(model, batch, feat, label, 4, "random", torch.float64)
    assert max_relative_difference(grad_4, ref.grads) > 1e-2


def test_reference_asserts_canonical_order(graph_data):
    """The reference refuses a batch whose neighbours are not in canonical order."""
    import dataclasses

    g, feat, label, train = graph_data
    batch = sample_full_batch(g, train, FANOUTS[2], seed=0)
    layer = batch.layers[1]
    # reverse the neighbour list of the first destination with two or more in-edges
    dst = int(torch.nonzero(layer.in_degrees() >= 2)[0])
    idx = torch.nonzero(layer.edge_dst == dst).flatten()
    perm = torch.arange(layer.num_edges)
    perm[idx] = idx.flip(0)
    shuffled = dataclasses.replace(layer, edge_src=layer.edge_src[perm], edge_dst=layer.edge_dst[perm],
                                   edge_id=layer.edge_id[perm])
    broken = dataclasses.replace(batch, layers=[batch.layers[0], shuffled])
    model = _make_model("sage", "mean", 2, 0.0, torch.float64)
    with pytest.raises(AssertionError, match="layer 1: edges are not in canonical"):
        full_batch_reference(model, broken, feat, label, dtype=torch.float64)
    full_batch_reference(model, batch, feat, label, dtype=torch.float64)  # the sampler's order passes


def test_reference_loss_is_the_mean_node_loss(graph_data):
    """The reference's loss is (1/N) Σ_v ℓ(v), computed independently of betty.train."""
    g, feat, label, train = graph_data
    batch = sample_full_batch(g, train, FANOUTS[2], seed=0)
    model = _make_model("sage", "mean", 2, 0.0, torch.float64).eval()
    ref = full_batch_reference(model, batch, feat, label, dtype=torch.float64)
    from betty.microbatch import carve

    mb = carve(batch, torch.arange(batch.num_outputs))
    with torch.no_grad():
        logits = model(mb.to_blocks(), feat[mb.input_nid].double())
    per_node = [float(torch.nn.functional.cross_entropy(logits[i:i + 1], label[mb.output_nid][i:i + 1]))
                for i in range(batch.num_outputs)]
    assert ref.loss == pytest.approx(sum(per_node) / len(per_node), rel=1e-12)


@pytest.mark.dgl
def test_lstm_depends_on_neighbour_order(graph_data):
    """Why the canonical neighbour order matters: reversing each destination's
    neighbour order changes the LSTM aggregate."""
    import dgl

    from betty.microbatch import carve

    g, feat, label, train = graph_data
    batch = sample_full_batch(g, train, [6], seed=0)
    mb = carve(batch, torch.arange(batch.num_outputs))
    layer = mb.layers[0]
    model = _make_model("sage", "lstm", 1, 0.0, torch.float64).eval()
    x = feat[mb.input_nid].double()
    canonical = model.layers[0](mb.to_blocks()[0], x)
    flipped = torch.argsort(layer.edge_dst * layer.num_src - layer.src_nid[layer.edge_src], stable=True)
    block = dgl.create_block((layer.edge_src[flipped], layer.edge_dst[flipped]),
                             num_src_nodes=layer.num_src, num_dst_nodes=layer.num_dst)
    reordered = model.layers[0](block, x)
    assert (canonical - reordered).abs().max() > 1e-6


def test_training_curve_k4_equals_k1(graph_data):
    """Five epochs, re-sampled every epoch, Adam: K=1 and K=4 follow the loss curve of
    steps taken with the reference's gradients."""
    g, feat, label, train = graph_data
    curves = {}
    for k in ("reference", 1, 4):
        model = _make_model("sage", "mean", 2, 0.5, torch.float64)
        opt = build_optimizer("adam", model.parameters(), lr=0.01)
        losses = []
        for epoch in range(5):
            batch = sample_full_batch(g, train, FANOUTS[2], seed=epoch)
            key = dropout_key(0, epoch)
            if k == "reference":
                ref = full_batch_reference(model, batch, feat, label, dropout_key=key,
                                           dtype=torch.float64)
                for name, p in model.named_parameters():
                    p.grad = ref.grads[name]
                opt.step()
                losses.append(ref.loss)
                continue
            groups = partition_batch(batch, k, "random", seed=epoch).groups
            result = train_step(model, opt, batch, groups, feat, label, k=k,
                                dropout_key=key, dtype=torch.float64)
            losses.append(result.loss)
        curves[k] = losses
    assert curves["reference"][-1] < curves["reference"][0]
    assert curves[1] == pytest.approx(curves["reference"], rel=1e-10, abs=0)
    assert curves[4] == pytest.approx(curves["reference"], rel=1e-10, abs=0)


def test_multilabel_k_way_equals_reference(graph_data):
    """Multi-label targets (mean over T tasks of binary cross-entropy): K-way equals the
    reference, whose loss is torch's mean over all N·T entries."""
    g, feat, _, train = graph_data
    gen = torch.Generator().manual_seed(0)
    targets = (torch.rand(g.num_nodes(), 5, generator=gen) < 0.3).to(torch.float64)
    batch = sample_full_batch(g, train, FANOUTS[2], seed=0)
    model = _make_model("sage", "mean", 2, 0.5, torch.float64)
    key = dropout_key(0, 1)
    ref = full_batch_reference(model, batch, feat, targets, dropout_key=key, dtype=torch.float64,
                               multilabel=True)
    for k in (1, 3):
        model.zero_grad(set_to_none=True)
        groups = partition_batch(batch, k, "random", seed=3).groups
        res = accumulate_gradients(model, batch, groups, feat, targets, k=k, dropout_key=key,
                                   dtype=torch.float64, multilabel=True)
        assert max_relative_difference(gradients(model), ref.grads) < TOL[torch.float64]
        assert res.loss == pytest.approx(ref.loss, rel=TOL[torch.float64], abs=0)


@pytest.mark.parametrize("arch,agg", MODELS, ids=[f"{a}-{g}" if g else a for a, g in MODELS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_k_way_gradient_equals_full_batch_with_self_loops(graph_data, backend, arch, agg):
    """``dataset.self_loops``: on the self-looped graph (a loop sampled like any edge)
    K-way accumulation still equals the reference."""
    pytest.importorskip("dgl" if backend == "dgl" else "torch_geometric")
    g, feat, label, train = graph_data
    looped = g.with_self_loops()
    batch = sample_full_batch(looped, train, FANOUTS[2], seed=0)
    layer = batch.layers[-1]
    gid = layer.src_nid
    loops = int((gid[layer.edge_src] == gid[layer.edge_dst]).sum())
    assert 0 < loops, "the batch must contain sampled self-loops"
    model = _make_model(arch, agg, 2, 0.5, torch.float64, backend=backend)
    ref = full_batch_reference(model, batch, feat, label, dropout_key=dropout_key(0, 1),
                               dtype=torch.float64)
    for method, k in (("random", 3), ("reg", 7)):
        _, grad_k = _grads(model, batch, feat, label, k, method, torch.float64)
        err = max_relative_difference(grad_k, ref.grads)
        assert err < TOL[torch.float64], f"{method} K={k}: relative gradient error {err:.3e}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_gcn_full_neighbour_equals_graphconv_on_the_self_looped_graph(graph_data, backend):
    """With every neighbour sampled, a GCN layer is the backend's whole-graph
    ``GraphConv(norm='both')`` (DGL's own on the DGL backend) on the graph with a self-loop
    added to every node, for every output node: Kipf & Welling's propagation rule."""
    pytest.importorskip("dgl" if backend == "dgl" else "torch_geometric")
    from betty.backends import get_backend
    from betty.microbatch import carve

    g, feat, _, train = graph_data
    model = _make_model("gcn", None, 1, 0.0, torch.float64, backend=backend).eval()
    ops = get_backend(backend)
    conv = ops.graph_conv(12, 5).double()
    conv.load_state_dict(model.layers[0].state_dict())
    whole = ops.full_graph(g.with_self_loops())
    expected = conv(whole, feat.double())[train]
    batch = sample_full_batch(g, train, [-1], seed=0)
    mb = carve(batch, torch.arange(batch.num_outputs))
    got = model(model.make_blocks(mb.layers), feat[mb.input_nid].double())
    assert torch.equal(mb.output_nid, train)
    assert float((got - expected).abs().max().detach()) < 1e-12 * float(expected.abs().max().detach())


@pytest.mark.parametrize("arch,agg", MODELS, ids=[f"{a}-{g}" if g else a for a, g in MODELS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_micro_batch_without_edges_adds_the_full_batchs_gradient(graph_data, backend, arch, agg):
    """The outputs without in-edges in a micro-batch of their own: every layer of it has
    no edges (REG makes such micro-batches at K = 32 on this graph). DGL's max reduction
    over no edges sent the pool aggregator's gradient to source row 0, through
    ``fc_pool``; the K-way gradient must still be the full batch's."""
    pytest.importorskip("dgl" if backend == "dgl" else "torch_geometric")
    g, feat, label, train = graph_data
    batch = sample_full_batch(g, train, FANOUTS[2], seed=0)
    isolated = batch.layers[-1].in_degrees() == 0
    groups = torch.where(isolated, 0, 1 + torch.arange(batch.num_outputs) % 3)
    model = _make_model(arch, agg, 2, 0.5, torch.float64, backend=backend)
    ref = full_batch_reference(model, batch, feat, label, dropout_key=dropout_key(0, 1), dtype=torch.float64)
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, batch, groups, feat, label, k=4, dropout_key=dropout_key(0, 1), dtype=torch.float64)
    err = max_relative_difference(gradients(model), ref.grads)
    assert err < TOL[torch.float64], f"relative gradient error {err:.3e}"


def test_a_nan_or_infinite_gradient_never_passes():
    """``max_relative_difference`` is ``inf`` where either side is not finite (a NaN
    must not vanish in ``max``)."""
    ref = {"a": torch.ones(3), "b": torch.ones(2)}
    for bad in (float("nan"), float("inf")):
        got = {"a": torch.ones(3), "b": torch.tensor([1.0, bad])}
        assert max_relative_difference(got, ref) == float("inf")
        assert max_relative_difference(ref, got) == float("inf")
    assert max_relative_difference(ref, ref) == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_partition_method_keeps_every_model_exact(graph_data, backend):
    """Every partition method at K = 3, with every model (float64, dropout 0.5): the split
    changes which outputs share a micro-batch, never the update."""
    from betty import catalog

    pytest.importorskip("dgl" if backend == "dgl" else "torch_geometric")
    g, feat, label, train = graph_data
    batch = sample_full_batch(g, train, FANOUTS[2], seed=0)
    failed = []
    for arch, agg in MODELS:
        model = _make_model(arch, agg, 2, 0.5, torch.float64, backend=backend)
        ref = full_batch_reference(model, batch, feat, label, dropout_key=dropout_key(0, 1), dtype=torch.float64)
        for method in sorted(catalog.PARTITION_METHODS):
            model.zero_grad(set_to_none=True)
            groups = partition_batch(batch, 3, method, seed=3, graph=g).groups
            accumulate_gradients(model, batch, groups, feat, label, k=3, dropout_key=dropout_key(0, 1),
                                 dtype=torch.float64)
            err = max_relative_difference(gradients(model), ref.grads)
            if not err < TOL[torch.float64]:
                failed.append(f"{arch}-{agg} {method}: {err:.3e}")
    assert not failed, failed
