"""The optimizer step's memory with several parameter groups.

:func:`betty.memory.spec.as_optimizer_spec` records a torch optimizer's parameter groups
(each parameter's size and whether its group adds weight decay to the gradient), and
:func:`betty.memory.estimator.step_bytes` sizes the step group by group: weight decay's
gradient copy only where a group has it (``train.weight_decay_first_layer_only``:
the first layer's group), and single-tensor Adam's previous denominator not carried from
one group into the next. The estimate must equal a step measured by the meter, byte for
byte, for SGD (momentum, Nesterov, maximize) and Adam (maximize), one tensor at a time
and multi-tensor. Groups that differ in a key that decides the state or the step's
variant (momentum, amsgrad, foreach, maximize, ...) are refused by name.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from betty.memory.estimator import persistent_bytes, step_bytes
from betty.memory.meter import MemoryMeter
from betty.memory.spec import as_optimizer_spec
from betty.models import build_model
from betty.train import build_optimizer, parameter_groups

OPTIMIZERS = [("adam", {}), ("sgd", {}), ("sgd", {"momentum": 0.9}), ("adam", {"foreach": True}),
              ("sgd", {"foreach": True}), ("sgd", {"momentum": 0.9, "nesterov": True}),
              ("sgd", {"maximize": True}), ("sgd", {"momentum": 0.9, "maximize": True}),
              ("sgd", {"momentum": 0.9, "nesterov": True, "maximize": True}),
              ("sgd", {"foreach": True, "maximize": True}), ("adam", {"maximize": True}),
              ("adam", {"foreach": True, "maximize": True})]
OPTIMIZER_IDS = ["adam", "sgd", "sgd-momentum", "adam-foreach", "sgd-foreach", "sgd-nesterov", "sgd-maximize",
                 "sgd-momentum-maximize", "sgd-nesterov-maximize", "sgd-foreach-maximize", "adam-maximize",
                 "adam-foreach-maximize"]


def _measured_step(model, opt) -> int:
    """Peak bytes of one ``opt.step()`` beyond :func:`persistent_bytes`, after a first step
    (the state exists)."""
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    meter = MemoryMeter("cpu")
    meter.track(model, opt)
    with meter.measure() as region:
        opt.step()
    return region.peak_bytes - persistent_bytes(model, opt)


def _with(groups: list[dict], options: dict) -> list[dict]:
    return [dict(g, **options) for g in groups]


@pytest.mark.parametrize("name,options", OPTIMIZERS, ids=OPTIMIZER_IDS)
@pytest.mark.parametrize("arch,agg", [("sage", "mean"), ("sage", "lstm"), ("gat", "mean"), ("gcn", "mean")])
def test_weight_decay_on_the_first_layer_only_matches_a_measured_step(name, options, arch, agg):
    """``parameter_groups(first_layer_only=True)``: the first layer's group decays, the
    rest does not; the estimate charges weight decay's gradient copy to the first
    group's parameters only. Hidden 64 > the 12 input features, so the largest
    parameters are in the undecayed group (an estimate that decays every parameter is
    too high: checked)."""
    torch.manual_seed(0)
    model = build_model(arch, 12, 5, hidden=64, layers=3, aggregator=agg, heads=2)
    groups = _with(parameter_groups(model, 0.1, first_layer_only=True), options)
    opt = build_optimizer(name, groups, lr=1e-3)
    measured = _measured_step(model, opt)
    assert step_bytes(model, opt) == measured
    spec = as_optimizer_spec(opt)
    assert [d for _, d in spec.groups] == [True, False]
    if set(options) <= {"foreach", "momentum"} and (not options.get("foreach") or name == "sgd"):
        # (Adam's foreach step ignores decay; maximize and nesterov copy every gradient anyway)
        everywhere = dataclasses.replace(spec, decay=True, groups=None)
        assert step_bytes(model, everywhere) > measured


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_each_group_starts_its_own_step(name):
    """Two groups, every parameter decayed, split after the largest parameter: single-
    tensor Adam frees a group's last denominator before the next group starts, so the
    next group's first parameter does not count it; both match a measured step."""
    torch.manual_seed(0)
    model = build_model("sage", 12, 5, hidden=64, layers=3)
    params = list(model.parameters())
    largest = max(range(len(params)), key=lambda i: params[i].numel())
    groups = [{"params": params[:largest + 1], "weight_decay": 0.1},
              {"params": params[largest + 1:], "weight_decay": 0.1}]
    opt = build_optimizer(name, groups, lr=1e-3)
    assert step_bytes(model, opt) == _measured_step(model, opt)


@pytest.mark.parametrize("name,key,values", [("sgd", "momentum", (0.9, 0.0)),
                                             ("adam", "amsgrad", (True, False)),
                                             ("sgd", "foreach", (True, False)),
                                             ("adam", "foreach", (None, True)),
                                             ("sgd", "maximize", (True, False)),
                                             ("adam", "maximize", (False, True))])
def test_groups_that_differ_in_state_or_variant_are_refused(name, key, values):
    model = build_model("sage", 12, 5, hidden=16, layers=2)
    params = list(model.parameters())
    groups = [{"params": params[:2], key: values[0]}, {"params": params[2:], key: values[1]}]
    opt = build_optimizer(name, groups, lr=1e-3)
    with pytest.raises(ValueError, match=f"one '{key}' for all of the optimizer's parameter groups"):
        as_optimizer_spec(opt)
