"""Parts of the memory model: sizes without carving, the timeline, constants and
calibration, the K search's rules and errors, engine factories, CUDA helpers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from betty.engine import PartitionPlan
from betty.memory import (
    EstimatedOOMError,
    KSearchError,
    ModelSpec,
    apply_budget,
    estimate_micro_batch,
    estimate_micro_batches,
    load_constants,
    make_estimator,
    make_k_chooser,
    memory_balance_weights,
    module_bytes,
    oom_guard,
    optimizer_state_bytes,
    search_k,
)
from betty.memory.calibrate import calibrate, measure_lstm_state
from betty.memory.estimator import persistent_bytes
from betty.memory.constants import onednn_lstm_state_arrays, onednn_lstm_workspace_bytes
from betty.memory.sizes import carved_split_sizes, micro_batch_sizes, split_sizes
from betty.memory.spec import parameter_shapes
from betty.memory.timeline import Timeline
from betty.microbatch import split
from betty.models import build_model
from betty.partition import partition_batch
from betty.sampling import sample_full_batch
from betty.train import build_optimizer, train_step
from graphs import power_law_graph


@pytest.fixture(scope="module")
def batch3():
    g, feat, label, train = power_law_graph(num_nodes=700, avg_degree=8, num_feats=12, seed=2)
    return sample_full_batch(g, train, [4, 6, 8], seed=0), feat, label


def test_micro_batch_sizes_equal_carved_micro_batches(batch3):
    batch, _, _ = batch3
    groups = partition_batch(batch, 5, "random", seed=1).groups
    sizes = split_sizes(batch, groups, 5)
    for p, mb in enumerate(split(batch, groups, 5)):
        ref = micro_batch_sizes(mb)
        for l in range(3):
            assert sizes.n_src[l][p] == ref.n_src[l][0]
            assert sizes.n_dst[l][p] == ref.n_dst[l][0]
            assert sizes.num_edges[l][p] == ref.num_edges[l][0]
            hist = dict(zip(sizes.degrees[l].tolist(), sizes.degree_counts[l][p].tolist()))
            want = dict(zip(ref.degrees[l].tolist(), ref.degree_counts[l][0].tolist()))
            assert {d: c for d, c in hist.items() if c} == want



@pytest.mark.parametrize("method,k", [("random", 5), ("reg", 3), ("random", 1), ("random", 60)])
def test_sizes_read_off_the_carved_micro_batches_equal_the_membership_sizes(batch3, method, k):
    """:func:`carved_split_sizes` stacks the micro-batches' own sizes: the same arrays as
    :func:`split_sizes` from the membership (the distinct degrees their union), and it
    becomes the batch's micro-batch sizes for that split."""
    batch, _, _ = batch3
    groups = partition_batch(batch, k, method, seed=1).groups
    want = split_sizes(batch, groups, k)
    batch._derived.clear()
    got = carved_split_sizes(batch, groups, k, split(batch, groups, k))
    for name in ("n_src", "n_dst", "num_edges", "degrees", "degree_counts"):
        for l in range(batch.num_layers):
            a, b = getattr(got, name)[l], getattr(want, name)[l]
            assert a.dtype == b.dtype and np.array_equal(a, b), (name, l)
    assert split_sizes(batch, groups, k) is got


def test_carved_split_sizes_refuses_micro_batches_out_of_order(batch3):
    batch, _, _ = batch3
    groups = partition_batch(batch, 4, "random", seed=1).groups
    micro_batches = split(batch, groups, 4)
    with pytest.raises(ValueError, match=r"micro_batches\[0\] does not hold the outputs of group 0 of the split"):
        carved_split_sizes(batch, groups, 4, micro_batches[::-1])
    with pytest.raises(ValueError, match="needs all 4 micro-batches, got 3"):
        carved_split_sizes(batch, groups, 4, micro_batches[:3])

def test_timeline_refcounts_peak_and_breakdown():
    tl = Timeline(2)
    tl.add_baseline(10, "parameters")
    a = tl.alloc([100, 5], "activations", "a")
    tl.hold(a)
    b = tl.alloc([1, 50], "aggregation", "b")
    tl.release(a)  # still held once
    tl.release(b)
    c = tl.alloc([20, 20], "activation_gradients", "c")
    tl.release(a)
    assert tl.peak.tolist() == [130, 65]
    assert tl.breakdown()[0] == {"parameters": 10, "activations": 100, "activation_gradients": 20}
    assert tl.breakdown()[1] == {"parameters": 10, "activations": 5, "aggregation": 50}
    assert tl.live.tolist() == [30, 30]
    with pytest.raises(RuntimeError):
        tl.release(a)
    assert Timeline(1, granule=512).alloc(1, "x", "x").size.tolist() == [512]
    del c


@pytest.mark.parametrize("arch,agg", [("sage", "mean"), ("sage", "gcn"), ("sage", "pool"),
                                      ("sage", "lstm"), ("gat", "mean")])
def test_parameter_and_optimizer_bytes_match_the_model(arch, agg, batch3):
    batch, feat, label = batch3
    model = build_model(arch, 12, 5, hidden=24, layers=3, aggregator=agg, heads=3)
    spec = ModelSpec.from_model(model)
    shapes = [s for layer in parameter_shapes(spec) for s in layer]
    assert sorted(shapes) == sorted(tuple(p.shape) for p in model.parameters())
    opt = build_optimizer("adam", model.parameters(), 1e-3)
    train_step(model, opt, batch, torch.zeros(batch.num_outputs, dtype=torch.int64), feat, label)
    est = estimate_micro_batch(batch, model, opt)
    assert est.breakdown["parameters"] == module_bytes(model, grads=False)
    assert est.breakdown["optimizer_state"] == optimizer_state_bytes(opt)
    assert est.peak == sum(est.breakdown.values())


@pytest.mark.parametrize("make", [lambda p: torch.optim.AdamW(p, 1e-3, amsgrad=True),
                                  lambda p: torch.optim.Adam(p, 1e-3, amsgrad=True),
                                  lambda p: torch.optim.AdamW(p, 1e-3, weight_decay=0.1),
                                  lambda p: torch.optim.SGD(p, 1e-3, momentum=0.9)],
                         ids=["adamw-amsgrad", "adam-amsgrad", "adamw", "sgd-momentum"])
def test_optimizer_state_of_adamw_amsgrad_and_momentum_matches_the_optimizer(make, batch3):
    batch, feat, label = batch3
    model = build_model("sage", 12, 5, hidden=24, layers=3, aggregator="mean")
    opt = make(model.parameters())
    train_step(model, opt, batch, torch.zeros(batch.num_outputs, dtype=torch.int64), feat, label)
    est = estimate_micro_batch(batch, model, opt)
    assert est.breakdown["optimizer_state"] == optimizer_state_bytes(opt) > 0


def test_an_optimizer_the_memory_model_does_not_know_is_refused_at_construction(batch3):
    """Refused when the trainer is built, naming the way out, not at the first batch."""
    from betty.data.types import GraphDataset
    from betty.engine import Trainer
    from betty.rev.engine import RevPlan, RevTrainer
    from betty.rev.model import RevGNN

    g, feat, label, train = power_law_graph(num_nodes=60, avg_degree=4, seed=0, num_feats=12, num_classes=5)
    rest = torch.tensor(sorted(set(range(60)) - set(train.tolist())))
    ds = GraphDataset(name="t", graph=g, feat=feat, label=label, train_idx=train, valid_idx=rest[:5],
                      test_idx=rest[5:], num_classes=5)
    model = build_model("sage", 12, 5, hidden=8, layers=2)
    rev = RevGNN(12, 8, 5, num_layers=2)
    for build in (lambda: Trainer(model, torch.optim.RMSprop(model.parameters()), ds, [3, 3], PartitionPlan("range", 2)),
                  lambda: RevTrainer(rev, torch.optim.RMSprop(rev.parameters()), ds, RevPlan("random", 2))):
        with pytest.raises(TypeError, match=r"not RMSprop; .*estimate_memory=False"):
            build()
    trainer = Trainer(model, torch.optim.RMSprop(model.parameters()), ds, [3, 3], PartitionPlan("range", 2),
                      estimate_memory=False)
    assert trainer.train_epoch(0).k == 2


@pytest.mark.parametrize("steps,seqs,width", [(1, 3, 16), (3, 50, 40), (6, 120, 64), (2, 30, 256)])
def test_onednn_workspace_formula_matches_measurement(steps, seqs, width):
    saved, _ = measure_lstm_state("cpu", steps, seqs, width)
    assert saved == onednn_lstm_workspace_bytes(steps, seqs, width)
    # the layout is this build's (5 padded state arrays: torch 2.2.1; 3: torch 2.13); the
    # other layout's count must not match, so the probe's answer is what makes it exact
    n = onednn_lstm_state_arrays()
    assert n in (3, 5)
    assert saved != onednn_lstm_workspace_bytes(steps, seqs, width, state_arrays=8 - n)


def test_calibrate_writes_user_constants_the_estimator_reads(tmp_path, monkeypatch):
    path = tmp_path / "constants.json"
    monkeypatch.setenv("BETTY_MEMORY_CONSTANTS", str(path))
    result = calibrate("cpu", lstm_grid=[(1, 8, 16), (3, 40, 16), (2, 100, 40), (5, 60, 64)])
    assert result["path"] == str(path) and path.exists()
    assert result["backend"] == "cpu" and result["constants"]["lstm_kernel"] == "onednn"
    assert result["onednn_formula_max_rel_error"] == 0.0
    stored = json.loads(path.read_text())["cpu"]
    assert stored["source"] == "calibrated"
    # the user file overrides the shipped values key by key
    stored["lstm_kernel"] = "linear"
    stored["lstm_step_words"] = 1000.0
    path.write_text(json.dumps({"cpu": stored}))
    assert load_constants("cpu").lstm_step_words == 1000.0
    assert load_constants("cpu", use_user=False).lstm_step_words != 1000.0


def test_calibration_keeps_the_shipped_graph_format_constants_where_dgl_is_missing(monkeypatch):
    """DGL's device graph formats are measured where DGL imports; without it the shipped
    values stay (not zeroed), off CUDA and with ``block_formats=False`` they are 0."""
    import importlib

    cal = importlib.import_module("betty.memory.calibrate")  # the module (betty.memory exports the function)

    base = load_constants("cuda", use_user=False)
    assert base.block_bytes_per_edge > 0
    cuda = torch.device("cuda")
    monkeypatch.setattr(cal, "available", lambda name: name != "dgl")  # DGL missing or broken
    monkeypatch.setattr(cal, "measure_block_formats", lambda *a, **k: pytest.fail("measured without DGL"))
    assert cal.block_constants(cuda, None, base) == (base.block_bytes_per_edge, base.block_bytes_per_node)
    assert cal.block_constants(cuda, False, base) == (0.0, 0.0)
    assert cal.block_constants(torch.device("cpu"), None, base) == (0.0, 0.0)
    monkeypatch.setattr(cal, "available", lambda name: True)
    sizes = iter([20000 * 2.0, 80000 * 2.0])  # 2 bytes per edge, none per node
    monkeypatch.setattr(cal, "measure_block_formats", lambda *a, **k: next(sizes))
    assert cal.block_constants(cuda, True, base) == pytest.approx((2.0, 0.0))


def test_shipped_constants_document_their_source():
    for backend in ("cpu", "cuda", "cuda-nocudnn"):
        c = load_constants(backend, use_user=False)
        assert c.source in ("calibrated", "derived") and c.note
    assert load_constants("cpu", use_user=False).source == "calibrated"
    assert load_constants("cpu", use_user=False).block_bytes_per_edge == 0.0
    assert load_constants("cuda", use_user=False).granule_bytes == 512


def test_cuda_backend_rounds_and_counts_graph_formats(batch3):
    batch, _, _ = batch3
    spec = ModelSpec.from_config("sage", 12, 5, hidden=16, layers=3)
    cpu = estimate_micro_batch(batch, spec, backend="cpu")
    cuda = estimate_micro_batch(batch, spec, backend="cuda")
    assert cuda.breakdown["blocks"] > cpu.breakdown["blocks"]
    assert cuda.peak > cpu.peak


def _lstm_setup(batch3, hidden=32):
    batch, feat, label = batch3
    return batch, ModelSpec.from_config("sage", 12, 5, hidden=hidden, layers=3, aggregator="lstm")


def test_search_uses_no_model_and_returns_a_fitting_k(batch3):
    batch, spec = _lstm_setup(batch3)
    full = estimate_micro_batch(batch, spec, "adam", fresh_grads=True)
    res = search_k(batch, spec, "adam", memory_budget=full.peak // 3, safety_margin=0.1)
    assert res.max_peak <= full.peak // 3 * 0.9
    assert res.k >= 3 and [k for k, _ in res.tried][0] == 1
    # every K tried is recorded with its max micro-batch; the chosen one is the smallest that fit
    fitting = [k for k, m in res.tried if m <= res.usable_budget]
    assert res.k == min(fitting)
    assert json.dumps(res.to_dict())


def test_search_starts_from_a_lower_bound_and_jumps(batch3):
    batch, spec = _lstm_setup(batch3)
    full = estimate_micro_batch(batch, spec, "adam", fresh_grads=True)
    res = search_k(batch, spec, "adam", memory_budget=full.peak // 12, safety_margin=0.0)
    tried = [k for k, _ in res.tried]
    assert tried[1] > 2, "should jump to the lower bound, not step from K = 2"
    assert len(tried) < res.k


def test_search_errors_name_the_cause_and_the_budget_that_works(batch3):
    batch, spec = _lstm_setup(batch3, hidden=64)
    fixed = persistent_bytes(spec, "adam")
    with pytest.raises(KSearchError, match="fixed costs") as err:
        search_k(batch, spec, "adam", memory_budget=fixed, safety_margin=0.0)
    assert err.value.smallest_budget >= fixed  # the advice works: K = 1 fits it
    assert search_k(batch, spec, "adam", memory_budget=err.value.smallest_budget, safety_margin=0.0).k == 1
    with pytest.raises(ValueError, match="memory_budget must be a finite number of bytes >= 1"):
        search_k(batch, spec, "adam", memory_budget=float("inf"))
    with pytest.raises(ValueError, match="safety_margin must be a number in"):
        search_k(batch, spec, "adam", memory_budget=1 << 30, safety_margin="0.1")
    # a budget above the fixed costs but below one output's neighbourhood
    single = estimate_micro_batches(batch, torch.arange(batch.num_outputs), batch.num_outputs, spec)
    worst = max(e.peak for e in single)
    with pytest.raises(KSearchError, match="one output") as err:
        search_k(batch, spec, "adam", memory_budget=(fixed + worst) // 2, safety_margin=0.0,
                 method="range")
    from betty.memory.estimator import step_bytes

    step_peak = fixed + step_bytes(spec, "adam")  # the step after the micro-batches: the advice covers it
    assert err.value.dominant and err.value.smallest_budget == max(worst, step_peak)
    assert search_k(batch, spec, "adam", memory_budget=err.value.smallest_budget,
                    safety_margin=0.0, method="range").k <= batch.num_outputs


def test_dropout_scratch_is_bounded_and_unsplittable_budgets_raise(batch3):
    """Hash dropout's chunk buffers hold at most 2^15 x (8 + 1) bytes per call (fewer for
    small inputs), and a budget no split can meet raises KSearchError."""
    batch, _, _ = batch3
    spec = ModelSpec.from_config("sage", 12, 5, hidden=16, layers=3, dropout=0.5)
    nodrop = ModelSpec.from_config("sage", 12, 5, hidden=16, layers=3, dropout=0.0)
    groups = torch.arange(batch.num_outputs) % 4
    with_drop = estimate_micro_batches(batch, groups, 4, spec)
    without = estimate_micro_batches(batch, groups, 4, nodrop)
    for a, b in zip(with_drop, without):
        assert 0 < a.breakdown.get("dropout", 0) <= 3 * (1 << 15) * 9
        assert a.peak > b.peak
    singletons = estimate_micro_batches(batch, torch.arange(batch.num_outputs), batch.num_outputs, spec)
    floor = min(e.peak for e in singletons)
    with pytest.raises(KSearchError):
        search_k(batch, spec, memory_budget=floor // 2, safety_margin=0.0)


def test_memory_balance_weights_follow_neighbourhood_sizes(batch3):
    batch, spec = _lstm_setup(batch3)
    w = memory_balance_weights(batch, spec)
    assert w.shape == (batch.num_outputs,) and bool((w > 0).all())
    deg = batch.layers[-1].in_degrees().numpy()
    assert np.corrcoef(w.numpy(), deg)[0, 1] > 0.5
    by_mem = search_k(batch, spec, memory_budget=4_000_000, safety_margin=0.0, balance="memory")
    assert by_mem.max_peak <= 4_000_000


def test_factories_match_the_engine_interfaces(batch3):
    batch, spec = _lstm_setup(batch3)
    full = estimate_micro_batch(batch, spec, fresh_grads=True)
    seen = []
    chooser = make_k_chooser(spec, "adam", on_search=seen.append)
    plan = PartitionPlan(method="random", k="auto", memory_budget=full.peak // 2, safety_margin=0.05)
    part, peaks = chooser(batch, plan, 3)
    assert part.k == len(peaks) and max(peaks) <= plan.memory_budget * 0.95 and seen
    estimator = make_estimator(spec, "adam")
    assert estimator(batch, part.groups, part.k) == peaks
    with pytest.raises(ValueError, match="memory_budget"):
        chooser(batch, PartitionPlan(k="auto"), 0)


def test_cuda_helpers_off_cuda():
    assert apply_budget("cpu", 10**9) == 1.0
    for bad in (0, float("inf"), "1GiB", True):  # the budget check of every other entry point
        with pytest.raises(ValueError, match="memory_budget must be a finite number of bytes >= 1"):
            apply_budget("cpu", bad)
    est = estimate_micro_batch(_tiny_sizes(),
                               ModelSpec.from_config("sage", 4, 2, hidden=4, layers=1))
    with pytest.raises(EstimatedOOMError, match="estimated peak") as err:
        with oom_guard([est], memory_budget=123):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert err.value.budget == 123 and isinstance(err.value.__cause__, RuntimeError)
    with pytest.raises(KeyError):
        with oom_guard([est]):
            raise KeyError("not an OOM")


def _tiny_sizes():
    from betty.memory.sizes import MicroBatchSizes

    one = np.array([3.0])
    return MicroBatchSizes([one], [np.array([2.0])], [np.array([4.0])], [np.array([2])],
                           [np.array([[2.0]])])


@pytest.mark.parametrize("arch", ["sage", "gat"])
def test_standard_dropout_and_float64_against_the_meter(arch, batch3):
    """Paths the accuracy grid does not cover: per-call dropout (a float noise tensor
    saved on the host) and float64 compute."""
    from betty.memory import MemoryMeter
    from betty.train import accumulate_gradients

    batch, feat, label = batch3
    for mode, dtype in (("standard", torch.float32), ("deterministic", torch.float64)):
        torch.manual_seed(0)
        model = build_model(arch, 12, 5, hidden=32, layers=3, heads=2, dropout=0.4,
                            attn_dropout=0.2, dropout_mode=mode).to(dtype).train()
        opt = build_optimizer("sgd", model.parameters(), 0.1)
        meter = MemoryMeter("cpu")
        meter.track(model, opt)
        groups = partition_batch(batch, 3, "random", seed=0).groups
        model.zero_grad(set_to_none=True)
        res = accumulate_gradients(model, batch, groups, feat, label, k=3, meter=meter,
                                   dropout_key=3, dtype=dtype)
        ests = estimate_micro_batches(batch, groups, 3, model, opt, dtype=dtype)
        for e, m in zip(ests, res.micro):
            assert abs(e.peak - m.peak_bytes) / m.peak_bytes <= 0.05, (mode, dtype, e.peak, m.peak_bytes)


def test_tests_never_read_the_users_constants_file(tmp_path):
    """conftest.py points BETTY_MEMORY_CONSTANTS at a fresh temp file, so a user's
    calibrated ~/.cache/betty/memory_constants.json cannot change test results."""
    import os
    import tempfile
    from pathlib import Path

    from betty.memory.constants import user_constants_path

    path = user_constants_path()
    assert Path(os.environ["BETTY_MEMORY_CONSTANTS"]) == path
    assert path.parent.name.startswith("betty-test-constants-")
    assert path.parent.parent == Path(tempfile.gettempdir())
    assert Path.home() not in path.parents
    if not path.exists():  # a test in this session may have calibrated into it
        assert load_constants("cpu") == load_constants("cpu", use_user=False)


def test_one_safety_margin_default_for_every_k_search():
    """search_k, search_k_rev, the estimate report, both plans and the spec share one
    default margin."""
    import inspect

    from betty.memory import DEFAULT_SAFETY_MARGIN
    from betty.rev.memory import search_k_rev
    from betty.memory.report import estimate_report
    from betty.rev.engine import RevPlan
    from workflow.spec import PartitionSection

    assert DEFAULT_SAFETY_MARGIN == 0.05
    for fn in (search_k, search_k_rev, estimate_report):
        assert inspect.signature(fn).parameters["safety_margin"].default == DEFAULT_SAFETY_MARGIN, fn
    assert PartitionPlan().safety_margin == DEFAULT_SAFETY_MARGIN
    assert RevPlan().safety_margin == DEFAULT_SAFETY_MARGIN
    assert PartitionSection().safety_margin == DEFAULT_SAFETY_MARGIN


def test_every_k_search_failure_is_a_ksearch_error(batch3):
    """Hitting max_evaluations raises KSearchError (not a bare RuntimeError), and the
    RevGNN search's error is a KSearchError too."""
    from betty.rev.memory import RevKSearchError

    batch, spec = _lstm_setup(batch3)
    full = estimate_micro_batch(batch, spec, "adam", fresh_grads=True)
    with pytest.raises(KSearchError, match="max_evaluations=2") as err:
        search_k(batch, spec, "adam", memory_budget=full.peak // 12, safety_margin=0.0,
                 max_evaluations=2)
    assert [k for k, _ in err.value.tried][0] == 1 and len(err.value.tried) == 2
    assert err.value.budget == full.peak // 12
    assert issubclass(RevKSearchError, KSearchError)


@pytest.mark.dgl
@pytest.mark.pyg
def test_the_estimate_follows_the_model_backend(batch3):
    """The replay is picked by the model's backend: the same shapes on PyG estimate more
    (its scatter aggregation materializes the (E, W) gathered messages, DGL's fused
    kernels do not), and an unknown backend is refused naming the allowed ones."""
    pytest.importorskip("torch_geometric")
    batch, _, _ = batch3
    peaks = {}
    for backend in ("dgl", "pyg"):
        model = build_model("sage", 12, 5, hidden=24, layers=3, aggregator="mean", backend=backend)
        spec = ModelSpec.from_model(model)
        assert spec.backend == backend
        peaks[backend] = estimate_micro_batch(batch, model, "adam").peak
        assert estimate_micro_batch(batch, spec, "adam").peak == peaks[backend]
    assert peaks["pyg"] > peaks["dgl"]
    with pytest.raises(ValueError, match=r"backend must be one of \('dgl', 'pyg'\), got 'jax'"):
        ModelSpec("sage", (12, 5), backend="jax")


@pytest.mark.parametrize("make", [lambda p: torch.optim.Adam(p, 1e-3), lambda p: torch.optim.Adam(p, 1e-3, weight_decay=0.1),
                                  lambda p: torch.optim.AdamW(p, 1e-3, weight_decay=0.1),
                                  lambda p: torch.optim.Adam(p, 1e-3, foreach=True),
                                  lambda p: torch.optim.SGD(p, 1e-3), lambda p: torch.optim.SGD(p, 1e-3, momentum=0.9, weight_decay=0.1),
                                  lambda p: torch.optim.SGD(p, 1e-3, weight_decay=0.1, foreach=True)],
                         ids=["adam", "adam-decay", "adamw", "adam-foreach", "sgd", "sgd-momentum-decay", "sgd-decay-foreach"])
@pytest.mark.parametrize("arch, agg", [("sage", "mean"), ("sage", "lstm"), ("gat", "mean")])
def test_the_optimizer_steps_temporaries_match_a_measured_step(make, arch, agg):
    """The step runs after every micro-batch: its peak, persistent + step_bytes, is the one
    no K lowers, and the K search holds it to the budget."""
    from betty.memory.estimator import step_bytes
    from betty.memory.meter import MemoryMeter

    torch.manual_seed(0)
    model = build_model(arch, 12, 5, hidden=32, layers=3, aggregator=agg, heads=2)
    opt = make(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # the state exists
    meter = MemoryMeter("cpu")
    meter.track(model, opt)
    with meter.measure() as region:
        opt.step()
    assert region.peak_bytes - persistent_bytes(model, opt) == step_bytes(model, opt)


def test_a_budget_the_optimizer_step_cannot_fit_is_refused_when_the_trainer_is_built():
    from betty.data.types import GraphDataset
    from betty.engine import Trainer
    from betty.memory.estimator import step_bytes
    from betty.memory.ksearch import KSearchError

    g, feat, label, train = power_law_graph(num_nodes=60, avg_degree=4, seed=0, num_feats=12, num_classes=5)
    rest = torch.tensor(sorted(set(range(60)) - set(train.tolist())))
    ds = GraphDataset(name="t", graph=g, feat=feat, label=label, train_idx=train, valid_idx=rest[:5],
                      test_idx=rest[5:], num_classes=5)
    model = build_model("sage", 12, 5, hidden=64, layers=2)
    opt = torch.optim.Adam(model.parameters())
    step_peak = persistent_bytes(model, opt) + step_bytes(model, opt)
    for k in ("auto", 2):
        with pytest.raises(KSearchError, match="the optimizer step alone") as err:
            Trainer(model, opt, ds, [3, 3], PartitionPlan("range", k, memory_budget=step_peak))  # less the margin
        assert err.value.smallest_budget * 0.95 >= step_peak
        Trainer(model, opt, ds, [3, 3], PartitionPlan("range", k, memory_budget=err.value.smallest_budget))
    with pytest.raises(ValueError, match="a memory_budget needs the memory estimates"):
        Trainer(model, opt, ds, [3, 3], PartitionPlan("range", 2, memory_budget=1 << 30), estimate_memory=False)
