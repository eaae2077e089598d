"""``mlflow run <project> -e main --env-manager local`` end to end, in subprocesses.

Runs a copy of the project (so concurrent edits of the tree cannot change the code
version between runs) against a temporary sqlite store, on the shipped tiny spec.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from test_workflow_support import metric_names, new_experiment, new_store, project_copy, runs_of
from workflow.specfile import STAGES

VENV_BIN = Path(sys.executable).parent
EPOCH_METRICS = ("loss", "train_acc", "k", "redundancy", "epoch_time_s", "time_sample_s",
                 "time_partition_s", "time_block_s", "time_compute_s", "peak_mem_measured_bytes",
                 "peak_mem_estimated_bytes", "mem_estimate_error", "valid_acc", "time_estimate_s",
                 "time_metrics_s", "time_h2d_s", "time_idle_s")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlproject")
    proj = project_copy(root / "project")
    uri = new_store(root / "store")
    exp = new_experiment(uri, "mlproject-test", root / "artifacts")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}

    def mlflow_run(*params: str) -> subprocess.CompletedProcess:
        cmd = [str(VENV_BIN / "mlflow"), "run", str(proj), "-e", "main", "--env-manager", "local",
               "--experiment-id", exp, "-P", "spec=tiny"]
        for p in params:
            cmd += ["-P", p]
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
        return done

    return uri, exp, mlflow_run


def _by_kind(uri, exp):
    runs = runs_of(uri, exp)
    return ([r for r in runs if r.data.tags.get("run_kind") == "main"],
            [r for r in runs if r.data.tags.get("run_kind") == "stage"], runs)


def test_mlflow_run_main_then_reuse(project):
    uri, exp, mlflow_run = project
    client = MlflowClient(uri)
    mlflow_run("set=train.epochs=2")  # the set parameter reaches every entry point
    mains, stages, runs = _by_kind(uri, exp)
    assert len(runs) == 6 and all(r.info.status == "FINISHED" for r in runs)
    (parent,) = mains
    assert parent.data.tags["mlflow.project.entryPoint"] == "main"
    assert sorted(r.data.tags["stage"] for r in stages) == sorted(STAGES)
    for run in stages:
        tags = run.data.tags
        assert tags["mlflow.parentRunId"] == parent.info.run_id
        assert "mlflow.project.entryPoint" not in tags  # run in the main entry point's process
        assert tags["spec_sha"] == parent.data.tags["spec_sha"]
        assert {"dataset", "device", "code_version", "stage_sha"} <= set(tags)
        assert "spec.yaml" in {a.path for a in client.list_artifacts(run.info.run_id)}
    assert "spec.yaml" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    # MLflow-native records under mlflow run too (workflow.tracking)
    assert parent.info.run_name == "tiny"
    assert {r.info.run_name for r in stages} == {f"tiny/{s}" for s in STAGES}
    assert client.get_experiment(exp).tags["mlflow.experimentKind"] == "custom_model_development"
    train = next(r for r in stages if r.data.tags["stage"] == "train")
    assert [i.dataset.name for i in train.inputs.dataset_inputs] == ["synthetic"]
    assert [m.source_run_id for m in client.search_logged_models([exp])] == [train.info.run_id]
    for name in EPOCH_METRICS:
        assert [m.step for m in client.get_metric_history(train.info.run_id, name)] == [0, 1], name
    assert {"model.pt", "memory_per_microbatch.csv", "models.json"} <= {
        a.path for a in client.list_artifacts(train.info.run_id)}
    assert {"test_acc", "valid_acc", "peak_mem_measured_bytes", "peak_mem_estimated_bytes",
            "redundancy", "k"} <= metric_names(parent)
    sample = next(r for r in stages if r.data.tags["stage"] == "sample")
    assert {"block0_num_src", "block1_num_edges"} <= metric_names(sample)

    mlflow_run("set=train.epochs=2")  # same content: every stage is reused
    mains, stages_again, runs = _by_kind(uri, exp)
    assert len(mains) == 2 and len(stages_again) == 5
    second = max(mains, key=lambda r: r.info.start_time)
    assert second.info.status == "FINISHED"
    assert second.data.tags["reused_stages"] == ",".join(STAGES)
    assert {second.data.tags[f"stage_run.{s}"] for s in STAGES} == {r.info.run_id for r in stages}
    assert "RUNNING" not in {r.info.status for r in runs}


@pytest.mark.slow
def test_mlflow_run_edited_spec_reruns_what_changed(project):
    uri, exp, mlflow_run = project
    mlflow_run("set=train.epochs=2")  # reused when the test above ran; makes this one independent
    before = {r.info.run_id for r in _by_kind(uri, exp)[1]}
    mlflow_run("train.epochs=1")  # an undeclared parameter is an override too
    mains, stages, runs = _by_kind(uri, exp)
    latest = max(mains, key=lambda r: r.info.start_time)
    assert latest.info.status == "FINISHED"
    assert latest.data.tags["reused_stages"] == "download,sample,partition"
    new = [r for r in stages if r.info.run_id not in before and
           r.info.run_id in {latest.data.tags[f"stage_run.{s}"] for s in STAGES}]
    assert sorted(r.data.tags["stage"] for r in new) == ["evaluate", "train"]
    train = next(r for r in new if r.data.tags["stage"] == "train")
    assert len(MlflowClient(uri).get_metric_history(train.info.run_id, "loss")) == 1
    assert "RUNNING" not in {r.info.status for r in runs}


@pytest.mark.slow
def test_mlflow_run_without_an_experiment_uses_the_specs(tmp_path):
    """``mlflow run . -P spec=tiny`` names no experiment, so MLflow creates its run in
    "Default": the pipeline still goes to the experiment named after the spec, and the
    launcher's run left in "Default" says where."""
    proj = project_copy(tmp_path / "project")
    uri = new_store(tmp_path / "store")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    for var in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        env.pop(var, None)
    cmd = [str(VENV_BIN / "mlflow"), "run", str(proj), "--env-manager", "local", "-P", "spec=tiny",
           "-P", "set=train.epochs=1;partition.sweep.k=[2];partition.sweep.methods=[range]"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("tiny")
    assert exp is not None
    mains, stages, runs = _by_kind(uri, exp.experiment_id)
    assert len(mains) == 1 and len(stages) == len(STAGES) and len(runs) == 1 + len(STAGES)
    assert all(r.info.status == "FINISHED" for r in runs)
    assert all(r.data.tags["mlflow.parentRunId"] == mains[0].info.run_id for r in stages)
    (launcher,) = runs_of(uri, "0")  # Default: only the run mlflow run created, empty
    assert launcher.data.tags["betty.pipeline_experiment"] == f"tiny (ID {exp.experiment_id})"
    assert "run_kind" not in launcher.data.tags and not launcher.data.metrics
