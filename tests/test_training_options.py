"""Published-style training options: weight decay on the first layer only
(betty.train.parameter_groups) and the activation between layers (model.activation)."""

from __future__ import annotations

import pytest
import torch

from betty.models import build_model
from betty.train import first_layer, parameter_groups
from workflow.components import load_data, make_trainer
from workflow.specfile import SpecError, load_spec

NO_SWEEP = ["partition.sweep.k=[]", "train.measure_memory=false"]


def _after_one_step(overrides):
    rspec = load_spec("tiny", NO_SWEEP + overrides)
    trainer, model, optimizer = make_trainer(rspec, load_data(rspec), torch.device("cpu"))
    trainer.train_epoch(0)
    return dict(model.named_parameters()), optimizer


@pytest.mark.parametrize("arch", ["sage", "gat", "revgnn"])
def test_first_layer_only_decays_the_first_layer_and_nothing_else(tracking, arch):
    extra = {"sage": [], "gat": ["model.arch=gat", "model.heads=2"],
             "revgnn": ["model.arch=revgnn", "partition.method=random"]}[arch]
    plain, _ = _after_one_step(extra + ["train.weight_decay=0.5"])
    none, _ = _after_one_step(extra)
    first, optimizer = _after_one_step(extra + ["train.weight_decay=0.5", "train.weight_decay_first_layer_only=true"])
    prefix = "encoder." if arch == "revgnn" else "layers.0."
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.5, 0.0]
    assert any(name.startswith(prefix) for name in first)
    for name, p in first.items():
        # Adam's update of each parameter depends on its own gradient and decay only
        expected = plain[name] if name.startswith(prefix) else none[name]
        assert torch.equal(p, expected), name
    assert any(not torch.equal(plain[n], none[n]) for n in first if not n.startswith(prefix))


def test_parameter_groups_cover_every_parameter_once():
    model = build_model("sage", 8, 3, hidden=4, layers=3)
    groups = parameter_groups(model, 1e-3, first_layer_only=True)
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    assert {id(p) for p in groups[0]["params"]} == {id(p) for p in first_layer(model).parameters()}
    assert parameter_groups(model, 1e-3) == [{"params": list(model.parameters()), "weight_decay": 1e-3}]
    with pytest.raises(ValueError, match="first layer"):
        first_layer(torch.nn.Sequential())


@pytest.mark.parametrize("arch,activation,fn", [
    ("sage", "elu", torch.nn.functional.elu), ("sage", "gelu", torch.nn.functional.gelu),
    ("gat", "relu", torch.nn.functional.relu), ("gat", "leaky_relu", torch.nn.functional.leaky_relu),
    ("sage", None, torch.nn.functional.relu), ("gat", None, torch.nn.functional.elu),
])
def test_activation_is_the_one_between_layers(arch, activation, fn):
    model = build_model(arch, 8, 3, hidden=4, layers=2, heads=2, activation=activation)
    h = torch.linspace(-3, 3, 24).reshape(4, 6)
    assert torch.equal(model.activation(0, h), fn(h))
    assert model.activation_name == (activation or {"sage": "relu", "gat": "elu"}[arch])


def test_spec_wires_the_activation_into_the_model(tracking):
    rspec = load_spec("tiny", NO_SWEEP + ["model.activation=gelu"])
    _, model, _ = make_trainer(rspec, load_data(rspec), torch.device("cpu"))
    assert model.activation_name == "gelu"


@pytest.mark.parametrize("overrides, path", [
    (["model.activation=tanh"], "model.activation"),
    (["model.arch=revgnn", "partition.method=random", "model.activation=elu"], "model.activation"),
    (["train.weight_decay_first_layer_only=true"], "train.weight_decay_first_layer_only"),
])
def test_spec_refuses_bad_training_options(overrides, path):
    with pytest.raises(SpecError) as err:
        load_spec("tiny", overrides)
    assert path in str(err.value)


def test_revgnn_refuses_another_activation():
    with pytest.raises(ValueError, match="activation applies to arch sage, gat or gcn"):
        build_model("revgnn", 8, 3, hidden=4, layers=2, activation="gelu")
