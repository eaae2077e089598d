"""``model.arch: revgnn`` in the workflow: spec rules, the stages, ``betty run``, the
shipped reversible specs (offline), and the MLflow project route (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlflow
import pytest
import torch


from mlflow.tracking import MlflowClient

from test_workflow_support import invoke, new_experiment, new_store, project_copy, runs_of
from workflow.pipeline import run_pipeline, run_stage
from workflow.spec import SpecError, spec_notes
from workflow.specfile import STAGES, apply_overrides, load_spec, resolve_spec

REV = "synthetic_revgnn"
TINY = ["dataset.num_nodes=300", "dataset.num_communities=8", "model.layers=3", "model.hidden=8",
        "train.epochs=3", "partition.k=2", "partition.sweep.k=[2, 4]", "evaluate.every=1"]
REAL_REV_SPECS = ("proteins_revgnn_deep", "proteins_revgnn_wide", "arxiv_revgat", "products_revgnn")
REV_EPOCH_METRICS = {"loss", "train_acc", "k", "edges_kept_fraction", "time_partition_s", "time_compute_s",
                     "epoch_time_s", "peak_mem_measured_bytes", "peak_mem_estimated_bytes",
                     "mem_estimate_error", "valid_acc"}

EXPERIMENT = "rev-test"  # the conftest tracking fixture's experiment


# ------------------------------------------------------------------------ spec rules


@pytest.mark.parametrize(("spec", "overrides", "path", "allowed_text"), [
    (REV, ["model.reversible=maybe"], "model.reversible", "boolean"),
    (REV, ["model.deq=2"], "model.deq", "boolean"),
    (REV, ["model.checkpoint=true"], "model.checkpoint", "reversible: false"),
    (REV, ["model.deq=true", "model.weight_tied=true"], "model.weight_tied", "model.deq"),
    (REV, ["model.deq=true", "model.norm=batch"], "model.norm", "layer, none"),
    (REV, ["model.norm=batch", "train.world_size=2"], "model.norm", "world_size 2"),
    (REV, ["model.deq=true", "partition.k=auto", "partition.memory_budget=1GB"], "partition.k", "deq"),
    (REV, ["model.deq=true", "partition.memory_budget=1GB"], "partition.memory_budget", "deq"),
    (REV, ["model.deq_max_iter=200"], "model.deq_max_iter", "model.deq: true only"),
    (REV, ["model.deq_tol=1e-8"], "model.deq_tol", "model.deq: true only"),
    (REV, ["model.deq=true", "model.deq_max_iter=0"], "model.deq_max_iter", "greater than or equal to 1"),
    (REV, ["model.deq=true", "model.deq_tol=1.5"], "model.deq_tol", "less than 1"),
    ("tiny", ["model.deq_tol=1e-6"], "model.deq_tol", "revgnn"),
    (REV, ["model.hidden=33"], "model.hidden", "divisible by model.groups"),
    (REV, ["model.heads=2"], "model.heads", "conv gat"),
    (REV, ["partition.method=reg"], "partition.method", "random, metis"),
    (REV, ["partition.sweep.methods=[reg]"], "partition.sweep.methods[0]", "random, metis"),
    (REV, ["partition.reuse=2"], "partition.reuse", "sage/gat"),
    (REV, ["partition.balance=memory"], "partition.balance", "sage/gat"),
    (REV, ["sampling.batch_size=64"], "sampling.batch_size", "full"),
    (REV, ["evaluate.inference=sampled"], "evaluate.inference", "full, multiview"),
    (REV, ["evaluate.views=3"], "evaluate.views", "multiview only"),
    (REV, ["evaluate.inference=multiview", "evaluate.views=0"], "evaluate.views", "greater than or equal to 1"),
    (REV, ["evaluate.chunk_size=100"], "evaluate.chunk_size", "sage/gat"),
    ("tiny", ["model.deq=true"], "model.deq", "revgnn"),
    ("tiny", ["model.weight_tied=true"], "model.weight_tied", "revgnn"),
    ("tiny", ["evaluate.inference=multiview"], "evaluate.inference", "revgnn only"),
])
def test_bad_revgnn_keys_are_named(spec, overrides, path, allowed_text):
    with pytest.raises(SpecError) as info:
        load_spec(spec, overrides)
    problems = info.value.problems
    assert [p.path for p in problems] == [path], str(info.value)
    assert allowed_text in str(problems[0])


def test_revgnn_spec_shape_defaults_and_notes():
    r = load_spec(REV)
    m = r.spec.model
    assert (m.arch, m.conv, m.groups, m.reversible, m.checkpoint, m.weight_tied, m.deq) == \
        ("revgnn", "gcn", 2, True, False, False, False)
    assert r.data["sampling"]["fanouts"] is None and spec_notes(r.spec) == []
    # arch-dependent defaults: one GAT head, random clusters
    raw = {"dataset": {"name": "synthetic", "num_nodes": 200}, "model": {"arch": "revgnn", "conv": "gat"}}
    bare = resolve_spec(raw)  # no sampling section needed
    assert bare.spec.model.heads == 1 and bare.spec.partition.method == "random"
    # fanouts are accepted (a sage spec tries revgnn without removing them) but noted
    switched = load_spec("tiny", ["model.arch=revgnn", "partition.method=metis", "partition.sweep.methods=null"])
    assert any("sampling.fanouts" in note and "ignored" in note for note in spec_notes(switched.spec))
    with pytest.raises(SpecError, match="  - sampling: required key is missing"):
        resolve_spec(apply_overrides(raw, ["model.arch=sage", "model.conv=gcn"]))
    with pytest.raises(SpecError, match="sampling.fanouts: required key is missing"):
        resolve_spec(apply_overrides(raw, ["model.arch=sage", "model.conv=gcn", "sampling.seed=0"]))


def test_deq_solver_keys_reach_the_model_and_leave_default_hashes_alone():
    """``model.deq_max_iter`` / ``deq_tol`` set both solves of the built DEQ; at their
    defaults they are not in the resolved content (the hashes specs had before them)."""
    from types import SimpleNamespace

    from workflow.components import build_model

    deq = load_spec(REV, ["model.deq=true"])
    assert "deq_max_iter" not in deq.data["model"] and "deq_tol" not in deq.data["model"]
    tuned = load_spec(REV, ["model.deq=true", "model.deq_max_iter=200", "model.deq_tol=1e-8"])
    assert tuned.sha != deq.sha
    dataset = SimpleNamespace(num_features=5, num_classes=3)
    model = build_model(tuned, dataset)
    assert (model.max_iter, model.backward_max_iter, model.tol, model.backward_tol) == (200, 200, 1e-8, 1e-8)
    default = build_model(deq, dataset)
    assert (default.max_iter, default.tol) == (50, 1e-5)


def test_evaluate_keys_map_to_the_library_arguments():
    """The spec's evaluate section as betty.evaluation.evaluate_model's arguments: multi-view
    parts from evaluate.parts, else the training K, else an integer partition.k."""
    from typing import get_args

    from betty.evaluation import INFERENCE_MODES
    from workflow.evaluation import evaluation_options
    from workflow.spec import EvaluateSection

    assert get_args(EvaluateSection.model_fields["inference"].annotation) == INFERENCE_MODES
    seeds = ["train.seed=5", "sampling.seed=9"]
    multi = load_spec(REV, TINY + seeds + ["evaluate.inference=multiview", "evaluate.views=3"])
    assert evaluation_options(multi, train_k=4) == {
        "inference": "multiview", "chunk_size": 16384, "dtype": torch.float32, "seed": 9, "views": 3,
        "parts": None, "train_k": 4}
    assert evaluation_options(multi)["train_k"] == 2  # partition.k
    parts = load_spec(REV, TINY + ["evaluate.inference=multiview", "evaluate.parts=5"])
    assert (evaluation_options(parts, train_k=4)["parts"], evaluation_options(parts)["train_k"]) == (5, None)
    auto = load_spec(REV, TINY + ["evaluate.inference=multiview", "partition.k=auto",
                                  "partition.memory_budget=1GB", "partition.sweep.k=[]"])
    with pytest.raises(ValueError, match="partition.k auto needs evaluate.parts"):
        evaluation_options(auto)
    assert evaluation_options(auto, train_k=3)["train_k"] == 3
    assert evaluation_options(load_spec(REV, TINY + seeds)) == {
        "inference": "full", "chunk_size": 16384, "dtype": torch.float32, "seed": 5}
    sampled = load_spec("tiny", seeds + ["evaluate.inference=sampled", "train.precision=64"])
    assert evaluation_options(sampled) == {"inference": "sampled", "chunk_size": 16384, "dtype": torch.float64,
                                           "seed": 5, "fanouts": sampled.spec.sampling.fanouts}
    fanouts = load_spec("tiny", ["evaluate.inference=sampled", "evaluate.fanouts=[3, 2]"])
    assert evaluation_options(fanouts)["fanouts"] == [3, 2]


def test_real_reversible_specs_validate():
    res = invoke("validate", *REAL_REV_SPECS, REV, "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["valid"] and all(s["valid"] and "errors" not in s for s in out["specs"])
    layers = {s: load_spec(s).spec.model.layers for s in REAL_REV_SPECS}
    assert layers == {"proteins_revgnn_deep": 1001, "proteins_revgnn_wide": 448, "arxiv_revgat": 5,
                      "products_revgnn": 112}


# ------------------------------------------------------------------------ running


def test_betty_run_reversible_spec(tracking):
    uri, exp = tracking
    client = MlflowClient(uri)
    sets = [a for o in TINY for a in ("-s", o)]
    res = invoke("run", REV, "--experiment", "rev-test", "--json", *sets)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    runs = runs_of(uri, exp)
    assert len(runs) == 6 and {r.info.status for r in runs} == {"FINISHED"}
    stage = {s: o["run_id"] for s, o in out["stages"].items()}
    train = client.get_run(stage["train"])
    assert REV_EPOCH_METRICS <= set(train.data.metrics)
    for name in REV_EPOCH_METRICS - {"valid_acc"}:
        assert [m.step for m in client.get_metric_history(stage["train"], name)] == [0, 1, 2], name
    losses = [m.value for m in client.get_metric_history(stage["train"], "loss")]
    assert losses[-1] < losses[0]
    artifacts = {a.path for a in client.list_artifacts(stage["train"])}
    assert {"model.pt", "memory_per_part.csv", "models.json"} <= artifacts
    assert {a.path for a in client.list_artifacts(stage["train"], "plots")} == {"plots/curves.png",
                                                                                "plots/memory_per_part.png"}
    assert [a.path for a in client.list_artifacts(stage["partition"], "plots")] == ["plots/cluster_sweep.png"]
    part = client.get_run(stage["partition"]).data.metrics
    assert part["k"] == 2 and 0 < part["edges_kept_fraction"] < 1 and part["peak_mem_estimated_bytes"] > 0
    assert {"parts.csv", "partition.npz", "partition_sweep.csv"} <= {
        a.path for a in client.list_artifacts(stage["partition"])}
    assert client.get_run(stage["sample"]).data.tags["sampling"] == "none (revgnn)"
    assert {"test_acc", "valid_acc", "peak_mem_measured_bytes", "peak_mem_estimated_bytes", "k",
            "edges_kept_fraction"} <= set(out["metrics"])

    # multi-view inference of the same model (evaluate stage alone, by run ID)
    multi = load_spec(REV, TINY + ["evaluate.inference=multiview", "evaluate.views=2"])
    _, scores = run_stage("evaluate", multi, {"train": stage["train"]})
    assert 0.0 <= scores["test_acc"] <= 1.0


def test_k_auto_partition_stage_logs_the_search(tracking, tmp_path):
    probe = load_spec(REV, TINY)
    budget_run, _ = run_stage("partition", probe)
    whole = MlflowClient().get_run(budget_run).data.metrics["peak_mem_estimated_bytes"]  # K = 2
    rspec = load_spec(REV, TINY + ["partition.k=auto", f"partition.memory_budget={int(whole * 0.8)}",
                                   "partition.safety_margin=0", "partition.sweep.k=[]"])
    run_id, metrics = run_stage("partition", rspec)
    assert metrics["k"] > 2
    path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="ksearch.json", dst_path=str(tmp_path))
    (search,) = json.loads(open(path).read())
    assert search["k"] == metrics["k"] and search["peak_bytes"] <= whole * 0.8


def test_real_reversible_specs_fail_fast_offline(tracking):
    uri, exp = tracking
    from betty.data import DatasetNotFoundError

    for name in ("proteins_revgnn_deep", "products_revgnn"):
        with pytest.raises(DatasetNotFoundError):
            run_pipeline(load_spec(name))
    runs = runs_of(uri, exp)
    assert [(r.data.tags["stage"], r.info.status) for r in runs] == [("main", "FAILED"), ("download", "FAILED")] * 2
    assert all("DatasetNotFoundError" in r.data.tags["error"] for r in runs)


@pytest.mark.slow
def test_mlflow_run_main_on_a_reversible_spec(tmp_path):
    """The MLflow project route (six processes): covered in-process by
    test_betty_run_reversible_spec."""
    proj = project_copy(tmp_path / "project")
    uri = new_store(tmp_path / "store")
    exp = new_experiment(uri, "rev-project", tmp_path / "artifacts")
    venv_bin = os.path.dirname(sys.executable)
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    cmd = [os.path.join(venv_bin, "mlflow"), "run", str(proj), "-e", "main", "--env-manager", "local",
           "--experiment-id", exp, "-P", f"spec={REV}", "-P", "set=" + ";".join(TINY)]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    runs = runs_of(uri, exp)
    assert len(runs) == 6 and {r.info.status for r in runs} == {"FINISHED"}
    parent = [r for r in runs if r.data.tags.get("run_kind") == "main"][0]
    assert {"test_acc", "loss", "peak_mem_measured_bytes", "edges_kept_fraction"} <= set(parent.data.metrics)
    assert sorted(r.data.tags["stage"] for r in runs if r.data.tags.get("run_kind") == "stage") == sorted(STAGES)
