"""Guards around the workflow: --upstream lineage checks, artifact checksums, progress
lines without a terminal, number formatting and spec-file diagnostics."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from test_workflow_support import invoke, runs_of

EXPERIMENT = "guards-test"  # the conftest tracking fixture's experiment


def _stage(*args: str) -> str:
    res = invoke("stage", *args, "--experiment", "guards-test", "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)["run_id"]


def test_upstream_is_checked_before_a_run_exists(tracking):
    uri, exp = tracking
    download = _stage("download", "tiny")
    sample = _stage("sample", "tiny", "--upstream", f"download={download}")
    before = {r.info.run_id for r in runs_of(uri, exp)}

    def refused(*args: str) -> str:
        res = invoke("stage", *args, "--experiment", "guards-test")
        assert res.exit_code == 2, res.output  # refused runs given as arguments
        return res.stderr

    # a sample run of spec tiny cannot feed the partition stage of spec synthetic
    err = refused("partition", "synthetic", "--upstream", f"sample={sample}")
    assert sample in err and "'tiny'" in err and "'synthetic'" in err and "spec.dataset.num_nodes = 400 there" in err
    # a run of another stage, a run that does not exist, a stage that is not upstream
    assert "is not a sample stage run" in refused("partition", "tiny", "--upstream", f"sample={download}")
    assert "no such run" in refused("train", "tiny", "--upstream", "partition=bogus")
    assert "takes runs of" in refused("sample", "tiny", "--upstream", f"partition={sample}")
    # a run that did not finish
    MlflowClient(uri).set_terminated(download, "KILLED")
    assert "KILLED, not FINISHED" in refused("sample", "tiny", "--upstream", f"download={download}")
    # refused before any run was created; a matching lineage is accepted
    assert {r.info.run_id for r in runs_of(uri, exp)} == before
    _stage("partition", "tiny", "--upstream", f"sample={sample}", "-s", "partition.sweep.k=[2]",
           "-s", "partition.sweep.methods=[range]")


def test_evaluate_keys_that_picked_the_trained_weights_are_compared(tracking):
    """An evaluate stage may score a train run with other inference settings, but not
    claim another weight selection: ``evaluate.select`` always counts, and every
    ``evaluate`` key counts when validation picked the weights."""
    from workflow.lineage import UpstreamMismatch, check_upstream
    from workflow.specfile import load_spec

    uri, exp = tracking
    client = MlflowClient(uri)

    def train_run(*overrides: str) -> str:
        run = client.create_run(exp, tags={"run_kind": "stage", "stage": "train", "spec_name": "tiny"})
        for key, value in load_spec("tiny", list(overrides)).params().items():
            client.log_param(run.info.run_id, key, value)
        client.set_terminated(run.info.run_id, "FINISHED")
        return run.info.run_id

    last = train_run()
    check_upstream(load_spec("tiny", ["evaluate.inference=sampled"]), "evaluate", {"train": last})
    with pytest.raises(UpstreamMismatch, match="spec.evaluate.select = last there, best_valid here"):
        check_upstream(load_spec("tiny", ["evaluate.select=best_valid"]), "evaluate", {"train": last})
    best = train_run("evaluate.select=best_valid")
    check_upstream(load_spec("tiny", ["evaluate.select=best_valid"]), "evaluate", {"train": best})
    with pytest.raises(UpstreamMismatch, match="spec.evaluate.inference = full there, sampled here"):
        check_upstream(load_spec("tiny", ["evaluate.select=best_valid", "evaluate.inference=sampled"]),
                       "evaluate", {"train": best})


def test_upstream_may_differ_where_nothing_computed_changes(tracking):
    """A train run feeds an evaluate stage that runs on another device, with other
    threads or preparation settings; another learning rate is refused."""
    from workflow.lineage import UpstreamMismatch, check_upstream
    from workflow.specfile import load_spec

    uri, exp = tracking
    client = MlflowClient(uri)
    trained = load_spec("tiny", ["train.device=auto", "train.threads=auto"])
    run = client.create_run(exp, tags={"run_kind": "stage", "stage": "train", "spec_name": "tiny"})
    for key, value in trained.params().items():
        client.log_param(run.info.run_id, key, value)
    client.set_terminated(run.info.run_id, "FINISHED")
    elsewhere = load_spec("tiny", ["train.device=cpu", "train.threads=1", "train.prep_workers=1",
                                   "train.pipeline=false", "train.measure_memory=false"])
    check_upstream(elsewhere, "evaluate", {"train": run.info.run_id})
    with pytest.raises(UpstreamMismatch, match="spec.train.lr = 0.01 there, 0.5 here"):
        check_upstream(load_spec("tiny", ["train.lr=0.5"]), "evaluate", {"train": run.info.run_id})

    # the keys of a later section a stage reads count too: the sampled batch follows the arch
    sample = client.create_run(exp, tags={"run_kind": "stage", "stage": "sample", "spec_name": "tiny"})
    for key, value in trained.params().items():
        client.log_param(sample.info.run_id, key, value)
    client.set_terminated(sample.info.run_id, "FINISHED")
    check_upstream(load_spec("tiny", ["model.hidden=16"]), "partition", {"sample": sample.info.run_id})
    with pytest.raises(UpstreamMismatch, match="spec.model.arch = sage there, gcn here"):
        check_upstream(load_spec("tiny", ["model.arch=gcn", "model.aggregator=mean"]), "partition",
                       {"sample": sample.info.run_id})

    # keys the architecture never reads: revgnn's sampling.fanouts
    rev = ["model.arch=revgnn", "model.hidden=8", "partition.method=random"]
    rev_sample = client.create_run(exp, tags={"run_kind": "stage", "stage": "sample", "spec_name": "tiny"})
    for key, value in load_spec("tiny", rev).params().items():
        client.log_param(rev_sample.info.run_id, key, value)
    client.set_terminated(rev_sample.info.run_id, "FINISHED")
    check_upstream(load_spec("tiny", [*rev, "sampling.fanouts=[2, 3]"]), "partition",
                   {"sample": rev_sample.info.run_id})
    with pytest.raises(UpstreamMismatch, match="spec.sampling.fanouts"):
        check_upstream(load_spec("tiny", ["sampling.fanouts=[2, 3]"]), "partition", {"sample": sample.info.run_id})

    # keys the stages before train do not read: where the graph is held, and sampling on
    # the CPU as torch ops (the host's batches); a batch sampled on CUDA is another one
    store = ["dataset.store=distributed", f"dataset.store_ip_config={Path(__file__)}"]
    check_upstream(load_spec("tiny", store), "partition", {"sample": sample.info.run_id})
    check_upstream(load_spec("tiny", ["sampling.device=cpu"]), "partition", {"sample": sample.info.run_id})
    cpu_sample = client.create_run(exp, tags={"run_kind": "stage", "stage": "sample", "spec_name": "tiny"})
    for key, value in load_spec("tiny", ["sampling.device=cpu"]).params().items():
        client.log_param(cpu_sample.info.run_id, key, value)
    client.set_terminated(cpu_sample.info.run_id, "FINISHED")
    check_upstream(load_spec("tiny"), "partition", {"sample": cpu_sample.info.run_id})
    cuda_sample = client.create_run(exp, tags={"run_kind": "stage", "stage": "sample", "spec_name": "tiny"})
    for key, value in {**trained.params(), "spec.sampling.device": "cuda"}.items():
        client.log_param(cuda_sample.info.run_id, key, value)
    client.set_terminated(cuda_sample.info.run_id, "FINISHED")
    with pytest.raises(UpstreamMismatch, match="spec.sampling.device = cuda there, cpu here"):
        check_upstream(load_spec("tiny", ["sampling.device=cpu"]), "partition", {"sample": cuda_sample.info.run_id})


def _artifact(tmp_path, run_id: str, name: str):
    return tmp_path / "artifacts" / run_id / "artifacts" / name


def test_damaged_or_missing_artifacts_rerun_the_stage(tracking, tmp_path):
    from workflow.checksums import TAG_PREFIX, file_sha256
    from workflow.pipeline import run_pipeline
    from workflow.specfile import load_spec

    uri, exp = tracking
    client = MlflowClient(uri)
    rspec = load_spec("tiny", ["partition.sweep.k=[2]", "partition.sweep.methods=[range]"])
    first = run_pipeline(rspec)
    sample = first["sample"]["run_id"]
    tags = client.get_run(sample).data.tags
    assert tags[TAG_PREFIX + "batch.npz"] == file_sha256(_artifact(tmp_path, sample, "batch.npz"))

    _artifact(tmp_path, first["evaluate"]["run_id"], "evaluation.json").unlink()
    with pytest.warns(UserWarning, match=f"evaluate run {first['evaluate']['run_id']}: evaluation.json is missing"):
        second = run_pipeline(rspec)
    assert [s for s in second if s != "main" and second[s]["reused"]] == ["download", "sample", "partition", "train"]
    assert second["evaluate"]["run_id"] != first["evaluate"]["run_id"]

    batch = _artifact(tmp_path, sample, "batch.npz")
    batch.write_bytes(batch.read_bytes()[:-1] + b"x")  # one byte changed
    with pytest.warns(UserWarning, match=f"sample run {sample}: batch.npz is damaged"):
        third = run_pipeline(rspec)
    assert [s for s in third if s != "main" and third[s]["reused"]] == ["download"]
    parent = client.get_run(third["main"]["run_id"])
    assert parent.data.tags["reuse_refused.sample"] == f"{sample}: batch.npz"
    assert {r.info.status for r in runs_of(uri, exp)} == {"FINISHED"}

    # a damaged artifact given with --upstream: a clear error naming the run and the file
    res = invoke("stage", "partition", "tiny", "--experiment", "guards-test", "--upstream", f"sample={sample}")
    assert res.exit_code == 1 and f"artifact 'batch.npz' of run {sample} is damaged" in res.stderr
    assert "Traceback" not in res.output


def test_a_repeated_train_run_is_reused_and_its_repeat_runs_checked(tracking, tmp_path, monkeypatch):
    """``train.repeats > 1`` logs the models on the repeat runs: a rerun reuses the train
    run (no warning; its ``models.json`` read back once), and one repeat run's damaged
    model.pt, or a damaged ``models.json``, runs train again."""
    import warnings

    import mlflow.artifacts

    from workflow.pipeline import run_pipeline
    from workflow.specfile import load_spec

    rspec = load_spec("tiny", ["train.repeats=2", "train.epochs=1", "partition.sweep.k=[]"])
    first = run_pipeline(rspec)
    downloads, download = [], mlflow.artifacts.download_artifacts
    monkeypatch.setattr(mlflow.artifacts, "download_artifacts",
                        lambda *a, **kw: downloads.append(kw.get("artifact_path")) or download(*a, **kw))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = run_pipeline(rspec)
    monkeypatch.setattr(mlflow.artifacts, "download_artifacts", download)
    assert all(second[s]["reused"] for s in second if s != "main")
    assert downloads.count("models.json") == 1
    repeat = runs_of(*tracking, "tags.run_kind = 'repeat'")[1].info.run_id
    model = _artifact(tmp_path, repeat, "model.pt")
    model.write_bytes(model.read_bytes()[:-1] + b"x")
    with pytest.warns(UserWarning, match=f"train run {first['train']['run_id']}: model.pt of its repeat "
                                         f"run {repeat} is damaged"):
        third = run_pipeline(rspec)
    assert [s for s in third if s != "main" and third[s]["reused"]] == ["download", "sample", "partition"]
    # a damaged models.json is reported as such and not read (its entries are not checked)
    train = third["train"]["run_id"]
    _artifact(tmp_path, train, "models.json").write_text('[{"repeat": 0}]')
    with pytest.warns(UserWarning, match=f"train run {train}: models.json is damaged"):
        fourth = run_pipeline(rspec)
    parent = MlflowClient(tracking[0]).get_run(fourth["main"]["run_id"])
    assert parent.data.tags["reuse_refused.train"] == f"{train}: models.json"


def test_a_train_run_listing_a_gone_repeat_run_is_not_reused(tracking, tmp_path):
    """``models.json`` naming a run that no longer exists, or an entry without a run:
    damaged (the stage runs again), not an error that stops the pipeline."""
    import json

    import workflow.pipeline as pipeline

    listed = tmp_path / "models.json"
    listed.write_text(json.dumps([{"run_id": "0" * 32, "repeat": 0}, {"repeat": 1}]))
    damaged = pipeline._trained_models_damaged("f" * 32, listed)
    assert [(d.run_id, d.artifact) for d in damaged] == [("0" * 32, "the run"), ("f" * 32, "models.json")]
    assert damaged[0].problem.startswith("missing")


def test_numbers_in_logs_are_human():
    from workflow.progress import format_metrics, format_number

    assert format_number(10000.0) == "10,000" and format_number(10000) == "10,000"
    assert format_number(12345.678) == "12,345.7" and format_number(0.41234) == "0.4123"
    assert format_number(0.0004) == "0.0004" and format_number(2.5e-06) == "2.5e-06"
    assert format_number(float("nan")) == "nan" and format_number(True) == "True"
    assert format_metrics({"num_nodes": 1e4, "loss": 0.5, "skip": None}) == "num_nodes=10,000 loss=0.5"


def test_progress_without_a_terminal_is_line_per_stage_and_epoch(tracking):
    """``betty run`` with stderr not a terminal (the CLI runner's): plain flushed lines."""
    res = invoke("run", "tiny", "--experiment", "guards-test", "-s", "train.epochs=3",
                 "-s", "partition.sweep.k=[2]", "-s", "partition.sweep.methods=[range]")
    assert res.exit_code == 0, res.output
    lines = [line for line in res.stderr.splitlines() if line.startswith("[betty]")]
    for stage in ("download", "sample", "partition", "train", "evaluate"):
        assert any(line.startswith(f"[betty] {stage}: started") for line in lines), stage
        assert any(line.startswith(f"[betty] {stage}: finished after ") for line in lines), stage
    epoch_lines = [line for line in lines if "/3 elapsed " in line]
    assert len(epoch_lines) == 3, lines
    assert all(" eta " in line and "loss=" in line for line in epoch_lines)
    assert "e+0" not in res.stderr


def test_spec_file_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ndataset:\n  name: synthetic\n  bad: [1, 2\nmodel: {}\n")
    res = invoke("validate", str(bad))
    assert res.exit_code == 2 and f"{bad}:5:" in res.stderr and "<unicode string>" not in res.stderr
    for text in ("", "# nothing but a comment\n\n"):
        empty = tmp_path / "empty.yaml"
        empty.write_text(text)
        res = invoke("validate", str(empty))
        assert res.exit_code == 2 and "spec file is empty" in res.stderr, res.stderr


def test_validate_warns_about_what_this_machine_lacks(tmp_path, monkeypatch):
    import torch

    monkeypatch.chdir(tmp_path)  # no data/ here
    res = invoke("validate", "reddit_sage")
    assert res.exit_code == 0 and "warning: data files missing" in res.stderr and "reddit" in res.stderr
    res = invoke("validate", "reddit_sage", "--strict")
    assert res.exit_code == 2 and "error: data files missing" in res.stderr
    out = json.loads(invoke("validate", "tiny", "--json").stdout)
    assert out["valid"] and out["specs"][0]["warnings"] == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = invoke("validate", "tiny", "-s", "train.device=cuda")
    assert res.exit_code == 0 and "warning: train.device is 'cuda' but CUDA is not available" in res.stderr
    assert invoke("validate", "tiny", "-s", "train.device=cuda", "--strict").exit_code == 2


def test_sweep_max_k_is_checked_in_the_spec():
    """The spec's ``partition.sweep.max_k`` (the sweep's skip rules themselves:
    tests/test_partition_sweep.py)."""
    from workflow.spec import SpecError
    from workflow.specfile import load_spec

    rspec = load_spec("tiny", ["partition.sweep.max_k={range: 4}"])
    assert rspec.spec.partition.sweep.max_k == {"range": 4}
    with pytest.raises(SpecError) as err:
        load_spec("tiny", ["partition.sweep.max_k={nope: 4, range: 1}", "partition.sweep.methods=[range, bad]"])
    problems = {p.path: p.message for p in err.value.problems}
    assert problems.keys() == {"partition.sweep.max_k.nope", "partition.sweep.max_k.range",
                               "partition.sweep.methods[1]"}
    assert problems["partition.sweep.methods[1]"].startswith("unknown partition method; allowed: 'hypergraph',")
    assert problems["partition.sweep.max_k.nope"] == problems["partition.sweep.methods[1]"]


def test_partition_stage_logs_and_prints_the_sweep_skips(tracking):
    """The stage hands ``partition.sweep`` to the library's sweep and shows what it
    skipped: the ``sweep_skipped`` tag, a note, one progress line per step."""
    import io

    from workflow.pipeline import run_stage
    from workflow.progress import LogReporter
    from workflow.specfile import load_spec

    rspec = load_spec("tiny", ["partition.sweep.k=[2, 4, 8, 16]", "partition.sweep.methods=[range]",
                               "partition.sweep.max_k={range: 4}"])
    out = io.StringIO()
    run_id, _ = run_stage("partition", rspec, reporter=LogReporter(out))
    run = MlflowClient(tracking[0]).get_run(run_id)
    assert run.data.tags["sweep_skipped"] == "range: K=8,16 skipped: above sweep.max_k.range=4"
    assert [m.step for m in MlflowClient(tracking[0]).get_metric_history(run_id, "sweep_redundancy.range")] == [2, 4]
    lines = out.getvalue().splitlines()
    assert "[betty] sweep: range K=8,16 skipped: above sweep.max_k.range=4" in lines
    assert [line.split(" elapsed")[0] for line in lines if "partition sweep" in line] == [
        "[betty] partition sweep 1/4", "[betty] partition sweep 2/4", "[betty] partition sweep 4/4"]


def test_partition_stage_logs_no_metric_for_a_sweep_row_another_method_split(tracking):
    """A ``hypergraph`` sweep row past ``partition.time_limit_s`` holds ``reg``'s split:
    the CSV says so, and no ``sweep_redundancy.hypergraph`` metric claims it."""
    import csv

    from workflow.pipeline import run_stage
    from workflow.specfile import load_spec

    rspec = load_spec("tiny", ["partition.sweep.k=[2]", "partition.sweep.methods=[reg, hypergraph]",
                               "partition.time_limit_s=0.000001"])
    run_id, _ = run_stage("partition", rspec)
    client = MlflowClient(tracking[0])
    assert [m.step for m in client.get_metric_history(run_id, "sweep_redundancy.reg")] == [2]
    assert client.get_metric_history(run_id, "sweep_redundancy.hypergraph") == []
    folder = client.download_artifacts(run_id, "partition_sweep.csv")
    rows = {row["method"]: row for row in csv.DictReader(open(folder))}
    assert rows["hypergraph"]["fallback"].startswith("reg: ") and rows["reg"]["fallback"] == ""


def test_cleanup_finds_stuck_betty_runs(tracking):
    import socket
    import subprocess
    import sys

    uri, exp = tracking
    client = MlflowClient(uri)
    host = socket.gethostname()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()  # a pid that no longer exists
    parent = client.create_run(exp, tags={"run_kind": "main", "stage": "main"}).info.run_id
    client.set_terminated(parent, "KILLED")
    orphan = client.create_run(exp, tags={"run_kind": "stage", "stage": "sample",
                                          "mlflow.parentRunId": parent}).info.run_id
    dead = client.create_run(exp, tags={"run_kind": "stage", "stage": "train", "betty.host": host,
                                        "betty.pid": gone}).info.run_id
    alive = client.create_run(exp, tags={"run_kind": "stage", "stage": "train", "betty.host": host,
                                         "betty.pid": str(os.getpid())}).info.run_id
    listed = json.loads(invoke("cleanup", "--experiment", "guards-test", "--json").stdout)["stale"]
    reasons = {r["run_id"]: r["reason"] for r in listed}
    assert set(reasons) == {orphan, dead}
    assert f"parent run {parent} ended KILLED" in reasons[orphan] and f"process {gone}" in reasons[dead]
    assert invoke("cleanup", "--experiment", "guards-test", "--fail").exit_code == 0
    assert client.get_run(orphan).info.status == "KILLED" and client.get_run(dead).info.status == "KILLED"
    assert "stuck" in client.get_run(dead).data.tags["error"]
    assert client.get_run(alive).info.status == "RUNNING"
    client.set_terminated(alive, "FINISHED")


def test_cleanup_ends_a_child_only_when_its_parent_is_gone_not_when_the_store_fails(tracking, monkeypatch):
    """A child run whose parent no longer exists (purged) is stuck; one whose parent cannot
    be read because the store failed (a timeout, a refusal) is not ended: cleanup fails."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE

    from workflow.commands.cleanup import stale_runs

    uri, exp = tracking
    client = MlflowClient(uri)
    child = client.create_run(exp, tags={"run_kind": "stage", "stage": "sample",
                                         "mlflow.parentRunId": "0" * 32}).info.run_id
    assert [(r.info.run_id, status) for r, status, _ in stale_runs(exp, 60)] == [(child, "KILLED")]
    get_run = MlflowClient.get_run

    def unavailable(self, run_id):
        if run_id == "0" * 32:
            raise MlflowException("the store timed out", error_code=TEMPORARILY_UNAVAILABLE)
        return get_run(self, run_id)

    monkeypatch.setattr(MlflowClient, "get_run", unavailable)
    with pytest.raises(MlflowException, match="timed out"):
        stale_runs(exp, 60)
    monkeypatch.undo()
    client.set_terminated(child, "KILLED")


def test_signal_handling_is_light_and_complete():
    import signal as _signal

    from workflow import mlproject, signals
    from workflow.specfile import STAGES

    assert mlproject.ENTRIES == ("main", *STAGES)
    previous = signals.install()
    try:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), _signal.SIGTERM)
            for _ in range(1000):  # the handler runs between bytecodes
                pass
        with signals.shield():  # held back inside, raised by check() afterwards
            os.kill(os.getpid(), _signal.SIGINT)
            for _ in range(1000):
                pass
        with pytest.raises(KeyboardInterrupt, match="received earlier"):
            signals.check()
    finally:
        signals.restore(previous)
    signals.check()  # restored: the signals handled above are forgotten
    previous = signals.install(hold=True)  # the betty command's start-up
    try:
        os.kill(os.getpid(), _signal.SIGINT)
        for _ in range(1000):
            pass
        signals.check()  # held: recorded only
        signals.release_hold()
        signals.release_hold()  # a no-op without a hold
        with pytest.raises(KeyboardInterrupt, match="SIGINT"):
            signals.check()
    finally:
        signals.restore(previous)


def _swallow_a_sigterm() -> None:
    """Send this process ``SIGTERM`` from inside a ``weakref.finalize`` callback, where
    Python reports the handler's ``KeyboardInterrupt`` as "Exception ignored" and drops
    it (as it does in the memory meter's finalizers, which run on every freed tensor)."""
    import signal as _signal
    import weakref

    class Dropped:
        pass

    def freed() -> None:
        os.kill(os.getpid(), _signal.SIGTERM)
        sum(i for i in range(1000))  # the handler runs here, inside the finalizer

    dropped = Dropped()
    weakref.finalize(dropped, freed)
    del dropped


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_signal_a_finalizer_swallowed_still_ends_training(tracking, monkeypatch):
    """A ``SIGTERM`` whose ``KeyboardInterrupt`` was dropped during an epoch stops the
    training before the next epoch: the train and main runs end ``KILLED``, exit 130."""
    from betty.engine import Trainer

    uri, exp = tracking
    epochs = Trainer.epochs

    def epochs_dropping_a_signal(self, *args, **kwargs):
        for i, record in enumerate(epochs(self, *args, **kwargs)):
            if i == 1:
                _swallow_a_sigterm()
            yield record

    monkeypatch.setattr(Trainer, "epochs", epochs_dropping_a_signal)
    res = invoke("run", "tiny", "--experiment", EXPERIMENT, "-s", "train.epochs=20", "-s", "evaluate.every=0",
                 "-s", "partition.sweep.k=[2]", "-s", "partition.sweep.methods=[range]")
    assert res.exit_code == 130, res.output
    runs = {r.data.tags.get("stage"): r for r in runs_of(uri, exp)}
    assert runs["train"].info.status == "KILLED" and runs["main"].info.status == "KILLED"
    assert "SIGTERM" in runs["train"].data.tags["error"]
    losses = MlflowClient(uri).get_metric_history(runs["train"].info.run_id, "loss")
    assert len(losses) == 2, [m.step for m in losses]  # epochs 0 and 1; epoch 2 never started


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_command_without_a_run_exits_130_after_a_swallowed_signal(monkeypatch):
    """A command that tracks no run (``betty calibrate``) and whose ``SIGTERM`` a
    finalizer swallowed exits 130 ("interrupted"), not 0, once its work returns."""
    import betty.memory

    def calibration_dropping_a_signal(device, write=True):
        _swallow_a_sigterm()
        return {"device": str(device)}

    monkeypatch.setattr(betty.memory, "calibrate", calibration_dropping_a_signal)
    res = invoke("calibrate", "--device", "cpu", "--no-write")
    assert res.exit_code == 130, res.output
    assert "betty: interrupted" in res.output


def test_ending_a_run_on_a_tracking_server_that_is_gone_takes_seconds(tracking, monkeypatch):
    """An interrupted run whose tracking server is gone: :func:`mark_failed` gives up
    within seconds (MLflow's own retries take minutes, with signals held meanwhile),
    does not raise over the interrupt it reports, and leaves the request settings as
    they were."""
    import socket
    import time

    import mlflow

    from workflow.runs import ENDING_REQUESTS, mark_failed

    run = mlflow.start_run()
    with socket.socket() as sock:  # a port nothing listens on: every request is refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")  # below the bound: kept
    settings = {key: os.environ.get(key) for key in ENDING_REQUESTS}
    start = time.monotonic()
    mark_failed(run.info.run_id, KeyboardInterrupt("signal SIGINT"))
    assert time.monotonic() - start < 30
    assert {key: os.environ.get(key) for key in ENDING_REQUESTS} == settings
    assert mlflow.active_run() is None  # off MLflow's stack; 'betty cleanup' ends it later


def test_a_signal_recorded_before_the_ranks_start_launches_none(tmp_path, monkeypatch):
    """A multi-rank train stage whose process recorded a signal (one a library swallowed)
    raises it instead of launching ranks that would never see it."""
    import signal as _signal

    import betty.distributed.launch as launch_module
    from workflow import signals
    from workflow.specfile import load_spec
    from workflow.training import train_distributed

    def launch(*args, **kwargs):
        raise AssertionError("ranks launched after a signal")

    monkeypatch.setattr(launch_module, "launch", launch)
    monkeypatch.chdir(tmp_path)  # the dataset's root
    rspec = load_spec("tiny", ["train.world_size=2"])
    previous = signals.install()
    try:
        with signals.shield():  # recorded only, as a swallowed one is
            os.kill(os.getpid(), _signal.SIGTERM)
            sum(i for i in range(1000))
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            train_distributed(rspec)
    finally:
        signals.restore(previous)


def test_each_repeat_of_a_multi_machine_stage_has_a_rendezvous_of_its_own(tmp_path, monkeypatch):
    """Every machine gives repeat r's launch the run ID ``<BETTY_RUN_ID>-repeat<r>``: a
    machine that meets the store of the previous repeat (still open on node 0) finds
    none of its keys there."""
    import betty.distributed.launch as launch_module
    from workflow.specfile import load_spec
    from workflow.training import train_distributed

    seen = []
    monkeypatch.setattr(launch_module, "launch", lambda *args, **options: seen.append(options["run_id"]) or {})
    monkeypatch.chdir(tmp_path)  # the dataset's root
    monkeypatch.setenv("BETTY_NNODES", "2")
    monkeypatch.setenv("BETTY_NODE_RANK", "1")
    monkeypatch.setenv("BETTY_RDZV_ENDPOINT", "127.0.0.1:29400")
    monkeypatch.setenv("BETTY_RUN_ID", "job")
    rspec = load_spec("tiny", ["train.world_size=2"])
    for repeat in (0, 1):
        train_distributed(rspec, repeat)
    assert seen == ["job-repeat0", "job-repeat1"]


def _gone_pid() -> str:
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()


def test_cleanup_looks_at_every_experiment_in_one_pass(tracking, monkeypatch):
    """Without --experiment, cleanup ends stuck runs of every experiment (not only
    Default); after a whole ``mlflow run`` group was SIGKILLed (main's process gone,
    its stage run not yet tagged with its own process) one pass ends both."""
    import socket

    uri, exp = tracking
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    client = MlflowClient(uri)
    other = client.create_experiment("another-experiment")
    main = client.create_run(other, tags={"run_kind": "main", "stage": "main", "betty.host": socket.gethostname(),
                                          "betty.pid": _gone_pid()}).info.run_id
    stage = client.create_run(other, tags={"run_kind": "stage", "stage": "sample",
                                           "mlflow.parentRunId": main}).info.run_id
    assert invoke("cleanup", "--fail").exit_code == 0
    assert client.get_run(main).info.status == "KILLED"
    assert client.get_run(stage).info.status == "KILLED"


def test_cleanup_judges_a_runs_process_by_its_owner(tracking):
    """``betty.owner`` names the process for sure: a live pid now held by a later
    process (another start time) is gone, a pid of another PID namespace (a container
    sharing the host's name) is not judged, nor is a ``betty.pid`` no system could hold;
    ``--fail`` keeps the failure recorded before in the ``error`` tag."""
    import dataclasses
    import socket

    from betty.owner import Owner

    uri, exp = tracking
    client = MlflowClient(uri)
    here = Owner.current()

    def run(owner: Owner | None, pid: str, **tags) -> str:
        tags = {"run_kind": "stage", "stage": "train", "betty.host": socket.gethostname(), "betty.pid": pid,
                **({"betty.owner": owner.prefix() + "run"} if owner else {}), **tags}
        return client.create_run(exp, tags=tags).info.run_id

    reused = run(dataclasses.replace(here, start=here.start + 1), str(here.pid), error="NonFiniteLoss: nan")
    container = run(dataclasses.replace(here, pid=int(_gone_pid()), pidns=here.pidns + 1), "1")
    alive = run(here, str(here.pid))
    garbled = run(None, "99999999999999999999")
    res = invoke("cleanup", "--experiment", "guards-test", "--json")
    assert res.exit_code == 0, res.output
    assert [r["run_id"] for r in json.loads(res.stdout)["stale"]] == [reused]
    assert invoke("cleanup", "--experiment", "guards-test", "--fail").exit_code == 0
    ended = client.get_run(reused)
    assert ended.info.status == "KILLED" and ended.data.tags["error"].startswith("NonFiniteLoss: nan; then stuck")
    for left in (container, alive, garbled):
        assert client.get_run(left).info.status == "RUNNING"
        client.set_terminated(left, "FINISHED")


def test_cleanup_pages_through_every_experiment(tracking, monkeypatch):
    """MLflow answers a bounded number of experiments a request: cleanup and compare
    follow the pages (here one experiment a page) to the last one."""
    import socket

    from mlflow.tracking import MlflowClient as Client

    uri, exp = tracking
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    client = MlflowClient(uri)
    first = client.create_experiment("paged-first")
    for i in range(3):
        client.create_experiment(f"paged-{i}")
    stuck = client.create_run(first, tags={"run_kind": "main", "stage": "main", "betty.host": socket.gethostname(),
                                           "betty.pid": _gone_pid()}).info.run_id
    real = Client.search_experiments
    monkeypatch.setattr(Client, "search_experiments",
                        lambda self, *a, **k: real(self, *a, **{**k, "max_results": 1}))
    listed = json.loads(invoke("cleanup", "--json").stdout)["stale"]
    assert [r["run_id"] for r in listed] == [stuck]
    client.set_terminated(stuck, "KILLED")


def test_cleanup_leaves_conda_project_runs_of_a_shared_server_alone(tracking, monkeypatch):
    """On a tracking server other machines share, a conda project run may be another
    machine's, still building its environment: no conda here says nothing about it."""
    import time

    import workflow.runs as runs

    uri, exp = tracking
    client = MlflowClient(uri)
    old = int((time.time() - 3600) * 1000)
    conda = client.create_run(exp, start_time=old, tags={"mlflow.project.entryPoint": "main",
                                                         "mlflow.project.env": "conda"}).info.run_id
    monkeypatch.setattr(runs, "local_store", lambda: False)
    monkeypatch.setattr("workflow.commands.cleanup._conda_missing", lambda: True)
    assert json.loads(invoke("cleanup", "--experiment", "guards-test", "--json").stdout)["stale"] == []
    monkeypatch.setattr(runs, "local_store", lambda: True)
    assert [r["run_id"] for r in json.loads(invoke("cleanup", "--experiment", "guards-test", "--json").stdout)["stale"]] \
        == [conda]
    client.set_terminated(conda, "FINISHED")


def test_cleanup_leaves_runs_without_betty_tags_alone(tracking):
    """An old RUNNING project run without betty's tags whose process may live (another
    project's ``mlflow run``, local environment) is neither listed nor ended."""
    import time

    uri, exp = tracking
    client = MlflowClient(uri)
    old = int((time.time() - 3600) * 1000)
    live = client.create_run(exp, start_time=old, tags={"mlflow.project.entryPoint": "main",
                                                        "mlflow.project.backend": "local"}).info.run_id
    listed = json.loads(invoke("cleanup", "--experiment", "guards-test", "--json").stdout)["stale"]
    assert listed == []
    assert invoke("cleanup", "--experiment", "guards-test", "--fail").exit_code == 0
    assert client.get_run(live).info.status == "RUNNING"
    client.set_terminated(live, "FINISHED")


def test_error_summary_leaves_out_a_native_stack_trace():
    from workflow.runs import error_summary

    class DGLError(Exception):
        pass

    err = DGLError("[12:00:00] spmm.cc:40: Feature data can only be float32 on CPU\nStack trace:\n"
                   "  [bt] (0) libdgl.so(+0x1)\n  [bt] (1) libdgl.so(+0x2)")
    assert error_summary(err) == "DGLError: [12:00:00] spmm.cc:40: Feature data can only be float32 on CPU"
    assert error_summary(ValueError("two\nlines")) == "ValueError: two\nlines"  # betty's own messages stay whole


def test_runs_made_from_other_data_are_neither_given_nor_found_upstream(tracking, monkeypatch):
    """A source file rewritten under the same spec is new data (another dataset digest):
    a stage run made from the old files is refused as ``--upstream`` and is not what
    ``betty stage evaluate`` looks up."""
    import workflow.components as components

    from workflow.specfile import load_spec

    sample = _stage("sample", "tiny")
    train = _stage("train", "tiny", "-s", "partition.sweep.k=[2]", "-s", "partition.sweep.methods=[range]")
    digest = components.dataset_digest(load_spec("tiny"))
    assert {MlflowClient().get_run(run).data.tags["dataset_digest"] for run in (sample, train)} == {digest}
    with monkeypatch.context() as changed:
        changed.setattr(components, "dataset_digest", lambda rspec: "0123456789abcdef")  # the file changed
        res = invoke("stage", "partition", "tiny", "--upstream", f"sample={sample}", "--experiment", "guards-test")
        assert res.exit_code == 2, res.output
        assert f"--upstream sample={sample}" in res.stderr and "was made from other data" in res.stderr
        assert "0123456789abcdef here" in res.stderr
        res = invoke("stage", "evaluate", "tiny", "-s", "partition.sweep.k=[2]", "-s",
                     "partition.sweep.methods=[range]", "--experiment", "guards-test")
        assert res.exit_code == 2 and "needs a train run of this spec" in res.stderr, res.output
    # the files as they were: both runs are taken again
    _stage("partition", "tiny", "--upstream", f"sample={sample}", "-s", "partition.sweep.k=[2]",
           "-s", "partition.sweep.methods=[range]")
    res = invoke("stage", "evaluate", "tiny", "-s", "partition.sweep.k=[2]", "-s", "partition.sweep.methods=[range]",
                 "--experiment", "guards-test", "--json")
    assert res.exit_code == 0, res.output
    evaluate = MlflowClient().get_run(json.loads(res.stdout)["run_id"])
    assert f"train={train}" in evaluate.data.tags["upstream"]


def test_a_lone_evaluate_does_not_take_a_train_run_split_by_other_partitioners(tracking, monkeypatch):
    """``betty stage evaluate`` looks up a train run whatever its upstream: one whose
    split was cut by other partitioner versions (or sized with other memory constants)
    is not found, since the model was trained on that split."""
    import workflow.reuse as reuse

    sweep = ("-s", "partition.sweep.k=[2]", "-s", "partition.sweep.methods=[range]")
    train = _stage("train", "tiny", *sweep)
    with monkeypatch.context() as upgraded:
        upgraded.setattr(reuse, "partitioner_versions", lambda: "pymetis 0.0")
        res = invoke("stage", "evaluate", "tiny", *sweep, "--experiment", "guards-test")
        assert res.exit_code == 2 and "needs a train run of this spec" in res.stderr, res.output
    res = invoke("stage", "evaluate", "tiny", *sweep, "--experiment", "guards-test", "--json")
    assert res.exit_code == 0, res.output
    evaluate = MlflowClient().get_run(json.loads(res.stdout)["run_id"])
    assert f"train={train}" in evaluate.data.tags["upstream"]


def test_stage_keys_name_the_kind_of_gpu_not_its_index(monkeypatch):
    """``cuda`` and ``cuda:0`` (and a second GPU of the same kind) are one key for the
    device-dependent stages; another kind of GPU is another key; cpu is unchanged."""
    import torch

    from workflow.reuse import device_identity, stage_key
    from workflow.specfile import load_spec

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_identity("cuda:1") == "cuda"  # no CUDA to ask: the type alone
    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H100 80GB HBM3", 2: "NVIDIA A100-SXM4-40GB"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: names[index])
    assert device_identity("cpu") == "cpu"
    assert device_identity("cuda") == device_identity("cuda:0") == "cuda (NVIDIA H100 80GB HBM3)"
    rspec = load_spec("tiny")
    for stage in ("partition", "train", "evaluate"):
        keys = {device: stage_key(rspec, stage, "u", device)["stage_sha"]
                for device in ("cuda", "cuda:0", "cuda:1", "cuda:2", "cpu")}
        assert keys["cuda"] == keys["cuda:0"] == keys["cuda:1"], stage
        assert len({keys["cuda"], keys["cuda:2"], keys["cpu"]}) == 3, stage


def test_a_batch_sampled_on_a_gpu_is_keyed_by_its_kind(monkeypatch):
    """With ``sampling.device: cuda`` the sample stage's key names the kind of GPU (and
    torch's version) that drew the batch; on the host it names none."""
    import torch

    from workflow.reuse import stage_key
    from workflow.specfile import load_spec

    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA A100-SXM4-40GB"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: names[index])
    on_gpu = load_spec("tiny", ["sampling.device=cuda", "train.pipeline=false"])
    on_host = load_spec("tiny")
    keys = {}
    for current in names:
        monkeypatch.setattr(torch.cuda, "current_device", lambda current=current: current)
        keys[current] = [stage_key(rspec, "sample", "u", "cuda")["stage_sha"] for rspec in (on_gpu, on_host)]
    assert keys[0][0] != keys[1][0]  # another kind of GPU: another key
    assert keys[0][1] == keys[1][1]  # host sampling: whichever GPU trains


def test_how_train_device_is_spelled_is_not_in_the_keys(monkeypatch):
    """``train.device: auto`` that resolves to the CPU and ``cpu`` are one key, as are
    ``cuda`` and ``cuda:0``: the device the spec resolves to is in the stage's runtime
    facts; a device of another kind is another key."""
    import torch

    from workflow.reuse import stage_key
    from workflow.specfile import load_spec

    def keys(*devices: str, resolved: str) -> set[tuple[str, str]]:
        """The train and evaluate keys of the spec with each of ``devices``."""
        return {tuple(stage_key(load_spec("tiny", [f"train.device={d}"]), stage, "u", resolved)["stage_sha"]
                      for stage in ("train", "evaluate")) for d in devices}

    assert len(keys("auto", "cpu", resolved="cpu")) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H100 80GB HBM3")
    on_gpu = keys("cuda", "cuda:0", "auto", resolved="cuda:0")
    assert len(on_gpu) == 1 and on_gpu != keys("cpu", resolved="cpu")
