"""Stages and the pipeline in-process: logging contract, reuse keys, failures, repeats."""

from __future__ import annotations

import json

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient

from test_workflow_support import metric_names, runs_of
from betty.batchfile import load_batch
from workflow.components import first_batch, load_data
from workflow.mlproject import parse_args
from workflow.provenance import backend_version, git_commit
from workflow.pipeline import run_pipeline, run_stage
from workflow.runs import decode_upstream, encode_upstream
from workflow.specfile import STAGES, load_spec

EPOCH_METRICS = {"loss", "train_acc", "k", "redundancy", "time_sample_s", "time_partition_s",
                 "time_block_s", "time_compute_s", "epoch_time_s", "peak_mem_measured_bytes",
                 "peak_mem_estimated_bytes", "mem_estimate_error", "valid_acc", "time_estimate_s",
                 "time_metrics_s", "time_h2d_s", "time_idle_s"}
FAST = ["partition.sweep.k=[2, 4]", "partition.sweep.methods=[range, reg]"]


def _statuses(uri, exp):
    return [r.info.status for r in runs_of(uri, exp)]


def test_pipeline_logs_contract_and_reuses_by_content(tracking, tmp_path):
    uri, exp = tracking
    client = MlflowClient(uri)
    rspec = load_spec("tiny", FAST)
    first = run_pipeline(rspec)
    runs = runs_of(uri, exp)
    assert len(runs) == 6 and all(r.info.status == "FINISHED" for r in runs)
    parent = client.get_run(first["main"]["run_id"])
    assert parent.data.tags["run_kind"] == "main" and parent.data.tags["reused_stages"] == "none"
    for stage in STAGES:
        run = client.get_run(first[stage]["run_id"])
        tags = run.data.tags
        assert tags["mlflow.parentRunId"] == parent.info.run_id
        assert tags["stage"] == stage and tags["spec_sha"] == rspec.sha
        assert tags["dataset"] == "synthetic" and tags["device"] == "cpu"
        if stage in ("download", "sample"):  # no GNN framework: nothing imported for a tag
            assert "backend" not in tags
        else:
            assert tags["backend"] == parent.data.tags["backend"] == backend_version(rspec.spec.model.backend)
        assert tags.get("mlflow.source.git.commit") == git_commit()  # MLflow's own provenance tag
        assert tags["code_version"].split("+")[0] == (git_commit() or "nogit")[:12]
        assert run.data.params["spec.train.epochs"] == "2"
        assert "spec.yaml" in {a.path for a in client.list_artifacts(run.info.run_id)}
    train = first["train"]["run_id"]
    assert EPOCH_METRICS <= metric_names(client.get_run(train))
    figures = {run: {a.path for a in client.list_artifacts(first[run]["run_id"], "plots")}
               for run in ("partition", "train")}
    assert figures == {"partition": {"plots/redundancy_vs_k.png"},
                       "train": {"plots/curves.png", "plots/memory_per_microbatch.png"}}
    for name in EPOCH_METRICS:
        assert [m.step for m in client.get_metric_history(train, name)] == [0, 1], name
    assert {"test_acc", "valid_acc", "peak_mem_measured_bytes", "peak_mem_estimated_bytes",
            "redundancy", "k", "epoch_time_s"} <= metric_names(parent)
    # the sampled batch is passed on by run ID and is the batch the trainer sees first
    path = mlflow.artifacts.download_artifacts(run_id=first["sample"]["run_id"], artifact_path="batch.npz", dst_path=str(tmp_path))
    batch, _ = load_batch(path)
    expected = first_batch(rspec, load_data(rspec))
    assert all(torch.equal(a.src_nid, b.src_nid) and torch.equal(a.edge_id, b.edge_id)
               for a, b in zip(batch.layers, expected.layers))

    again = run_pipeline(rspec)
    assert all(again[s]["reused"] and again[s]["run_id"] == first[s]["run_id"] for s in STAGES)
    assert len(runs_of(uri, exp)) == 7  # only a new parent
    assert client.get_run(again["main"]["run_id"]).data.tags["reused_stages"] == ",".join(STAGES)

    edited = run_pipeline(load_spec("tiny", FAST + ["train.epochs=1"]))
    assert [edited[s]["reused"] for s in STAGES] == [True, True, True, False, False]
    assert edited["train"]["run_id"] != first["train"]["run_id"]
    assert len(client.get_metric_history(edited["train"]["run_id"], "loss")) == 1
    assert "RUNNING" not in _statuses(uri, exp)


def test_reuse_requires_same_code_version(tracking, monkeypatch):
    from workflow import reuse

    rspec = load_spec("tiny", FAST + ["partition.sweep.k=[]"])
    run_pipeline(rspec, stages=("download",))
    monkeypatch.setattr(reuse, "code_version", lambda: "edited+0000")
    out = run_pipeline(rspec, stages=("download",))
    assert out["download"]["reused"] is False


def test_missing_dataset_fails_fast_and_leaves_no_running_run(tracking, tmp_path):
    uri, exp = tracking
    rspec = load_spec("arxiv_sage")
    from betty.data import DatasetNotFoundError

    with pytest.raises(DatasetNotFoundError):
        run_pipeline(rspec)
    runs = runs_of(uri, exp)
    assert [(r.data.tags["stage"], r.info.status) for r in runs] == [("main", "FAILED"), ("download", "FAILED")]
    for run in runs:
        assert "DatasetNotFoundError" in run.data.tags["error"] and "ogbn_arxiv" in run.data.tags["error"]
        assert len(run.data.tags["error"]) <= 500
    text = MlflowClient(uri).download_artifacts(runs[1].info.run_id, "error.txt", str(tmp_path))
    assert "Traceback" in open(text).read()


def test_interrupted_stage_is_killed_not_running(tracking, monkeypatch):
    uri, exp = tracking
    import workflow.stages.train as train_stage

    def interrupted(ctx, repeat=0):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_stage, "train_once", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(load_spec("tiny", FAST))
    status = {r.data.tags["stage"]: r.info.status for r in runs_of(uri, exp)}
    assert status == {"main": "KILLED", "download": "FINISHED", "sample": "FINISHED",
                      "partition": "FINISHED", "train": "KILLED"}


def test_a_full_disk_ends_the_runs_failed_with_what_to_do(tracking, monkeypatch):
    """A stage that hits a full disk (here: its artifact write) ends FAILED with one line
    saying so and how to recover, in the runs' error tag and on the command line, instead
    of MLflow's SQL dump."""
    import errno
    import sqlite3

    import workflow.stages.train as train_stage
    from test_workflow_support import invoke

    uri, exp = tracking

    def full(ctx, repeat=0):
        try:
            raise sqlite3.OperationalError("database or disk is full")
        except sqlite3.OperationalError as err:  # as MLflow raises it: wrapped
            raise RuntimeError("(sqlite3.OperationalError) database or disk is full\n[SQL: INSERT ...]") from err

    monkeypatch.setattr(train_stage, "train_once", full)
    res = invoke("run", "tiny", *[f"--set={o}" for o in FAST], catch_exceptions=True)
    assert res.exit_code == 1
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("betty: disk full:") and "betty cleanup --fail" in last and "SQL" not in last, last
    status = {r.data.tags["stage"]: (r.info.status, r.data.tags.get("error", "")) for r in runs_of(uri, exp)}
    assert status["main"][0] == "FAILED" and status["train"][0] == "FAILED"
    assert status["train"][1].startswith("disk full:") and "SQL" not in status["train"][1]
    from workflow.runs import disk_full

    assert disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert not disk_full(OSError(errno.EACCES, "Permission denied")) and not disk_full(ValueError("x"))


def test_arch_outside_the_catalog_is_refused_before_any_run(tracking, monkeypatch):
    """The spec accepts exactly the architectures of betty.catalog.ARCHS, read when the
    spec is checked: one the catalog lacks is refused with the ones it has, and no run
    (not even the parent) is created."""
    uri, exp = tracking
    import betty.catalog
    from workflow.spec import SpecError

    monkeypatch.setattr(betty.catalog, "ARCHS", ("sage",))
    with pytest.raises(SpecError) as info:
        load_spec("tiny", ["model.arch=gat", "model.heads=2"] + FAST)
    assert [str(p) for p in info.value.problems] == [
        "model.arch = 'gat': unknown architecture; allowed: 'sage'"]
    assert list(runs_of(uri, exp)) == []


def test_repeats_log_mean_and_std(tracking):
    uri, exp = tracking
    client = MlflowClient(uri)
    rspec = load_spec("tiny", ["train.repeats=2", "train.epochs=1", "partition.sweep.k=[]"])
    train_id, summary = run_stage("train", rspec)
    repeats = runs_of(uri, exp, "tags.run_kind = 'repeat'")
    assert [r.data.tags["repeat"] for r in repeats] == ["0", "1"]
    assert all(r.data.tags["mlflow.parentRunId"] == train_id and r.info.status == "FINISHED" for r in repeats)
    losses = [r.data.metrics["loss"] for r in repeats]
    assert losses[0] != losses[1]  # different seeds
    train = client.get_run(train_id).data.metrics
    assert train["loss_mean"] == pytest.approx(sum(losses) / 2)
    assert train["loss_std"] == pytest.approx(abs(losses[0] - losses[1]) / 2)
    eval_id, scores = run_stage("evaluate", rspec, {"train": train_id})
    ev = client.get_run(eval_id).data.metrics
    tests = [ev["test_acc.repeat0"], ev["test_acc.repeat1"]]
    assert ev["test_acc"] == pytest.approx(sum(tests) / 2) == pytest.approx(ev["test_acc_mean"])
    assert ev["test_acc_std"] == pytest.approx(abs(tests[0] - tests[1]) / 2)
    run_stage("evaluate", load_spec("tiny", ["train.repeats=2", "train.epochs=1", "partition.sweep.k=[]",
                                             "evaluate.inference=sampled"]), {"train": train_id})
    for r in repeats:  # scoring again leaves the repeat runs as training left them
        assert "test_acc" not in client.get_run(r.info.run_id).data.metrics


def test_k_auto_partition_stage_logs_the_search(tracking, tmp_path):
    from betty.memory import estimate_micro_batches

    from workflow.components import make_trainer

    uri, exp = tracking
    base = load_spec("tiny", ["partition.k=1", "partition.sweep.k=[]"])
    ds = load_data(base)
    trainer, model, optimizer = make_trainer(base, ds, torch.device("cpu"))
    batch = trainer.sample(0, 0)
    full = estimate_micro_batches(batch, torch.zeros(batch.num_outputs, dtype=torch.long), 1, model, optimizer)
    budget = int(0.6 * full[0].peak)  # the full batch cannot fit
    rspec = load_spec("tiny", ["partition.k=auto", f"partition.memory_budget={budget}",
                               "partition.sweep.k=[]"])
    run_id, summary = run_stage("partition", rspec)
    run = MlflowClient(uri).get_run(run_id)
    assert summary["k"] >= 2
    assert {"time_ksearch_s", "peak_mem_estimated_bytes"} <= metric_names(run)
    assert run.data.metrics["peak_mem_estimated_bytes"] <= budget * 0.95
    path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="ksearch.json", dst_path=str(tmp_path))
    assert json.load(open(path))[0]["k"] == summary["k"]


def test_evaluate_needs_a_train_run(tracking):
    uri, exp = tracking
    with pytest.raises(RuntimeError, match="needs the train stage's run"):
        run_stage("evaluate", load_spec("tiny"))
    assert _statuses(uri, exp) == ["FAILED"]


# ------------------------------------------------------------------- pure helpers


def test_mlproject_arguments():
    args, overrides = parse_args(["train", "--spec", "tiny", "--set", "model.hidden=8;train.lr=0.1",
                                  "--upstream", "", "--train.epochs", "3", "--dataset.seed=2"])
    assert args.entry == "train" and args.spec == "tiny"
    assert overrides == ["model.hidden=8;train.lr=0.1", "train.epochs=3", "dataset.seed=2"]
    assert decode_upstream(encode_upstream({"download": "a1", "sample": "b2"})) == {"download": "a1", "sample": "b2"}
    with pytest.raises(ValueError, match="stage=RUN_ID"):
        decode_upstream("download")
    assert parse_args(["main", "--spec", "tiny"])[0].reuse is True
    assert parse_args(["main", "--spec", "tiny", "--reuse", " Off"])[0].reuse is False
    with pytest.raises(SystemExit):  # a typo is a usage error, not "reuse"
        parse_args(["main", "--spec", "tiny", "--reuse", "flase"])


def test_full_and_sampled_inference_scores(tmp_path, monkeypatch):
    from workflow.components import build_model
    from workflow.evaluation import evaluate_model

    monkeypatch.chdir(tmp_path)
    full = load_spec("tiny")
    ds = load_data(full)
    model = build_model(full, ds)
    scores = evaluate_model(model, ds, full, "cpu")
    assert set(scores) == {"valid_acc", "test_acc"} and all(0.0 <= v <= 1.0 for v in scores.values())
    # sampled inference with every neighbour equals full-neighbour inference
    sampled = load_spec("tiny", ["evaluate.inference=sampled", "evaluate.fanouts=[-1, -1]"])
    assert evaluate_model(model, ds, sampled, "cpu") == pytest.approx(scores)
    assert set(evaluate_model(model, ds, sampled, "cpu", splits=("valid",))) == {"valid_acc"}


def test_mlproject_stage_with_a_malformed_upstream_exits_2(tracking, capsys):
    from workflow.mlproject import main

    assert main(["evaluate", "--spec", "tiny", "--upstream", "foo"]) == 2
    assert "upstream entry 'foo' must look like stage=RUN_ID" in capsys.readouterr().err
