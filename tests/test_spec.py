"""Spec schema, overrides, spec references, byte sizes and content hashes."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from betty.sizes import format_bytes, parse_bytes
from workflow.spec import SpecError
from workflow.specfile import (
    STAGES,
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
    ("partition.method=kmeans", "partition.method", "'kmeans'", "'hypergraph'"),
    ("model.aggregator=max", "model.aggregator", "'max'", "'lstm'"),
    ("model.arch=gcn2", "model.arch", "'gcn2'", "'revgnn'"),
    ("train.epochs='3'", "train.epochs", "'3'", "integer"),
    ("train.lr=true", "train.lr", "True", "number"),
    ("train.device=tpu9", "train.device", "'tpu9'", "cpu"),
    ("train.optimizer=lbfgs", "train.optimizer", "'lbfgs'", "'adam'"),
    ("sampling.fanouts=[3, 0]", "sampling.fanouts[1]", "0", "-1"),
    ("sampling.batch_size=half", "sampling.batch_size", "'half'", "'full'"),
    ("model.dropout=1.5", "model.dropout", "1.5", "less than 1"),
    ("model.dropout=0.99999999", "model.dropout", "0.99999999", "at most 1 - 2^-24"),
    ("dataset.name=ogbn-prodcts", "dataset.name", "'ogbn-prodcts'", "'ogbn-products'"),
    ("dataset.num_nodes=1", "dataset.num_nodes", "1", "integer >= 2"),
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


@pytest.mark.parametrize(("override", "path", "allowed_text"), [
    ("dataset.colour=red", "dataset.colour", "num_nodes"),
    ("train.foo=1", "train.foo", "epochs"),
    ("train.password=hunter2", "train.password", "epochs"),
])
def test_unknown_keys_name_the_path_not_the_value(override, path, allowed_text):
    """An unknown key's value may be any text of the file: the message names the key path
    and the allowed keys, never the value."""
    err = problems([override])
    assert len(err.problems) == 1, str(err)
    text = str(err.problems[0])
    assert text.startswith(f"{path}: unknown"), text
    assert allowed_text in text, text
    assert override.split("=")[1] not in str(err), text


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


def test_a_semicolon_separates_assignments_only_before_a_key_path():
    """``;`` splits one ``--set`` into assignments where ``key.path=`` (or nothing)
    follows it; elsewhere it belongs to the value."""
    parsed = parse_overrides(["dataset.root=/data/a;b", "name='x;y'; train.epochs=2;;",
                              "dataset.root=/d; model.layers=3"])
    assert parsed == [(["dataset", "root"], "/data/a;b"), (["name"], "x;y"),
                      (["train", "epochs"], 2), (["dataset", "root"], "/d"), (["model", "layers"], 3)]


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
    # a stem with characters a name may not hold: they become "-" (not a refused name key)
    assert load_spec(_write(tmp_path / "my+spec v2.yaml", yaml.safe_dump(raw))).name == "my-spec-v2"
    assert load_spec(_write(tmp_path / "_draft.yaml", yaml.safe_dump(raw))).name == "spec"


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


def test_stage_keys_follow_what_each_stage_reads():
    """The sample stage's key follows the architecture (revgnn samples nothing); the
    partition stage's the train keys its estimates and K search read, not the others."""
    a = resolve_spec(apply_overrides(BASE, []))

    def edited(*overrides):
        return resolve_spec(apply_overrides(BASE, list(overrides)))

    rev = edited("model.arch=revgnn", "model.aggregator=mean")
    assert rev.stage_sha("sample") != a.stage_sha("sample")
    other_fanouts = edited("model.arch=revgnn", "model.aggregator=mean", "sampling.fanouts=[2, 3]")
    assert all(other_fanouts.stage_sha(s) == rev.stage_sha(s) for s in STAGES)  # revgnn reads none
    assert edited("sampling.fanouts=[2, 3]").stage_sha("sample") != a.stage_sha("sample")
    assert edited("model.hidden=32").stage_sha("sample") == a.stage_sha("sample")
    for change in ("train.optimizer=sgd", "train.precision=64", "train.world_size=2"):
        assert edited(change).stage_sha("partition") != a.stage_sha("partition"), change
        assert edited(change).stage_sha("sample") == a.stage_sha("sample"), change
    for change in ("train.lr=0.5", "train.epochs=3", "train.threads=1"):
        assert edited(change).stage_sha("partition") == a.stage_sha("partition"), change
    # where the graph is held is read by the trainers alone; sampling on the CPU as torch
    # ops gives the host's batches (sampling on CUDA draws others)
    store_ip_config = Path(__file__).with_name("graphs.py")  # any existing file
    for changes in (["dataset.store=distributed", "dataset.store_method=random",
                     f"dataset.store_ip_config={store_ip_config}"], ["sampling.device=cpu"],
                    ["sampling.device=cpu:0"]):
        changed = [s for s in STAGES if edited(*changes).stage_sha(s) != a.stage_sha(s)]
        assert changed == ["train", "evaluate"], changes
    cuda = edited("sampling.device=cuda", "train.device=auto", "train.pipeline=false")
    assert cuda.stage_sha("sample") != a.stage_sha("sample")
    from workflow.reuse import stage_runtime  # the memory model's constants are the device's

    assert a.stage_sha("partition", stage_runtime("partition", "cpu", a)) != \
        a.stage_sha("partition", stage_runtime("partition", "cuda:0", a))


def test_the_stages_that_depend_on_the_framework_are_keyed_by_the_one_auto_resolves_to(monkeypatch):
    """``model.backend: auto`` is DGL where it imports, else PyG: the same spec content
    gives other estimates, K and floats, so the partition, train and evaluate keys hold
    the framework ``auto`` resolved to and its and torch's versions."""
    import betty.backends
    from workflow import provenance
    from workflow.reuse import stage_runtime

    rspec = resolve_spec(apply_overrides(BASE, ["model.backend=auto"]))
    here = {stage: stage_runtime(stage, "cpu", rspec) for stage in STAGES}
    assert here["train"]["backend"] == provenance.backend_version("auto")
    assert here["train"]["backend"].startswith(betty.backends.resolve_backend("auto") + " (")
    assert "torch " in here["train"]["backend"]
    provenance.backend_version.cache_clear()
    monkeypatch.setattr(betty.backends, "resolve_backend", lambda name, **_: "pyg")
    try:
        there = {stage: stage_runtime(stage, "cpu", rspec) for stage in STAGES}
    finally:
        provenance.backend_version.cache_clear()
    assert there["train"]["backend"].startswith("pyg (torch_geometric ")
    changed = [s for s in STAGES if rspec.stage_sha(s, here[s]) != rspec.stage_sha(s, there[s])]
    assert changed == (["partition", "train", "evaluate"] if here["train"]["backend"].startswith("dgl")
                       else [])


def test_partitioner_library_versions_change_the_keys_of_the_stages_that_split(monkeypatch):
    """Another METIS, KaMinPar, Mt-KaHyPar, NumPy or SciPy may cut another split: the keys
    of the partition stage and of the train stage, which trains on the split (and is
    looked up by ``betty stage evaluate`` whatever its upstream), hold their versions;
    evaluate follows through its upstream train run."""
    from workflow import provenance, reuse

    rspec = resolve_spec(BASE)
    here = {stage: rspec.stage_sha(stage, reuse.stage_runtime(stage, "cpu", rspec)) for stage in STAGES}
    assert "pymetis " in provenance.partitioner_versions() and "mtkahypar " in provenance.partitioner_versions()
    monkeypatch.setattr(reuse, "partitioner_versions", lambda: "pymetis 0.0")
    there = {stage: rspec.stage_sha(stage, reuse.stage_runtime(stage, "cpu", rspec)) for stage in STAGES}
    assert [s for s in STAGES if here[s] != there[s]] == ["partition", "train"]


def test_calibrated_constants_change_the_keys_of_the_stages_that_split(tmp_path, monkeypatch):
    """``betty calibrate`` writes constants the partition stage sizes its split with: its
    reuse key and the train stage's change with them (evaluate follows through its
    upstream train run), the others' do not."""
    import json

    from betty.memory.constants import default_backend
    from workflow.reuse import stage_runtime

    monkeypatch.setenv("BETTY_MEMORY_CONSTANTS", str(tmp_path / "constants.json"))
    rspec = resolve_spec(apply_overrides(BASE, []))
    before = {stage: stage_runtime(stage, "cpu", rspec) for stage in STAGES}
    (tmp_path / "constants.json").write_text(json.dumps({default_backend("cpu"): {"granule_bytes": 4096}}))
    after = {stage: stage_runtime(stage, "cpu", rspec) for stage in STAGES}
    assert [stage for stage in STAGES if before[stage] != after[stage]] == ["partition", "train"]


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


def test_sampling_device_is_validated_and_reaches_the_trainer():
    from workflow.components import sample_device

    assert sample_device(load_spec("tiny", [])) is None
    assert sample_device(load_spec("tiny", ["sampling.device=cpu"])) == "cpu"
    assert sample_device(load_spec("tiny", ["sampling.device=cuda:1", "train.pipeline=false"])) == "cuda:1"
    for bad in ("auto", "gpu", "7"):
        with pytest.raises(SpecError, match="sampling.device"):
            load_spec("tiny", [f"sampling.device={bad}"])


def test_preparing_on_cuda_needs_the_training_device_and_no_pipeline():
    with pytest.raises(SpecError, match="train.pipeline = True: must be false with sampling.device 'cuda'"):
        load_spec("tiny", ["sampling.device=cuda", "train.device=cuda"])
    with pytest.raises(SpecError, match="sampling.device = 'cuda': prepares batches on the training device"):
        load_spec("tiny", ["sampling.device=cuda", "train.device=cpu", "train.pipeline=false"])
    for train_device in ("auto", "cuda", "cuda:0"):
        load_spec("tiny", ["sampling.device=cuda", f"train.device={train_device}", "train.pipeline=false"])
    load_spec("tiny", ["sampling.device=cpu", "train.device=cpu"])  # the CPU path pipelines


def test_train_prep_workers_is_validated_and_applied(monkeypatch):
    import torch

    from betty import workers
    from workflow.components import configure_threads

    for bad in ("0", "-2", "1.5", "many"):
        with pytest.raises(SpecError, match="train.prep_workers"):
            load_spec("tiny", [f"train.prep_workers={bad}"])
    before = torch.get_num_threads()
    monkeypatch.setattr("betty.threads.available_cores", lambda *a: 6)
    try:
        configure_threads(load_spec("tiny", ["train.prep_workers=3"]))
        assert workers.prep_workers() == 3
        configure_threads(load_spec("tiny", ["train.threads=2"]))  # auto: 6 cores - 2 threads
        assert workers.prep_workers() == 4
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks of 2 threads on 6 cores
        configure_threads(load_spec("tiny", ["train.threads=2"]))
        assert workers.prep_workers() == 1
    finally:
        torch.set_num_threads(before)
        workers.set_prep_workers("auto")


@pytest.mark.parametrize("override", ["train.prefetch=0", "train.prefetch=17", "train.prefetch=1.5",
                                      "train.pipeline=sometimes"])
def test_train_pipeline_and_prefetch_are_validated(override):
    with pytest.raises(SpecError, match=override.split("=")[0]):
        load_spec("tiny", [override])


@pytest.mark.parametrize("overrides,prefetch", [([], 1), (["train.prefetch=3"], 3),
                                                (["train.pipeline=false", "train.prefetch=3"], 0)])
def test_train_pipeline_reaches_the_trainer(overrides, prefetch):
    import torch

    from workflow.components import load_data, make_trainer

    rspec = load_spec("tiny", overrides)
    before = torch.get_num_threads()
    try:  # load_data applies train.threads
        trainer, _, _ = make_trainer(rspec, load_data(rspec), torch.device("cpu"))
    finally:
        torch.set_num_threads(before)
    assert trainer.prefetch == prefetch


def test_partition_time_limit_and_determinism_reach_the_plan(monkeypatch):
    import os

    from workflow.components import partition_options, partition_plan

    rspec = resolve_spec(apply_overrides(BASE, [
        "partition.time_limit_s=60", "partition.deterministic=true", "train.threads=1",
        "partition.partitioner=kaminpar"]))
    opts = partition_options(rspec)
    assert opts == {"time_limit_s": 60.0, "deterministic": True, "threads": 1,
                    "partitioner": "kaminpar", "trainer_threads": 1}
    assert partition_plan(rspec).options == opts
    from betty.threads import available_cores

    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # an idle machine
    assert partition_options(resolve_spec(BASE)) == {  # threads: auto, before the graph is known
        "time_limit_s": None, "deterministic": False, "threads": available_cores(),
        "partitioner": "metis", "trainer_threads": available_cores()}
    err = problems(["partition.time_limit_s=0"])
    assert {p.path for p in err.problems} == {"partition.time_limit_s"}


# ------------------------------------------------------------- reading spec files


def _spec_yaml(**sections) -> str:
    return yaml.safe_dump({**BASE, **sections})


def test_only_yaml_files_are_specs(tmp_path, monkeypatch):
    """A readable file without a .yaml/.yml name is refused unread, so its content
    cannot reach an error message; the stem lookup only finds .yaml/.yml files."""
    text = _spec_yaml()
    for name in ("notes.txt", "passwd", "spec.yaml.bak"):
        other = _write(tmp_path / name, text)
        with pytest.raises(SpecError, match="not a spec file; a spec is a .yaml or .yml file") as info:
            load_spec(other)
        assert [p.path for p in info.value.problems] == ["spec"]
    link = tmp_path / "link.yaml"
    link.symlink_to(tmp_path / "passwd")
    with pytest.raises(SpecError, match="not a spec file"):
        load_spec(link)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "specs").mkdir()
    _write(tmp_path / "specs" / "bare", text)
    with pytest.raises(SpecError, match="no such spec file"):
        find_spec("bare")
    assert load_spec(_write(tmp_path / "ok.yml", text)).name == "t"


def test_a_file_that_is_no_spec_gets_one_message_without_its_content(tmp_path):
    """A YAML mapping none of whose top-level keys is a spec key (a config file of some
    other program) is refused in one message naming the file; its lines are not echoed."""
    path = _write(tmp_path / "other.yaml", "root_password: hunter2\napi_token: s3cr3t\nhost: db1\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert len(info.value.problems) == 1
    text = str(info.value)
    assert "is not a betty spec" in text and str(path) in text
    for secret in ("hunter2", "s3cr3t", "root_password", "api_token", "db1"):
        assert secret not in text
    long_key = "k" * 5000
    with pytest.raises(SpecError) as info:
        load_spec(_write(tmp_path / "long.yaml", _spec_yaml(train={long_key: 1})))
    assert len(str(info.value)) < 1000 and "train.kkk" in str(info.value)


@pytest.mark.parametrize(("name", "data"), [
    ("latin1.yaml", ("description: caf\u00e9\n" + _spec_yaml()).encode("latin-1")),
    ("utf16.yaml", _spec_yaml().encode("utf-16")),
    ("utf16le.yaml", _spec_yaml().encode("utf-16-le")),  # no BOM: ASCII with NUL bytes
    ("binary.yaml", bytes(range(256)) * 4),
])
def test_non_utf8_files_are_refused_cleanly(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert [str(p) for p in info.value.problems] == [f"spec = {str(path)!r}: is not UTF-8 text; "
                                                     "a spec is a YAML text file in UTF-8"]


def test_oversized_file_is_refused_unparsed(tmp_path):
    from workflow.specfile import MAX_SPEC_BYTES

    path = _write(tmp_path / "big.yaml", _spec_yaml() + "#" * MAX_SPEC_BYTES)
    with pytest.raises(SpecError, match="larger than 1 MiB"):
        load_spec(path)


def test_duplicate_keys_are_errors_naming_key_and_lines(tmp_path):
    text = _spec_yaml() + "train:\n  epochs: 1000\n"
    first = 1 + [line.split(":")[0] for line in _spec_yaml().splitlines()].index("train")
    last = len(_spec_yaml().splitlines()) + 1
    with pytest.raises(SpecError) as info:
        load_spec(_write(tmp_path / "dup.yaml", text))
    msg = str(info.value)
    assert f"duplicate key 'train' (lines {first} and {last})" in msg, msg
    nested = "dataset: {name: synthetic, num_nodes: 300, num_nodes: 400}\n"
    with pytest.raises(SpecError, match=r"dup2.yaml:1:\d+': is not valid YAML: duplicate key 'num_nodes' "
                                        r"\(lines 1 and 1\)"):
        load_spec(_write(tmp_path / "dup2.yaml", nested))
    with pytest.raises(SpecError, match="duplicate key 'a'"):
        parse_overrides(["dataset.x={a: 1, a: 2}"])


@pytest.mark.parametrize(("text", "expected"), [
    ("1e-3", 0.001), ("1E-3", 0.001), ("5e2", 500.0), ("1.0e-3", 0.001), ("+.5", 0.5), ("-2.5", -2.5),
    ("3", 3), ("-1", -1), ("1_000", 1000), ("0x10", 16), (".inf", float("inf")), ("true", True),
    ("1:30", "1:30"), ("010", "010"), ("1:30.5", "1:30.5"),
])
def test_yaml_numbers_follow_yaml_1_2(text, expected):
    """``1e-3`` is a float (YAML 1.1 reads a string), base-60 ``1:30`` (YAML 1.1: 90) and
    leading-zero octal ``010`` (YAML 1.1: 8) stay strings, which validation refuses."""
    from workflow.specfile import parse_yaml

    value = parse_yaml(f"v: {text}")["v"]
    assert value == expected and type(value) is type(expected), (text, value)


def test_yaml_1_1_quirks_do_not_reach_the_spec(tmp_path):
    text = _spec_yaml().replace("epochs: 1", "epochs: 1:30\n  lr: 1e-3")
    err = pytest.raises(SpecError, load_spec, _write(tmp_path / "sexa.yaml", text)).value
    assert [str(p) for p in err.problems] == ["train.epochs = '1:30': Input should be a valid integer"]
    ok = load_spec(_write(tmp_path / "ok.yaml", _spec_yaml().replace("epochs: 1", "epochs: 1\n  lr: 1e-3")))
    assert ok.spec.train.lr == 0.001
    assert load_spec(_write(tmp_path / "o.yaml", _spec_yaml()), ["train.lr=5e-4"]).spec.train.lr == 5e-4
    err = pytest.raises(SpecError, load_spec, tmp_path / "o.yaml", ["train.epochs=1:30"]).value
    assert [p.path for p in err.problems] == ["train.epochs"]


def test_alias_bomb_is_refused_fast(tmp_path):
    import time

    lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    bomb = "\n".join(lines) + "\ndataset: {name: synthetic, bomb: *a9}\n"
    assert len(bomb) < 1100
    path = _write(tmp_path / "bomb.yaml", _spec_yaml() + bomb.replace("dataset:", "extra:"))
    start = time.perf_counter()
    with pytest.raises(SpecError, match=r"bomb.yaml:\d+:\d+': is not valid YAML: aliases \(\*name\) are "
                                        r"not allowed in a spec"):
        load_spec(path)
    with pytest.raises(SpecError, match="aliases"):
        parse_overrides(["dataset.x=[&a 1, *a]"])
    assert time.perf_counter() - start < 2.0


def test_deep_nesting_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="nested too deeply"):
        load_spec(_write(tmp_path / "deep.yaml", "train: " + "[" * 5000 + "]" * 5000 + "\n"))


# ----------------------------------------------------------- bounds at validation


@pytest.mark.parametrize(("override", "path", "allowed_text"), [
    ("train.lr=.inf", "train.lr", "finite"),
    ("train.lr=.nan", "train.lr", "finite"),
    ("train.weight_decay=.inf", "train.weight_decay", "finite"),
    ("partition.time_limit_s=.inf", "partition.time_limit_s", "finite"),
    ("partition.sweep.time_limit_s=.inf", "partition.sweep.time_limit_s", "finite"),
    ("sampling.seed=1180591620717411303424", "sampling.seed", "4294967295"),
    ("train.seed=1180591620717411303424", "train.seed", "4294967295"),
    ("dataset.seed=1180591620717411303424", "dataset.seed", "0 to 4294967295"),
    ("dataset.scale=.inf", "dataset.scale", "finite"),
    ("dataset.feature_snr=.inf", "dataset.feature_snr", "finite"),
    ("model.hidden=1000000000", "model.hidden", "16384"),
    ("model.layers=100000", "model.layers", "1024"),
    ("partition.memory_budget=0", "partition.memory_budget", "more than 0 bytes"),
    ("partition.k=31", "partition.k", "larger than a batch's output nodes (30 for this dataset); "
                                      "allowed: an integer from 1 to 30"),
    ("dataset.num_nodes=1000000000000", "dataset", "more than this machine's memory"),
    ("dataset.scale=1e12", "dataset", "more than this machine's memory"),
    ("dataset.num_features=1000000000", "dataset", "more than this machine's memory"),
    ("dataset.root=/proc", "dataset.root", "pseudo-filesystem"),
    ("dataset.root=/sys/kernel", "dataset.root", "pseudo-filesystem"),
    ("dataset.root=/dev", "dataset.root", "pseudo-filesystem"),
    ("dataset.root=~no-such-user-here/data", "dataset.root", "is not a usable path"),
    ('dataset.root="a\\0b"', "dataset.root", "is not a usable path (embedded null byte)"),
])
def test_values_that_fail_late_are_refused_at_validation(override, path, allowed_text):
    """Each of these used to validate and fail only once runs existed (or ran with NaN
    losses, or tried to allocate terabytes)."""
    err = problems([override])
    assert [p.path for p in err.problems] == [path], str(err)
    assert allowed_text in str(err), str(err)


def test_bounds_keep_their_edges_valid(tmp_path):
    ok = resolve_spec(apply_overrides(BASE, [
        "partition.k=30", "sampling.seed=4294967295", "train.seed=4294967295", "dataset.seed=4294967295",
        "model.hidden=16384", "train.lr=1e-3", f"dataset.root={tmp_path}", "dataset.root=/dev/shm/betty"]))
    assert ok.spec.partition.k == 30 and ok.spec.model.hidden == 16384
    assert problems(["sampling.batch_size=10", "partition.k=11"]).problems[0].path == "partition.k"
    rev = ["model.arch=revgnn", "model.hidden=8", "partition.method=random"]
    assert resolve_spec(apply_overrides(BASE, [*rev, "partition.k=300"])).spec.partition.k == 300
    assert "graph's nodes (300" in str(problems([*rev, "partition.k=301"]))
    gat = ["model.arch=gat", "model.hidden=4096", "model.heads=8"]
    assert "allowed: a product up to 16384" in str(problems(gat))


def test_dataset_root_at_a_file_is_refused(tmp_path):
    file = _write(tmp_path / "data", "x")
    err = problems([f"dataset.root={file}"])
    assert [p.path for p in err.problems] == ["dataset.root"] and "is not a folder" in str(err)


def test_train_threads_bounded_by_available_cores():
    import os

    from betty.threads import available_cores

    cores = len(os.sched_getaffinity(0))
    assert available_cores() == cores  # no CPU quota on this machine
    err = problems(["train.threads=1000000"])
    assert [str(p) for p in err.problems] == [
        "train.threads = 1000000: allowed: 'auto' (the idle cores, betty.threads), null (the "
        f"libraries' default) or an integer from 1 to {cores} (the CPU cores available to this process)"]
    assert resolve_spec(apply_overrides(BASE, ["train.threads=auto"])).spec.train.threads == "auto"
    assert resolve_spec(apply_overrides(BASE, [f"train.threads={cores}"])).spec.train.threads == cores
    assert resolve_spec(apply_overrides(BASE, ["train.threads=null"])).spec.train.threads is None
    for bad in ("0", "true", "'2'", "1.0", "Auto"):
        assert problems([f"train.threads={bad}"]).problems[0].path == "train.threads"


DGL_FILE = ["sampling.fanouts=[3, 4]"]


def _dgl_file(options: dict) -> list[str]:
    return [f"dataset={yaml.safe_dump({'name': 'dgl-file', **options}, default_flow_style=True).strip()}"]


def test_dgl_file_with_path_and_num_classes_validates(tmp_path):
    missing = str(tmp_path / "graph.bin")  # a missing file is a warning of `betty validate`
    r = resolve_spec(apply_overrides(BASE, _dgl_file({"path": missing, "num_classes": 7})))
    assert r.dataset_options == {"path": missing, "num_classes": 7, "self_loops": False}
    err = problems(_dgl_file({"num_classes": 7}))
    assert [p.path for p in err.problems] == ["dataset"] and "needs option path" in str(err)
    err = problems(_dgl_file({"path": missing, "num_classes": 0}))
    assert [p.path for p in err.problems] == ["dataset.num_classes"]


def test_dgl_file_at_a_non_graph_file_is_refused_at_validation(tmp_path):
    from betty.data.dgl_file import DGL_FILE_MAGIC, is_dgl_file

    junk = tmp_path / "notes.bin"
    junk.write_bytes(b"hello world\n" * 10)
    err = problems(_dgl_file({"path": str(junk)}))
    assert [p.path for p in err.problems] == ["dataset.path"] and "not a dgl.save_graphs file" in str(err)
    assert "hello" not in str(err)
    assert problems(_dgl_file({"path": "/proc/self/environ"})).problems[0].path == "dataset.path"
    headed = tmp_path / "headed.bin"
    headed.write_bytes(DGL_FILE_MAGIC + b"\0" * 8)
    assert is_dgl_file(headed) and not is_dgl_file(junk) and not is_dgl_file(tmp_path)
    resolve_spec(apply_overrides(BASE, _dgl_file({"path": str(headed)})))


@pytest.mark.dgl
def test_dgl_file_loader_refuses_non_graph_files_without_a_backtrace(tmp_path):
    from betty.data.dgl_file import DGL_FILE_MAGIC, load_dgl_file

    junk = tmp_path / "notes.bin"
    junk.write_bytes(b"hello world\n" * 10)
    with pytest.raises(ValueError, match="not a dgl.save_graphs file") as info:
        load_dgl_file(junk)
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(DGL_FILE_MAGIC + b"\1" * 12)
    with pytest.raises(ValueError, match="DGL cannot read it") as info2:
        load_dgl_file(truncated)
    for err in (info.value, info2.value):
        assert "Stack trace" not in str(err) and "[bt]" not in str(err) and "\n" not in str(err)


def test_feature_dtype_keys_bfloat16_runs_and_leaves_float32_hashes(tmp_path):
    """``dataset.feature_dtype``: float32 (given or not) keeps the spec's hashes, stage
    keys and dataset options as they were before the key was hashed (the values below
    are those hashes of ``BASE``); bfloat16 gets its own, and ``load_data`` hands the
    option to the loader, which maps the bfloat16 cache entry."""
    from workflow.components import load_data

    pinned = ("fa679da340e80686",
              ["573c0e1e9a9123db", "e48453b797af3ad3", "04e3794b30af705b", "ffac4a0d180ac12a", "dc4758a758716b81"])
    stages = ("download", "sample", "partition", "train", "evaluate")
    plain = resolve_spec(apply_overrides(BASE, []))
    f32 = resolve_spec(apply_overrides(BASE, ["dataset.feature_dtype=float32"]))
    for r in (plain, f32):
        assert (r.sha, [r.stage_sha(s) for s in stages]) == pinned
        assert "feature_dtype" not in r.dataset_options and "feature_dtype" not in r.data["dataset"]
    bf16 = resolve_spec(apply_overrides(BASE, ["dataset.feature_dtype=bfloat16", f"dataset.root={tmp_path}"]))
    assert bf16.dataset_options["feature_dtype"] == "bfloat16"
    assert bf16.stage_sha("sample") != resolve_spec(apply_overrides(BASE, [f"dataset.root={tmp_path}"])).stage_sha("sample")
    ds = load_data(bf16)
    from betty.data import cache_path
    from test_data_cache import _mapped_file

    entry = cache_path("synthetic", tmp_path, **bf16.dataset_options)
    assert ds.feat.dtype == torch.bfloat16 and _mapped_file(ds.feat) == str(entry / "feat.bin")


def test_the_distributed_store_keys_are_checked_and_kept_out_of_the_dataset_options():
    base = ["dataset.store=distributed", "dataset.store_ip_config=ip.txt"]
    rspec = load_spec("tiny", base)
    assert rspec.spec.dataset.store == "distributed"
    assert rspec.data["dataset"]["store"] == "distributed"  # in the stage keys once set
    assert not {"store", "store_ip_config"} & set(rspec.dataset_options)  # not a loader option
    plain = load_spec("tiny", [])
    assert "store" not in plain.data["dataset"]  # at its default: the hashes specs had before
    assert load_spec("tiny", ["dataset.store=local"]).sha == plain.sha
    cases = [
        (["dataset.store=remote"], "dataset.store = 'remote': unknown store; allowed: 'local', 'distributed'"),
        (["dataset.store=distributed"], "dataset.store_ip_config: is required with dataset.store distributed"),
        (["dataset.store_folder=x"], "dataset.store_folder = 'x': applies to dataset.store distributed only"),
        ([*base, "dataset.store_method=kway"], "unknown store method; allowed: 'metis', 'random'"),
        ([*base, "model.backend=pyg"], "needs model.backend dgl or auto, not pyg"),
        ([*base, "sampling.device=cpu"], "sampling.device = 'cpu': must be host with dataset.store distributed"),
    ]
    for overrides, words in cases:
        with pytest.raises(SpecError) as err:
            load_spec("tiny", overrides)
        assert words in str(err.value), (overrides, str(err.value))
    with pytest.raises(SpecError, match="model.arch revgnn trains on the whole graph"):
        load_spec("synthetic_revgnn", base)


@pytest.mark.parametrize("overrides, path, words", [
    (["train.device=meta"], "train.device", "betty trains on cpu and cuda devices only"),
    (["sampling.device=meta", "train.pipeline=false"], "sampling.device", "allowed: 'host'"),
    (["evaluate.select=best_valid", "evaluate.every=2"], "evaluate.every", "from 1 to train.epochs = 1 with evaluate.select"),
    (["train.early_stopping={patience: 1}", "train.epochs=3", "evaluate.every=4"], "evaluate.every",
     "from 1 to train.epochs = 3 with train.early_stopping"),
    (["model.arch=revgnn", "sampling.fanouts=null", "train.precision=bf16-mixed"], "train.precision",
     "is not supported for model.arch revgnn"),
])
def test_settings_that_would_fail_or_do_nothing_in_a_stage_are_refused(overrides, path, words):
    err = problems(overrides)
    assert [p.path for p in err.problems] == [path] and words in str(err), str(err)


def test_selection_within_the_epochs_and_mixed_precision_of_sampled_models_validate():
    resolve_spec(apply_overrides(BASE, ["evaluate.select=best_valid", "train.epochs=4", "evaluate.every=4"]))
    resolve_spec(apply_overrides(BASE, ["train.precision=bf16-mixed", "train.device=cuda:1"]))
