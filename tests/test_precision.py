"""Mixed precision (``train.precision``): the step, the loss scaler, the spec keys and
exactness under autocast.

Under ``bf16-mixed``/``16-mixed`` every node still computes its full-batch computation,
so K-way accumulation differs from the independent full-batch reference
(:func:`betty.reference.full_batch_reference` under the same autocast) only by autocast's
rounding; K=1 is the reference's own computation, equal to float32 rounding. The bounds
below are just above the worst case ``benchmarks/precision.py`` measured on this test
graph (both backends, K = 2, 4, 8; docs/precision.md); per-call dropout stays far above
them.
CPU autocast runs bfloat16 on both backends; float16 runs on the PyG stack only (DGL's
CPU sparse kernels take no float16), so the 16-mixed exactness rows are PyG's.
"""

from __future__ import annotations

import pytest
import torch

from betty.models import build_model
from betty.models.dropout import dropout_key
from betty.partition import partition_batch
from betty.precision import LossScaler, Precision, input_dtype
from betty.reference import full_batch_reference
from betty.sampling import sample_full_batch
from betty.train import (accumulate_gradients, build_optimizer, gradients, max_relative_difference,
                         train_step)
from graphs import power_law_graph

# (arch, aggregator or variant): "1head" is GAT with output_heads=1
MODELS = [("sage", "mean"), ("sage", "gcn"), ("sage", "pool"), ("sage", "lstm"), ("gat", None),
          ("gat", "1head"), ("gcn", None)]
BACKENDS = [pytest.param("dgl", marks=pytest.mark.dgl), pytest.param("pyg", marks=pytest.mark.pyg)]
KWAY_TOL = {"bf16-mixed": 3e-2, "16-mixed": 4e-3}
"""K-way vs the reference, same precision: just above the measured worst case."""
VS32_TOL = {"bf16-mixed": 4e-2, "16-mixed": 3.5e-2}
"""The mixed-precision reference vs the float32 one: just above the measured worst case."""
K1_TOL = 1e-5
"""K=1 vs the reference, same precision: float32 rounding (tests/test_exactness.py)."""


@pytest.fixture(scope="module")
def batch_data():
    g, feat, label, train = power_law_graph(num_nodes=600, avg_degree=8, seed=0)
    return sample_full_batch(g, train, [5, 8], seed=0), feat, label


def _model(arch, agg, backend, dropout_mode="deterministic"):
    torch.manual_seed(0)
    return build_model(arch, 12, 5, hidden=16, layers=2, aggregator=agg if arch == "sage" else "mean",
                       heads=2, output_heads=1 if agg == "1head" else None, dropout=0.5,
                       attn_dropout=0.25, dropout_mode=dropout_mode, backend=backend).train()


def _grads(model, batch, feat, label, k, precision, scaler=None):
    model.zero_grad(set_to_none=True)
    groups = partition_batch(batch, k, "random", seed=3).groups
    res = accumulate_gradients(model, batch, groups, feat, label, k=k, dropout_key=dropout_key(0, 1),
                               dtype=torch.float32, precision=precision, scaler=scaler)
    return res, gradients(model)


def _need(backend, precision):
    pytest.importorskip("dgl" if backend == "dgl" else "torch_geometric")
    if backend == "dgl" and precision == "16-mixed":
        pytest.skip("DGL's CPU sparse kernels take no float16 (16-mixed needs CUDA with DGL)")


# ------------------------------------------------------------------ exactness


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("arch,agg", MODELS, ids=[f"{a}-{g}" if g else a for a, g in MODELS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_k_way_equals_the_full_batch_reference_under_mixed_precision(batch_data, backend, arch, agg,
                                                                    precision):
    _need(backend, precision)
    batch, feat, label = batch_data
    model = _model(arch, agg, backend)
    key = dropout_key(0, 1)
    ref = full_batch_reference(model, batch, feat, label, dropout_key=key, dtype=torch.float32,
                               precision=precision)
    ref32 = full_batch_reference(model, batch, feat, label, dropout_key=key, dtype=torch.float32)
    vs32 = max_relative_difference(ref.grads, ref32.grads)
    assert 0 < vs32 < VS32_TOL[precision], f"{precision} vs 32: {vs32:.2e}"
    for k in (1, 2, 4, 8):
        res, gk = _grads(model, batch, feat, label, k, precision)
        assert all(v.dtype == torch.float32 for v in gk.values()), "master gradients must be float32"
        err = max_relative_difference(gk, ref.grads)
        bound = K1_TOL if k == 1 else KWAY_TOL[precision]
        assert err < bound, f"K={k} vs the reference in {precision}: {err:.2e}"
        assert res.loss == pytest.approx(ref.loss, rel=bound, abs=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_call_dropout_breaks_it_under_bf16(batch_data, backend):
    """Negative control: per-call dropout masks are far outside the bf16 bound."""
    _need(backend, "bf16-mixed")
    batch, feat, label = batch_data
    model = _model("sage", "mean", backend, dropout_mode="standard")
    _, one = _grads(model, batch, feat, label, 1, "bf16-mixed")
    _, four = _grads(model, batch, feat, label, 4, "bf16-mixed")
    assert max_relative_difference(four, one) > 10 * KWAY_TOL["bf16-mixed"]


def test_reference_runs_under_autocast_and_matches_k1(batch_data):
    batch, feat, label = batch_data
    model = _model("sage", "mean", "auto")
    ref = full_batch_reference(model, batch, feat, label, dropout_key=dropout_key(0, 1),
                               dtype=torch.float32, precision="bf16-mixed")
    ref32 = full_batch_reference(model, batch, feat, label, dropout_key=dropout_key(0, 1),
                                 dtype=torch.float32)
    _, one = _grads(model, batch, feat, label, 1, "bf16-mixed")
    assert max_relative_difference(one, ref.grads) < KWAY_TOL["bf16-mixed"]
    assert max_relative_difference(ref.grads, ref32.grads) > 1e-4  # the reference did run in bf16


def test_bf16_features_stay_bf16_under_bf16_mixed_and_are_cast_in_32():
    assert input_dtype(torch.bfloat16, "bf16-mixed", torch.float32) is None
    assert input_dtype(torch.bfloat16, "32", torch.float32) == torch.float32
    assert input_dtype(torch.float16, "bf16-mixed", torch.float32) == torch.float32
    assert input_dtype(torch.float16, "16-mixed", torch.float32) is None


def test_bf16_features_train_under_both_precisions(batch_data):
    batch, feat, label = batch_data
    model = _model("sage", "mean", "auto")
    _, g32 = _grads(model, batch, feat, label, 2, "32")
    for prec in ("32", "bf16-mixed"):
        _, gb = _grads(model, batch, feat.bfloat16(), label, 2, prec)
        assert max_relative_difference(gb, g32) < VS32_TOL["bf16-mixed"]


def test_without_a_dtype_features_are_cast_to_the_models_parameters(batch_data):
    """bfloat16 host features (``dataset.feature_dtype``) or a float64 model, no ``dtype``
    given: the reference, the K-way pass, inference and verify cast the features to the
    parameters' dtype, as the trainer does, instead of failing at the first product."""
    from betty.inference import layerwise_inference, sampled_inference
    from betty.verify import verify_exactness

    batch, feat, label = batch_data
    g, _, _, _ = power_law_graph(num_nodes=600, avg_degree=8, seed=0)
    for param_dtype, host in ((torch.float32, feat.bfloat16()), (torch.float64, feat)):
        model = _model("sage", "mean", "auto").to(param_dtype)
        ref = full_batch_reference(model, batch, host, label, dropout_key=dropout_key(0, 1))
        model.zero_grad(set_to_none=True)
        groups = partition_batch(batch, 2, "random", seed=3).groups
        accumulate_gradients(model, batch, groups, host, label, k=2, dropout_key=dropout_key(0, 1))
        assert max_relative_difference(gradients(model), ref.grads) < 1e-5
        cast = host.to(param_dtype)
        full = layerwise_inference(model, g, host)
        assert full.dtype == param_dtype and torch.equal(full, layerwise_inference(model, g, cast))
        nodes = torch.arange(10)
        assert torch.equal(sampled_inference(model, g, host, nodes, [4, 4]),
                           sampled_inference(model, g, cast, nodes, [4, 4]))
        assert verify_exactness(model, batch, host, label, [2])["passed"]


# ------------------------------------------------------------------ the scaler


def test_scaler_update_backs_off_and_grows_like_torch_defaults():
    s = LossScaler()
    assert (s.scale, s.growth_factor, s.backoff_factor, s.growth_interval) == (2.0 ** 16, 2.0, 0.5, 2000)
    s = LossScaler(init_scale=8.0, growth_interval=3)
    s.update(True)
    assert s.scale == 4.0 and s.skipped_steps == 1
    s.update(False), s.update(False)
    assert s.scale == 4.0
    s.update(True)  # a skip resets the run of finite steps
    s.update(False), s.update(False)
    assert s.scale == 2.0
    s.update(False)
    assert s.scale == 4.0 and s.growth_tracker == 0


@pytest.mark.parametrize("kwargs", [dict(init_scale=float("inf")), dict(init_scale=1000.0), dict(init_scale=0.0),
                                    dict(growth_factor=3.0), dict(growth_factor=1.0), dict(backoff_factor=0.3),
                                    dict(growth_interval=2.7), dict(growth_interval=True), dict(init_scale="8")])
def test_scaler_settings_that_would_stop_training_or_lose_exactness_are_refused(kwargs):
    """An infinite scale skips every step; a scale that is not a power of two makes
    scaling and unscaling round; a fractional interval was truncated silently."""
    with pytest.raises(ValueError, match="LossScaler needs powers of two"):
        LossScaler(**kwargs)
    LossScaler(init_scale=2.0 ** -3, growth_factor=4, backoff_factor=0.25, growth_interval=5)


@pytest.mark.parametrize("k", [1, 3])
def test_scaled_step_equals_the_unscaled_one(batch_data, k):
    """One power-of-two scale for every micro-batch, unscaled once: the same float32
    gradients as without a scaler, bit for bit."""
    batch, feat, label = batch_data
    model = _model("sage", "mean", "auto")
    _, plain = _grads(model, batch, feat, label, k, "bf16-mixed")
    scaler = LossScaler(init_scale=2.0 ** 10)
    _, scaled = _grads(model, batch, feat, label, k, "bf16-mixed", scaler=scaler)
    assert max_relative_difference(scaled, plain) > 100  # accumulated scaled ...
    assert not scaler.unscale(model.parameters())
    for name, g in plain.items():  # ... and unscaled once
        assert torch.equal(dict(model.named_parameters())[name].grad, g), name


def test_overflow_in_one_micro_batch_skips_the_step_and_backs_off(batch_data):
    batch, feat, label = batch_data
    model = _model("sage", "mean", "auto")
    opt = build_optimizer("adam", model.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    groups = partition_batch(batch, 3, "random", seed=3).groups
    scaler = LossScaler(init_scale=2.0 ** 140)  # s = 2^140 overflows float32: inf gradients
    step = train_step(model, opt, batch, groups, feat, label, k=3, dropout_key=dropout_key(0, 1),
                      dtype=torch.float32, precision="bf16-mixed", scaler=scaler)
    assert step.k == 3
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "step not skipped"
    assert scaler.scale == 2.0 ** 139 and scaler.skipped_steps == 1
    scaler.scale = 2.0 ** 8
    train_step(model, opt, batch, groups, feat, label, k=3, dropout_key=dropout_key(0, 1),
               dtype=torch.float32, precision="bf16-mixed", scaler=scaler)
    assert not all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "finite step skipped"
    assert scaler.skipped_steps == 1 and scaler.growth_tracker == 1


def test_found_inf_is_agreed_over_the_ranks():
    from betty.distributed.launch import launch
    from distributed_cases import rank_found_inf

    assert launch(rank_found_inf, nproc=2) == {0: True, 1: True}


def test_trainer_builds_a_scaler_only_for_16_mixed():
    assert Precision("16-mixed").needs_scaler and not Precision("bf16-mixed").needs_scaler
    with pytest.raises(ValueError, match="train.precision must be one of 64, 32, bf16-mixed, 16-mixed"):
        Precision("bf16")


# ------------------------------------------------------------------ the spec keys


def _spec(train=None, dataset=None):
    from workflow.spec import Spec

    return Spec.model_validate({"dataset": {"name": "synthetic", **(dataset or {})},
                                "sampling": {"fanouts": [5, 5]}, "train": train or {}})


def test_precision_key_and_its_dtype_alias():
    assert (_spec().train.precision, _spec().train.dtype) == ("32", "float32")
    assert _spec({"precision": 64}).train.dtype == "float64"
    assert _spec({"dtype": "float64"}).train.precision == "64"
    t = _spec({"precision": "bf16-mixed"}).train
    assert (t.precision, t.dtype) == ("bf16-mixed", "float32")
    assert _spec({"precision": "16-mixed", "dtype": "float32"}).train.precision == "16-mixed"


@pytest.mark.parametrize("train,match", [
    ({"precision": "bf16"}, "train.precision must be one of 64, 32, bf16-mixed, 16-mixed"),
    ({"precision": 16}, "train.precision must be one of"),
])
def test_precision_errors_name_the_keys(train, match):
    with pytest.raises(ValueError, match=match):
        _spec(train)


@pytest.mark.parametrize("overrides,message", [
    (["train.precision=bf16-mixed", "train.dtype=float64"],
     "train.dtype = 'float64': disagrees with train.precision 'bf16-mixed'"),
    (["train.precision=64", "train.dtype=float32"], "train.dtype = 'float32': disagrees with train.precision '64'"),
])
def test_a_dtype_that_disagrees_with_the_precision_is_named_at_its_key(overrides, message):
    from workflow.spec import SpecError
    from workflow.specfile import load_spec

    with pytest.raises(SpecError) as info:
        load_spec("tiny", overrides)
    assert [str(p) for p in info.value.problems] == [message + " (train.dtype float64 is train.precision 64; "
                                                     "float32 is 32, bf16-mixed or 16-mixed); give only train.precision"]


def test_feature_dtype_key():
    assert _spec().dataset.feature_dtype == "float32"
    assert _spec(dataset={"feature_dtype": "bfloat16"}).dataset.feature_dtype == "bfloat16"
    with pytest.raises(ValueError, match="dataset.feature_dtype must be one of float32, bfloat16, float16"):
        _spec(dataset={"feature_dtype": "int8"})
