"""The ``betty`` CLI through Typer's runner (in-process)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from test_workflow_support import invoke, runs_of
from workflow.commands import command_modules
from workflow.specfile import STAGES

EXPERIMENT = "cli-test"  # the conftest tracking fixture's experiment
FAST = ["-s", "partition.sweep.k=[2]", "-s", "partition.sweep.methods=[range]"]


def test_commands_are_discovered():
    assert {"run", "stage", "validate", "specs", "compare", "verify", "partition"} <= set(command_modules())
    assert not any(name.startswith("_") for name in command_modules())


def test_version_and_plain_usage_lines():
    from betty import __version__

    res = invoke("--version")
    assert res.exit_code == 0 and res.stdout.strip() == f"betty {__version__}"
    for args, usage in ((["run"], "Usage: betty run [OPTIONS] SPEC\n"),
                        (["validate"], "Usage: betty validate [OPTIONS] SPEC...\n"),
                        (["stage"], "Usage: betty stage [OPTIONS] STAGE SPEC\n")):
        res = invoke(*args, "--help")
        assert res.exit_code == 0 and res.stdout.startswith(usage), res.stdout[:200]
        missing = invoke(*args)  # no SPEC: click's error, naming it the same way
        assert missing.exit_code == 2 and "{" not in missing.output, missing.output


def test_validate_exit_codes_and_messages():
    from workflow.specfile import shipped_specs

    specs = shipped_specs()
    ok = invoke("validate", *[str(p) for p in specs])
    assert ok.exit_code == 0 and ok.stdout.count("ok ") == len(specs)
    bad = invoke("validate", "tiny", "--set", "model.aggregator=max", "--set", "partition.memory_budget=24 gigs")
    assert bad.exit_code == 2
    assert "model.aggregator = 'max'" in bad.stderr and "partition.memory_budget = '24 gigs'" in bad.stderr
    layers = invoke("validate", "tiny", "--set", "model.layers=3")
    assert layers.exit_code == 2 and "sampling.fanouts = [5, 5]" in layers.stderr
    assert "Traceback" not in bad.output
    missing = invoke("validate", "no-such-spec")
    assert missing.exit_code == 2 and "no such spec file" in missing.stderr
    out = json.loads(invoke("validate", "tiny", "--json").stdout)
    assert out["valid"] and out["specs"][0]["spec_sha"]


def test_spec_errors_exit_2_in_every_command(tracking):
    for args in (["run", "tiny"], ["stage", "train", "tiny"], ["verify", "tiny"], ["partition", "tiny"]):
        res = invoke(*args, "--set", "train.epochs=-1")
        assert res.exit_code == 2, args
        assert "train.epochs = -1" in res.stderr and "Traceback" not in res.output


def test_specs_lists_shipped_specs_with_descriptions():
    res = invoke("specs")
    assert res.exit_code == 0
    lines = {line.split()[0]: line for line in res.stdout.splitlines()}
    assert {"synthetic", "products_lstm", "arxiv_gat", "reddit_sage", "tiny"} <= set(lines)
    data = json.loads(invoke("specs", "--json").stdout)
    assert all(s["description"] for s in data["specs"])


def test_run_compare_and_stage(tracking):
    uri, exp = tracking
    res = invoke("run", "tiny", "--experiment", "cli-test", "--json", *FAST)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert set(out["stages"]) == set(STAGES)
    assert not any(s["reused"] for s in out["stages"].values())
    assert {"test_acc", "peak_mem_measured_bytes", "redundancy"} <= set(out["metrics"])
    runs = runs_of(uri, exp)
    assert len(runs) == 6 and {r.info.status for r in runs} == {"FINISHED"}

    table = invoke("compare", "--experiment", "cli-test")
    assert table.exit_code == 0 and "tiny" in table.stdout and "mem measured" in table.stdout
    rows = json.loads(invoke("compare", "--experiment", "cli-test", "--json").stdout)["runs"]
    assert len(rows) == 1
    row = rows[0]
    assert row["run_id"] == out["run_id"] and row["K"] == 2 and row["status"] == "FINISHED"
    assert row["mem measured"] > 0 and row["mem est"] > 0 and row["test"] == out["metrics"]["test_acc"]

    # a lone stage: evaluate finds the newest matching train run by itself
    res = invoke("stage", "evaluate", "tiny", "--experiment", "cli-test", "--json", *FAST)
    assert res.exit_code == 0, res.output
    ev = json.loads(res.stdout)
    assert ev["metrics"]["test_acc"] == pytest.approx(out["metrics"]["test_acc"])


def test_run_of_missing_real_dataset_fails_cleanly(tracking):
    uri, exp = tracking
    res = invoke("run", "reddit_sage", "--experiment", "cli-test")
    assert res.exit_code == 1
    assert "betty: DatasetNotFoundError" in res.stderr and "Traceback" not in res.output
    assert {r.info.status for r in runs_of(uri, exp)} == {"FAILED"}


def test_partition_json_and_save(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = invoke("partition", "tiny", "--k", "4", "--method", "hypergraph", "--json", "--save", str(tmp_path / "out"))
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert {"method", "k", "redundancy", "redundancy_per_layer", "imbalance", "time_build_s",
            "time_partition_s", "time_block_s"} <= set(out)
    assert out["method"] == "hypergraph" and out["k"] == 4 and len(out["redundancy_per_layer"]) == 2
    assert out["redundancy"] >= 1.0 and out["time_block_s"] > 0
    z = np.load(tmp_path / "out" / "batch.npz")
    assert {"outputs", "block0_src", "block0_dst", "block1_src", "block1_dst", "groups"} <= set(z.files)
    assert all(z[name].dtype == np.int64 for name in z.files)
    assert sorted(np.unique(z["groups"]).tolist()) == [0, 1, 2, 3]
    assert z["groups"].shape == z["outputs"].shape


def test_partition_hypergraph_time_limit_falls_back_to_reg(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = invoke("partition", "tiny", "--k", "4", "--method", "hypergraph", "--json",
                 "--set", "partition.time_limit_s=0.001")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["method"] == "reg" and out["fallback_from"] == "hypergraph"
    assert "partition.time_limit_s=0.001" in out["fallback_reason"]


def test_verify_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = invoke("verify", "tiny", "--k", "2,4", "--dtype", "float64", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["dtype"] == "float64" and [r["k"] for r in out["results"]] == [1, 2, 4]
    assert out["verdict"] == "PASS" and out["passed"] is True and out["tol"] == 1e-10
    assert all(r["max_rel_grad_diff"] < 1e-10 and r["loss_rel_diff"] < 1e-10 for r in out["results"])
    assert all(r["verdict"] == "PASS" and r["passed"] is True for r in out["results"])
    bad = invoke("verify", "tiny", "--k", "2,x")
    assert bad.exit_code == 2 and "comma-separated" in bad.stderr
    for command in (["verify", "tiny", "--k", "2,1000"], ["verify", "tiny", "--k", "2,1000", "--nproc", "2"],
                    ["partition", "tiny", "--k", "1000"], ["estimate", "tiny", "--k", "1000"]):
        above = invoke(*command)  # partition/estimate: the spec check sees --k as partition.k, when it knows the size
        assert above.exit_code == 2, (command, above.output)
        assert ("K must be at most the first batch's output nodes (40)" in above.stderr
                or "partition.k = 1000: is larger than a batch's output nodes (40" in above.stderr), above.output
    rev = invoke("verify", "tiny", "--set", "model.arch=revgnn", "--set", "partition.method=random")
    assert rev.exit_code == 2 and "model.arch revgnn trains on cluster parts" in rev.stderr
    assert invoke("stage", "nope", "tiny").exit_code == 2


def test_verify_verdict_and_negative_control(tmp_path, monkeypatch):
    """`betty verify` passes the synthetic spec (exit 0, PASS for every K) and fails the
    negative control, per-call dropout masks (exit 1, FAIL); --tol must be positive."""
    monkeypatch.chdir(tmp_path)
    good = invoke("verify", "synthetic", "--k", "4")
    assert good.exit_code == 0, good.output
    rows = [line.split() for line in good.stdout.splitlines() if line.strip().startswith("K=")]
    assert [r[0] for r in rows] == ["K=1", "K=4"] and all(r[1] == "PASS" for r in rows)
    assert good.stdout.strip().splitlines()[-1] == "PASS"
    bad = invoke("verify", "synthetic", "--set", "model.dropout_mode=standard", "--k", "4")
    assert bad.exit_code == 1, bad.output
    assert any(line.split()[:2] == ["K=4", "FAIL"] for line in bad.stdout.splitlines()
               if line.strip().startswith("K="))
    assert "more than 1.0e-05" in bad.stderr
    loose = invoke("verify", "synthetic", "--set", "model.dropout_mode=standard", "--k", "4",
                   "--tol", "10", "--json")
    assert loose.exit_code == 0 and json.loads(loose.stdout)["tol"] == 10.0
    for tol in ("0", "-1e-3"):
        res = invoke("verify", "synthetic", "--tol", tol)
        assert res.exit_code == 2 and "--tol must be > 0" in res.stderr


def test_cleanup_ends_runs_mlflow_left_running(tracking):
    import time

    from mlflow.tracking import MlflowClient

    uri, exp = tracking
    client = MlflowClient(uri)
    old = int((time.time() - 600) * 1000)
    stuck = client.create_run(exp, start_time=old, tags={
        "mlflow.project.entryPoint": "main", "mlflow.project.env": "conda"}).info.run_id
    ours = client.create_run(exp, start_time=old, tags={
        "mlflow.project.entryPoint": "train", "run_kind": "stage"}).info.run_id  # betty's: left alone
    listed = json.loads(invoke("cleanup", "--experiment", "cli-test", "--json").stdout)
    assert [r["run_id"] for r in listed["stale"]] == [stuck] and not listed["ended"]
    assert client.get_run(stuck).info.status == "RUNNING"
    assert invoke("cleanup", "--experiment", "cli-test", "--fail").exit_code == 0
    assert client.get_run(stuck).info.status == "FAILED"
    assert "env-manager local" in client.get_run(stuck).data.tags["error"]
    assert client.get_run(ours).info.status == "RUNNING"
    client.set_terminated(ours, "FAILED")


HEAVY = ("torch", "dgl", "torch_geometric")
PROBE = """
import runpy, sys, time
start = time.perf_counter()
sys.argv = ["betty", *sys.argv[1:]]
try:
    runpy.run_module("workflow.cli", run_name="__main__")
except SystemExit:
    pass
heavy = [m for m in {heavy!r} if m in sys.modules]
print("HEAVY=" + ",".join(heavy), file=sys.stderr)
"""


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["specs"], ["validate", "synthetic"],
                                  ["validate", "synthetic_products", "synthetic_revgnn", "cora_gat", "tiny"],
                                  ["compare", "--json"], ["cleanup", "--json"]])
def test_commands_without_tensors_import_no_framework(args, tmp_path):
    """In a fresh process, commands that need no tensors import neither torch nor a GNN
    framework, and take a bounded multiple of a bare interpreter's start."""
    import os
    import subprocess
    import sys
    import time

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "MLFLOW_DISABLE_TELEMETRY": "true",
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True, env=env, timeout=300)
    bare = time.perf_counter() - start
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *args], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    took = time.perf_counter() - start
    line = [x for x in res.stderr.splitlines() if x.startswith("HEAVY=")]
    assert line == ["HEAVY="], res.stderr[-2000:]
    if args[0] == "validate":
        assert res.returncode == 0 and res.stdout.count("ok ") == len(args) - 1, (res.stdout, res.stderr[-2000:])
    if args[0] in ("--help", "--version", "specs", "validate"):  # no MLflow either: a few interpreter starts
        assert took < 20 * bare + 10, (took, bare)


@pytest.mark.parametrize("args", [
    ["--nproc", "1", "--nnodes", "2", "--node-rank", "5", "--rdzv-endpoint", "127.0.0.1:1"],
    ["--nproc", "1", "--node-rank", "1"],
    ["--nnodes", "2"],
    ["--nproc", "1", "--nnodes", "2"],
    ["--nnodes", "0"],
    ["--node-rank", "-1"],
])
def test_bad_distributed_options_exit_2(args):
    """Refused before the spec is loaded or a run exists: exit 2, a message, no traceback."""
    res = invoke("run", "tiny", *args)
    assert res.exit_code == 2, (args, res.output)
    assert "Traceback" not in res.output and ("--node-rank" in res.output or "--nnodes" in res.output
                                              or "--nproc" in res.output), res.output


def test_unreadable_and_non_spec_files_exit_2(tmp_path):
    utf16 = tmp_path / "utf16.yaml"
    utf16.write_text("name: x\n", encoding="utf-16")
    other = tmp_path / "passwd"
    other.write_text("root: x\n")
    for path, text in ((utf16, "is not UTF-8 text"), (other, "not a spec file")):
        res = invoke("validate", str(path))
        assert res.exit_code == 2 and text in res.stderr and "Traceback" not in res.output, res.output
        assert "root" not in res.stderr.replace(str(path), "")


def test_partition_and_estimate_refuse_a_k_above_the_first_batch_the_spec_could_not_size(tmp_path, monkeypatch):
    """A dataset whose size the spec check does not know (a dgl-file): the commands
    check --k against the first batch they would split, rather than quietly use fewer."""
    import workflow.spec

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(workflow.spec, "_k_size_problems", lambda spec: [])
    for command in ("partition", "estimate"):
        above = invoke(command, "tiny", "--k", "1000")
        assert above.exit_code == 2, above.output
        assert "--k 1000: K must be at most the first batch's output nodes (40)" in above.stderr, above.output


def test_usage_errors_exit_2_before_any_run_exists(tracking, tmp_path, monkeypatch):
    """A stage that cannot find its upstream, a command given a device or a model it
    does not cover, a malformed filter or experiment: exit 2, a clear line, no run."""
    import mlflow

    uri, exp = tracking
    cases = [
        (("stage", "evaluate", "tiny"), "the evaluate stage needs a train run of this spec"),
        (("estimate", "synthetic_revgnn", "-s", "model.deq=true"), "does not cover model.deq: true"),
        (("calibrate", "--device", "bogus", "--no-write"), "--device 'bogus': not a torch device"),
        (("calibrate", "--device", "meta", "--no-write"), "--device 'meta': betty trains on cpu and cuda devices only"),
        (("compare", "--spec", "it's"), "is not a spec name"),
    ]
    for args, words in cases:
        res = invoke(*args)
        assert res.exit_code == 2 and words in res.stderr, (args, res.output)
    assert mlflow.search_runs([exp]).empty
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "999")
    for args in (("compare",), ("run", "tiny"), ("stage", "download", "tiny")):
        res = invoke(*args)
        assert res.exit_code == 2 and "no MLflow experiment with ID '999'" in res.stderr, (args, res.output)


def test_specs_lists_the_readable_ones_when_one_is_not(tmp_path, monkeypatch):
    folder = tmp_path / "specs"
    folder.mkdir()
    (folder / "good.yaml").write_text("description: a good one\ndataset: {name: synthetic}\n")
    (folder / "bad.yaml").write_bytes(b"\xff\xfe not utf-8")
    (folder / "dir.yaml").mkdir()
    monkeypatch.setenv("BETTY_SPECS_DIR", str(folder))
    res = invoke("specs")
    assert res.exit_code == 0, res.output
    lines = dict(line.split(None, 1) for line in res.stdout.strip().splitlines())
    assert lines["good"] == "a good one" and lines["bad"].startswith("(unreadable")


def test_a_cuda_index_this_machine_lacks_is_named_before_a_stage_runs(monkeypatch):
    import torch

    from workflow.components import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(RuntimeError, match=r"'cuda:5' but this machine has 1 CUDA device\(s\): cuda:0 to cuda:0"):
        resolve_device("cuda:5")
    res = invoke("validate", "tiny", "-s", "train.device=cuda:5", "--strict")
    assert res.exit_code == 2 and "this machine has 1 CUDA device(s)" in res.stderr, res.output


def test_small_usage_errors_are_named_not_raised(tmp_path, monkeypatch):
    """A --save path that is a file, a specs folder that does not exist and two runs of
    one stage in --upstream each exit 2 with a message, not a traceback or a silent
    choice."""
    from workflow.runs import decode_upstream

    file = tmp_path / "taken"
    file.write_text("")
    res = invoke("partition", "tiny", "--save", str(file))
    assert res.exit_code == 2 and "is a file; give a folder" in res.stderr, res.output
    monkeypatch.setenv("BETTY_SPECS_DIR", str(tmp_path / "nowhere"))
    res = invoke("specs")
    assert res.exit_code == 2 and "does not exist" in res.stderr and "nowhere" in res.stderr, res.output
    monkeypatch.delenv("BETTY_SPECS_DIR")
    res = invoke("stage", "partition", "tiny", "-u", "sample=abc", "-u", "sample=def")
    assert res.exit_code == 2 and "upstream names two sample runs (abc and def)" in res.stderr, res.output
    assert decode_upstream("sample=abc;sample=abc") == {"sample": "abc"}
