"""``betty verify``'s float32 tolerance follows the rounding float32 gives on the data at
hand (betty.verify.exactness_tolerance): GAT on the real Cora and CiteSeer files passes,
per-call dropout still fails."""

from __future__ import annotations

import pytest
import torch

from betty.data import load_dataset
from betty.data.planetoid import stage_planetoid
from betty.engine import PartitionPlan, Trainer
from betty.models import build_model
from betty.train import build_optimizer
from betty.verify import DEFAULT_TOL, MAX_SCALED_TOL, ROUNDING_FACTOR, exactness_tolerance, verify_exactness
from graphs import planetoid_dir


def test_tolerance_is_the_scaled_rounding_between_floor_and_cap():
    assert exactness_tolerance(torch.float64, 1.0) == (1e-10, "fixed float64 tolerance 1e-10")
    assert exactness_tolerance(torch.float32)[0] == DEFAULT_TOL[torch.float32]
    tol, why = exactness_tolerance(torch.float32, 2e-5)
    assert tol == pytest.approx(ROUNDING_FACTOR * 2e-5) and "2.00e-05" in why
    assert exactness_tolerance(torch.float32, 1e-8)[0] == 1e-5
    tol, why = exactness_tolerance(torch.float32, 0.5)
    assert tol == MAX_SCALED_TOL and "capped" in why


def _planetoid_gat(tmp_path, dropout_mode: str, name: str = "cora"):
    planetoid = planetoid_dir()
    assert planetoid is not None, "real Planetoid files not found (set BETTY_PLANETOID_DIR)"
    stage_planetoid(planetoid, tmp_path, name)
    ds = load_dataset(name, tmp_path)
    torch.manual_seed(0)
    # GAT's published Cora settings: 8 heads x 8 hidden, dropout 0.6 on features and attention
    model = build_model("gat", ds.num_features, ds.num_classes, hidden=8, heads=8, layers=2,
                        dropout=0.6, attn_dropout=0.6, dropout_mode=dropout_mode)
    trainer = Trainer(model, build_optimizer("adam", model.parameters(), lr=0.005), ds, [-1, -1],
                      PartitionPlan("random", 2), seed=0)
    return model, trainer.sample(0, 0), ds


@pytest.mark.parametrize("name", ["cora", "citeseer"])
def test_gat_on_planetoid_passes_in_float32_with_the_scaled_tolerance(tmp_path, name):
    model, batch, ds = _planetoid_gat(tmp_path, "deterministic", name)
    out = verify_exactness(model, batch, ds.feat, ds.label, [2, 4, 8], seed=0, graph=ds.graph)
    assert out["dtype"] == "float32" and out["verdict"] == "PASS", out
    # the data's rounding is above what the fixed 1e-5 allowed: some K differ by more than that
    assert max(r["max_rel_grad_diff"] for r in out["results"]) > DEFAULT_TOL[torch.float32]
    assert 1e-6 < out["rounding_scale"] < 1e-4
    assert out["tol"] == pytest.approx(ROUNDING_FACTOR * out["rounding_scale"])
    assert "measured float32 rounding" in out["tol_basis"]


def test_gat_on_cora_with_per_call_dropout_still_fails(tmp_path):
    model, batch, ds = _planetoid_gat(tmp_path, "standard")
    out = verify_exactness(model, batch, ds.feat, ds.label, [2, 4], seed=0, graph=ds.graph)
    assert out["verdict"] == "FAIL"
    assert out["tol"] <= MAX_SCALED_TOL
    assert all(r["max_rel_grad_diff"] > 100 * out["tol"] for r in out["results"][1:])


def test_mixed_precision_has_its_own_fixed_tolerance():
    from betty.verify import MIXED_TOL

    tol, why = exactness_tolerance(torch.float32, 2e-5, "bf16-mixed")
    assert tol == MIXED_TOL["bf16-mixed"] and "bf16-mixed" in why
    assert exactness_tolerance(torch.float32, None, "16-mixed")[0] == MIXED_TOL["16-mixed"]
    assert exactness_tolerance(torch.float32, None, "32")[0] == DEFAULT_TOL[torch.float32]


@pytest.mark.parametrize("dropout_mode,verdict", [("deterministic", "PASS"), ("standard", "FAIL")])
def test_verify_in_bf16_passes_and_per_call_dropout_fails(dropout_mode, verdict):
    from betty.sampling import sample_full_batch
    from graphs import power_law_graph

    g, feat, label, train = power_law_graph(num_nodes=600, avg_degree=8, seed=0)
    batch = sample_full_batch(g, train, [5, 8], seed=0)
    torch.manual_seed(0)
    model = build_model("sage", 12, 5, hidden=16, layers=2, dropout=0.5, dropout_mode=dropout_mode)
    out = verify_exactness(model, batch, feat, label, [2, 4, 8], seed=0, precision="bf16-mixed")
    assert out["precision"] == "bf16-mixed" and out["rounding_scale"] is None
    assert out["verdict"] == verdict, out
    if verdict == "PASS":  # autocast did run: K-way differs from the reference by bf16 rounding
        assert max(r["max_rel_grad_diff"] for r in out["results"][1:]) > 1e-4


@pytest.mark.dgl
def test_16_mixed_with_dgl_on_the_cpu_is_refused_as_the_trainer_refuses_it():
    """With the precision's own message, not a DGL kernel's error halfway through."""
    from betty.sampling import sample_full_batch
    from graphs import power_law_graph

    g, feat, label, train = power_law_graph(num_nodes=200, avg_degree=6, seed=0)
    batch = sample_full_batch(g, train, [4, 4], seed=0)
    model = build_model("sage", 12, 5, hidden=8, layers=2, backend="dgl")
    with pytest.raises(ValueError, match="16-mixed needs CUDA with the DGL backend"):
        verify_exactness(model, batch, feat, label, [2], precision="16-mixed")
