"""Spec schema, overrides, spec references, byte sizes and content hashes."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from workflow.sizes import format_bytes, parse_bytes
from workflow.spec import SpecError
from workflow.specfile import (
    apply_overrides,
    find_spec,
    load_spec,
    parse_overrides,
    resolve_spec,
    shipped_specs,
    specs_dir,
)

BASE = {
    "name": "t",
    "dataset": {"name": "synthetic", "num_nodes": 300},
    "sampling": {"fanouts": [3, 4]},
    "model": {"arch": "sage", "hidden": 8, "layers": 2},
    "partition": {"method": "random", "k": 2},
    "train": {"epochs": 1},
}


def problems(overrides, base=BASE):
    """The SpecError raised for ``base`` with ``overrides`` applied."""
    with pytest.raises(SpecError) as info:
        resolve_spec(apply_overrides(base, overrides))
    return info.value


# ------------------------------------------------------------------------ errors


@pytest.mark.parametrize(("override", "path", "value_text", "allowed_text"), [
    ("model.layers=3", "sampling.fanouts", "[3, 4]", "model.layers is 3"),
    ("partition.k=-1", "partition.k", "-1", "integer >= 1 or 'auto'"),
    ("partition.k=0", "partition.k", "0", "integer >= 1 or 'auto'"),
    ("partition.memory_budget=24 gigs", "partition.memory_budget", "'24 gigs'", "GiB"),
    ("partition.method=kmeans", "partition.method", "'kmeans'", "hypergraph"),
    ("model.aggregator=max", "model.aggregator", "'max'", "lstm"),
    ("model.arch=gcn2", "model.arch", "'gcn2'", "'revgnn'"),
    ("train.epochs='3'", "train.epochs", "'3'", "integer"),
    ("train.lr=true", "train.lr", "True", "number"),
    ("train.device=tpu9", "train.device", "'tpu9'", "cpu"),
    ("train.optimizer=lbfgs", "train.optimizer", "'lbfgs'", "adam"),
    ("sampling.fanouts=[3, 0]", "sampling.fanouts[1]", "0", "-1"),
    ("sampling.batch_size=half", "sampling.batch_size", "'half'", "'full'"),
    ("model.dropout=1.5", "model.dropout", "1.5", "less than 1"),
    ("dataset.name=ogbn-prodcts", "dataset.name", "'ogbn-prodcts'", "ogbn-products"),
    ("dataset.colour=red", "dataset.colour", "'red'", "num_nodes"),
    ("dataset.num_nodes=1", "dataset.num_nodes", "1", "integer >= 2"),
    ("train.foo=1", "train.foo", "1", "epochs"),
    ("partition.sweep.k=[1]", "partition.sweep.k[0]", "1", "greater than or equal to 2"),
    ("model.heads=2", "model.heads", "2", "gat"),
    ("model.groups=3", "model.groups", "3", "revgnn"),
    ("evaluate.fanouts=[2, 2]", "evaluate.fanouts", "[2, 2]", "sampled"),
    ("model.arch=gcn3", "model.arch", "'gcn3'", "'gcn'"),
    ("model.output_heads=1", "model.output_heads", "1", "gat"),
    ("dataset.self_loops=1", "dataset.self_loops", "1", "true or false"),
])
def test_bad_values_name_key_value_and_allowed(override, path, value_text, allowed_text):
    err = problems([override])
    assert len(err.problems) == 1, str(err)
    text = str(err.problems[0])
    assert text.startswith(f"{path} = {value_text}:"), text
    assert allowed_text in text, text


def test_missing_sections_and_budget_are_named():
    err = problems([], base={"name": "t"})
    paths = {p.path for p in err.problems}
    assert paths == {"dataset", "sampling"}
    assert all("required" in p.message for p in err.problems)
    err = problems(["partition.k=auto"])
    assert [p.path for p in err.problems] == ["partition.memory_budget"]
    assert "required when partition.k is 'auto'" in str(err)


def test_several_problems_reported_together():
    err = problems(["train.epochs=0", "model.hidden=-2", "unknown_section=1"])
    assert {p.path for p in err.problems} == {"train.epochs", "model.hidden", "unknown_section"}


def test_future_features_validate():
    r = resolve_spec(apply_overrides(BASE, [
        "partition.k=auto", "partition.memory_budget=1.5GB", "partition.balance=memory",
        "partition.safety_margin=0.1"]))
    assert r.spec.partition.k == "auto"
    assert r.data["partition"]["memory_budget"] == 1_500_000_000
    rev = apply_overrides(BASE, ["model.arch=revgnn", "model.layers=112", "model.hidden=64",
                                 "model.groups=2", "model.conv=gat", "model.heads=1"])
    assert resolve_spec(rev).spec.model.layers == 112  # fanouts need not match RevGNN depth
    err = problems(["model.arch=revgnn", "model.hidden=63", "model.groups=2"])
    assert "divisible by model.groups" in str(err)


def test_gcn_gat_and_self_loop_keys():
    """``model.arch: gcn``, GAT's ``output_heads`` and ``dataset.self_loops`` validate and
    reach the resolved spec; gcn refuses graph self-loops."""
    gcn = resolve_spec(apply_overrides(BASE, ["model.arch=gcn"]))
    assert gcn.spec.model.arch == "gcn"
    gat = resolve_spec(apply_overrides(BASE, ["model.arch=gat", "model.output_heads=1",
                                              "dataset.self_loops=true"]))
    assert gat.spec.model.output_heads == 1
    assert gat.dataset_options["self_loops"] is True
    assert resolve_spec(apply_overrides(BASE, [])).dataset_options["self_loops"] is False
    err = problems(["model.arch=gat", "model.output_heads=0"])
    assert [p.path for p in err.problems] == ["model.output_heads"]
    err = problems(["model.arch=gcn", "dataset.self_loops=true"])
    assert [p.path for p in err.problems] == ["dataset.self_loops"]
    assert "adds every node's self term" in str(err) and "allowed: false" in str(err)
    auto = resolve_spec(apply_overrides(BASE, ["model.arch=gcn", "partition.k=auto",
                                               "partition.memory_budget=1GB"]))
    assert auto.spec.partition.k == "auto"  # the memory model replays the GCN


# ------------------------------------------------------------------- byte sizes


@pytest.mark.parametrize(("text", "expected"), [
    (1024, 1024), ("512MiB", 512 * 2**20), ("24GiB", 24 * 2**30), ("1.5GB", 1_500_000_000),
    ("24 gib", 24 * 2**30), ("100", 100), ("2KB", 2000), (2.0**20, 2**20), ("0.5KiB", 512),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["24 gigs", "-1GB", "GB", "1.5", -5, True, 0.5, "1e9"])
def test_parse_bytes_refuses(bad):
    with pytest.raises(ValueError, match="allowed"):
        parse_bytes(bad)


def test_format_bytes():
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(24 * 2**30) == "24 GiB"
    assert format_bytes(None) == "-"


# -------------------------------------------------------------------- overrides


def test_overrides_are_yaml_and_create_sections():
    parsed = parse_overrides(["train.epochs=3", "sampling.fanouts=[5, 10]; partition.reuse=null",
                              "dataset.split_by=random"])
    assert parsed == [(["train", "epochs"], 3), (["sampling", "fanouts"], [5, 10]),
                      (["partition", "reuse"], None), (["dataset", "split_by"], "random")]
    out = apply_overrides({"name": "x"}, ["evaluate.every=0"])
    assert out == {"name": "x", "evaluate": {"every": 0}}
    assert BASE["train"] == {"epochs": 1}  # the input is not modified


def test_override_errors_name_the_key():
    with pytest.raises(SpecError, match="key.path=value"):
        parse_overrides(["train.epochs"])
    with pytest.raises(SpecError, match=r"train\.epochs = 1: is not a mapping"):
        apply_overrides(BASE, ["train.epochs.x=1"])


# --------------------------------------------------------------- references/hash


def _write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


def test_spec_reference_forms(tmp_path, monkeypatch):
    spec = _write(tmp_path / "mine.yaml", yaml.safe_dump(BASE))
    assert find_spec(str(spec)) == spec.resolve()
    assert find_spec("tiny") == (specs_dir() / "tiny.yaml").resolve()
    assert find_spec("tiny.yaml") == find_spec("tiny")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "specs").mkdir()
    local = _write(tmp_path / "specs" / "local.yaml", yaml.safe_dump(BASE))
    assert find_spec("local") == local.resolve()
    with pytest.raises(SpecError, match="no such spec file.*synthetic"):
        find_spec("nonexistent-spec")


def test_name_defaults_to_file_stem(tmp_path):
    raw = {k: v for k, v in BASE.items() if k != "name"}
    spec = _write(tmp_path / "stem_name.yaml", yaml.safe_dump(raw))
    assert load_spec(spec).name == "stem_name"


def test_yaml_errors_are_spec_errors(tmp_path):
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(_write(tmp_path / "bad.yaml", "dataset: [unclosed\n"))
    with pytest.raises(SpecError, match="must be a YAML mapping"):
        load_spec(_write(tmp_path / "list.yaml", "- 1\n- 2\n"))


def test_content_hash_ignores_name_and_defaults_but_not_content():
    a = resolve_spec(apply_overrides(BASE, []))
    renamed = resolve_spec(apply_overrides(BASE, ["name=other", "description=same content"]))
    explicit_defaults = resolve_spec(apply_overrides(BASE, ["train.lr=0.01", "dataset.scale=1.0",
                                                           "partition.memory_budget=null"]))
    edited = resolve_spec(apply_overrides(BASE, ["train.epochs=2"]))
    assert a.sha == renamed.sha == explicit_defaults.sha
    assert edited.sha != a.sha
    # stage keys: a training edit leaves the data stages' keys alone
    for stage in ("download", "sample", "partition"):
        assert edited.stage_sha(stage) == a.stage_sha(stage)
    for stage in ("train", "evaluate"):
        assert edited.stage_sha(stage) != a.stage_sha(stage)
    sweep_edit = resolve_spec(apply_overrides(BASE, ["partition.sweep.k=[2]"]))
    assert sweep_edit.stage_sha("partition") != a.stage_sha("partition")
    assert sweep_edit.stage_sha("train") == a.stage_sha("train")
    assert a.stage_sha("train", {"device": "cpu"}) != a.stage_sha("train", {"device": "cuda"})


def test_params_are_flat_with_prefix():
    params = resolve_spec(apply_overrides(BASE, [])).params()
    assert params["spec.train.epochs"] == "1"
    assert params["spec.sampling.fanouts"] == "[3, 4]"
    assert params["spec.dataset.num_nodes"] == "300"
    assert all(k.startswith("spec.") for k in params)


def test_every_shipped_spec_validates():
    paths = shipped_specs()
    names = {p.stem for p in paths}
    assert {"synthetic", "synthetic_products", "products_lstm", "products_sage_mean", "arxiv_sage",
            "arxiv_gat", "reddit_sage", "tiny"} <= names
    for path in paths:
        r = load_spec(path)
        assert r.spec.description, f"{path.name} needs a one-line description"
        assert "\n" not in r.spec.description.strip()
        assert path.read_text().lstrip().startswith("#"), f"{path.name} needs its paper configuration comment"


def test_train_threads_is_validated_and_applied():
    import torch

    from workflow.components import configure_threads

    with pytest.raises(SpecError, match="train.threads"):
        load_spec("tiny", ["train.threads=0"])
    before = torch.get_num_threads()
    try:
        configure_threads(load_spec("tiny", ["train.threads=1"]))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_partition_time_limit_and_determinism_reach_the_plan(monkeypatch):
    import os

    from workflow.components import partition_options, partition_plan

    rspec = resolve_spec(apply_overrides(BASE, [
        "partition.time_limit_s=60", "partition.deterministic=true", "train.threads=1"]))
    opts = partition_options(rspec)
    assert opts == {"time_limit_s": 60.0, "deterministic": True, "threads": 1}
    assert partition_plan(rspec).options == opts
    from betty.threads import available_cores

    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # an idle machine
    assert partition_options(resolve_spec(BASE)) == {  # threads: auto, before the graph is known
        "time_limit_s": None, "deterministic": False, "threads": available_cores()}
    err = problems(["partition.time_limit_s=0"])
    assert {p.path for p in err.problems} == {"partition.time_limit_s"}
