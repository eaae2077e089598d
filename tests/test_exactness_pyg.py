"""K-way gradient accumulation on the PyG backend equals a full-batch run.

The batch is sampled once by betty's sampler; the reference is
:func:`betty.reference.full_batch_reference` (the model on the sampler's own blocks, built
by the model's backend: no partition, no carving, its own loss normalisation).
Float64 must agree to 1e-10 relative, float32 to 1e-5; dropout 0 and 0.5 (node-keyed
masks, edge-keyed attention dropout), K in {2, 3, 7}, range, random and reg partitions,
zero-in-degree outputs included. Nothing here needs DGL once ``tests/graphs.py`` and
``betty.sampling`` are DGL-free (branch i11a), so the test runs in ``.venv-pyg``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch_geometric")

from betty.models import build_model  # noqa: E402
from betty.models.dropout import dropout_key  # noqa: E402
from betty.partition import partition_batch  # noqa: E402
from betty.reference import full_batch_reference  # noqa: E402
from betty.train import accumulate_gradients, gradients, max_relative_difference  # noqa: E402
from betty.sampling import sample_full_batch  # noqa: E402
from graphs import power_law_graph  # noqa: E402

pytestmark = pytest.mark.pyg

MODELS = [("sage", "mean"), ("sage", "gcn"), ("sage", "pool"), ("sage", "lstm"), ("gat", None)]
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
FANOUTS = {2: [5, 8], 3: [4, 6, 8]}
KEY = dropout_key(0, 1)


@pytest.fixture(scope="module")
def graph_data():
    g, feat, label, train = power_law_graph(num_nodes=600, avg_degree=8, seed=0)
    assert int((g.in_degrees()[train] == 0).sum()) > 0, "test needs zero-in-degree outputs"
    return g, feat, label, train


def _make_model(arch, agg, layers, dropout, dtype):
    torch.manual_seed(0)
    model = build_model(arch, 12, 5, hidden=16, layers=layers, aggregator=agg or "mean", heads=2,
                        dropout=dropout, attn_dropout=dropout / 2, backend="pyg")
    assert model.backend_name == "pyg"
    return model.to(dtype).train()


def _k_way(model, batch, feat, label, k, method, dtype):
    model.zero_grad(set_to_none=True)
    groups = partition_batch(batch, k, method, seed=3).groups
    result = accumulate_gradients(model, batch, groups, feat, label, k=k, dropout_key=KEY, dtype=dtype)
    assert result.k == k
    return result.loss, gradients(model)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("dropout", [0.0, 0.5], ids=["nodrop", "drop"])
@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("arch,agg", MODELS, ids=[f"{a}-{g}" if g else a for a, g in MODELS])
def test_k_way_gradient_equals_full_batch_pyg(graph_data, arch, agg, layers, dropout, dtype):
    g, feat, label, train = graph_data
    batch = sample_full_batch(g, train, FANOUTS[layers], seed=0)
    assert int((batch.layers[-1].in_degrees() == 0).sum()) > 0
    model = _make_model(arch, agg, layers, dropout, dtype)
    ref = full_batch_reference(model, batch, feat, label, dropout_key=KEY, dtype=dtype)
    zero = [name for name, v in ref.grads.items() if float(v.abs().sum()) == 0]
    assert not zero, f"parameters without gradient: {zero}"
    for method in ("range", "random", "reg"):
        for k in (1, 2, 3, 7):
            loss_k, grad_k = _k_way(model, batch, feat, label, k, method, dtype)
            err = max_relative_difference(grad_k, ref.grads)
            assert err < TOL[dtype], f"{method} K={k}: relative gradient error {err:.3e}"
            assert loss_k == pytest.approx(ref.loss, rel=TOL[dtype], abs=0)
