"""MLflow-native records: experiment per spec typed as model training, the dataset as a
run input, the trained model as a loadable MLflow model (``workflow.tracking``)."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import time

import mlflow
import mlflow.pytorch
import pytest
import torch
from mlflow.tracking import MlflowClient

from test_workflow_support import invoke
from workflow.specfile import load_spec
from workflow.tracking import EXPERIMENT_KIND_TAG, MODEL_TRAINING, dataset_input, experiment_name

FAST = ["-s", "partition.sweep.k=[2]", "-s", "partition.sweep.methods=[range]"]


@pytest.fixture
def tracking(tracking, monkeypatch):
    """conftest's fresh store, but no experiment chosen by the environment
    (``mlflow.set_experiment`` in ``activate_store`` exports ``MLFLOW_EXPERIMENT_ID``, a
    fresh CLI process has none)."""
    for var in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    return tracking


def test_experiment_name_precedence(monkeypatch):
    for var in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    tiny = load_spec("tiny")
    named = load_spec("tiny", ["experiment=team-x"])
    assert experiment_name(tiny) == "tiny"
    assert experiment_name(named) == "team-x"
    assert named.sha == tiny.sha  # a label: changes no result, no reuse key
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "7")
    assert experiment_name(named) is None  # the environment fixes it by ID
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    assert experiment_name(named) == "from-env"
    assert experiment_name(named, "from-cli") == "from-cli"


def test_dataset_digest_follows_the_data():
    a = dataset_input(load_spec("tiny"))
    b = dataset_input(load_spec("tiny", ["dataset.seed=1"]))
    assert a.name == "synthetic" and len(a.digest) == 16
    assert a.digest != b.digest
    assert a.digest == dataset_input(load_spec("tiny", ["experiment=other"])).digest


def test_run_records_are_mlflow_native(tracking, tmp_path):
    from betty.inference import layerwise_inference

    from workflow.components import build_model, load_data

    uri, _ = tracking
    client = MlflowClient(uri)
    res = invoke("run", "tiny", "--json", "-s", "experiment=team-x", *FAST)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    exp = client.get_experiment_by_name("team-x")
    assert exp is not None and out["experiment_id"] == exp.experiment_id
    assert exp.tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING

    rspec = load_spec("tiny", ["experiment=team-x", *FAST[1::2]])
    expected = dataset_input(rspec)
    train_id = out["stages"]["train"]["run_id"]
    for run_id in (out["run_id"], train_id):  # the parent and the train run
        inputs = client.get_run(run_id).inputs.dataset_inputs
        assert [(i.dataset.name, i.dataset.digest) for i in inputs] == [("synthetic", expected.digest)]
    assert client.get_run(train_id).info.run_name == "tiny/train"

    logged = client.search_logged_models([exp.experiment_id])
    assert [m.source_run_id for m in logged] == [train_id]
    loaded = mlflow.pytorch.load_model(f"runs:/{train_id}/model", dst_path=str(tmp_path / "loaded"))
    ds = load_data(rspec)
    reference = build_model(rspec, ds)
    path = mlflow.artifacts.download_artifacts(run_id=train_id, artifact_path="model.pt", dst_path=str(tmp_path))
    reference.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    reference.eval()
    assert type(loaded) is type(reference) and not loaded.training
    a = layerwise_inference(loaded, ds.graph, ds.feat, device=torch.device("cpu"))
    b = layerwise_inference(reference, ds.graph, ds.feat, device=torch.device("cpu"))
    assert torch.equal(a, b)
    spec_yaml = mlflow.artifacts.download_artifacts(f"runs:/{train_id}/model/extra_files/spec.yaml", dst_path=str(tmp_path))
    assert load_spec(spec_yaml).sha == rspec.sha


def test_logged_model_carries_the_final_metrics_and_the_dataset(tracking, caplog):
    """The logged model's metrics are the last epoch's (not the first's), each names the
    spec's dataset (the UI's "Datasets used"), and logging it prints no pickle warning."""
    import logging

    uri, _ = tracking
    client = MlflowClient(uri)
    res = invoke("run", "tiny", "--json", "-s", "train.epochs=3", *FAST)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    train_id = out["stages"]["train"]["run_id"]
    names = set(client.get_run(out["run_id"]).data.metrics)
    stems = [re.sub(r"s(?=_|$)", "", n) for n in names]  # time_blocks_s and time_block_s: one figure
    assert len(set(stems)) == len(stems), sorted(names)
    (model,) = client.search_logged_models([client.get_run(train_id).info.experiment_id])
    logged = client.get_logged_model(model.model_id)
    by_key = {m.key: m for m in logged.metrics}
    assert {"loss", "train_acc", "valid_acc"} <= set(by_key)
    for key, metric in by_key.items():
        last = client.get_metric_history(train_id, key)[-1]
        assert metric.step == last.step == 2, key
        assert metric.value == last.value, key
    expected = dataset_input(load_spec("tiny", ["train.epochs=3", *FAST[1::2]]))
    assert {(m.dataset_name, m.dataset_digest) for m in logged.metrics} == {("synthetic", expected.digest)}
    pickle_warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "Pickle" in r.getMessage()]
    assert not pickle_warnings


def test_losing_the_experiment_create_race_still_activates_it(tracking, monkeypatch):
    """Two team members start at once: the second ``create_experiment`` fails with
    RESOURCE_ALREADY_EXISTS. MLflow 3.17's ``set_experiment`` then returns the experiment
    without activating it; betty must still log into it, not into "Default"."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS
    from mlflow.tracking._tracking_service.client import TrackingServiceClient

    from workflow.tracking import use_spec_experiment

    real_create = TrackingServiceClient.create_experiment

    def lose_the_race(self, name, *args, **kwargs):
        real_create(self, name, *args, **kwargs)  # the other member's create wins
        raise MlflowException(f"experiment {name!r} already exists", error_code=RESOURCE_ALREADY_EXISTS)

    monkeypatch.setattr(TrackingServiceClient, "create_experiment", lose_the_race)
    exp_id = use_spec_experiment(load_spec("tiny"), "raced")
    assert exp_id == MlflowClient().get_experiment_by_name("raced").experiment_id
    with mlflow.start_run() as run:
        assert run.info.experiment_id == exp_id


INTERRUPT_IN_SESSION = """\
import os, signal, sys
from workflow import signals
signals.install()
import mlflow
import sqlalchemy.orm
from sqlalchemy import event
from workflow.runs import tracked_run
from workflow.specfile import load_spec

armed = []

@event.listens_for(sqlalchemy.orm.Session, "after_transaction_end")
def interrupt(*args):  # SIGINT to this process while the store's session is closing
    if armed:
        armed.clear()
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(1000))  # bytecode: the handler runs here, inside the session

try:
    with tracked_run("stage", "sample", load_spec("tiny", [])) as run:
        armed.append(1)
        mlflow.set_tag("written", "yes")
        print("not interrupted")
except KeyboardInterrupt:
    print("KeyboardInterrupt", run.info.run_id)
"""


def test_signal_inside_a_store_session_is_raised_after_it(tmp_path):
    """A SIGINT that lands inside one of MLflow's database sessions is raised once the
    session has ended: the write completes, the run ends KILLED, later writes work."""
    from test_workflow_support import PROJECT, new_experiment, new_store

    uri = new_store(tmp_path / "store")
    exp = new_experiment(uri, "in-session", tmp_path / "artifacts")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_ID": exp, "PYTHONPATH": str(PROJECT)}
    out = subprocess.run([sys.executable, "-c", INTERRUPT_IN_SESSION], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("KeyboardInterrupt"), out.stdout + out.stderr[-3000:]
    run = MlflowClient(uri).get_run(out.stdout.split()[1])
    assert run.info.status == "KILLED"
    assert run.data.tags["written"] == "yes"
    assert run.data.tags["error"].startswith("KeyboardInterrupt")


INTERRUPT_IN_CREATE = """\
import os, signal
from workflow import signals
signals.install()
import mlflow
from mlflow.tracking import MlflowClient
from workflow.runs import tracked_run
from workflow.specfile import load_spec

create = MlflowClient.create_run

def create_then_interrupt(self, *args, **kwargs):  # SIGINT once the run row exists
    run = create(self, *args, **kwargs)
    print("created", run.info.run_id, flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    sum(range(1000))  # bytecode: the handler runs here, inside the run's creation
    return run

MlflowClient.create_run = create_then_interrupt
try:
    with tracked_run("stage", "sample", load_spec("tiny", [])):
        print("not interrupted")
except KeyboardInterrupt:
    print("KeyboardInterrupt")
"""


def test_signal_while_a_run_is_created_ends_it_killed(tmp_path):
    """A SIGINT that lands while MLflow creates a stage's run (the row exists, MLflow's
    run stack does not hold it yet) ends that run KILLED, not RUNNING."""
    from test_workflow_support import PROJECT, new_experiment, new_store

    uri = new_store(tmp_path / "store")
    exp = new_experiment(uri, "in-create", tmp_path / "artifacts")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_ID": exp, "PYTHONPATH": str(PROJECT)}
    out = subprocess.run([sys.executable, "-c", INTERRUPT_IN_CREATE], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    lines = out.stdout.split()
    assert out.returncode == 0 and lines[0] == "created" and lines[-1] == "KeyboardInterrupt", \
        out.stdout + out.stderr[-3000:]
    run = MlflowClient(uri).get_run(lines[1])
    assert run.info.status == "KILLED" and run.data.tags["error"].startswith("KeyboardInterrupt")


def test_run_creation_holds_signals_only_where_it_cannot_hang(monkeypatch):
    """Signals are held while a run is created on a database or file store, not against a
    tracking server (whose client retries for minutes when the server is gone)."""
    from workflow.runs import local_store

    for uri, local in [("sqlite:////tmp/x.db", True), ("postgresql://u@h/db", True), ("file:///tmp/mlruns", True),
                       ("http://127.0.0.1:5000", False), ("https://mlflow.example", False)]:
        monkeypatch.setattr(mlflow, "get_tracking_uri", lambda uri=uri: uri)
        assert local_store() is local, uri


CREATE_STORE = """\
import os, sys, time
import workflow.tracking  # betty's tracking setup
from mlflow.tracking import MlflowClient

while not os.path.exists(sys.argv[2]):  # start together
    time.sleep(0.01)
MlflowClient(sys.argv[1]).search_experiments()
"""


def test_three_processes_create_one_fresh_store(tmp_path):
    """Three processes opening one fresh sqlite store at once: all succeed (only one
    creates the schema; without the lock two failed with schema-migration errors)."""
    from test_workflow_support import PROJECT

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(PROJECT), "MLFLOW_DISABLE_TELEMETRY": "true"}
    procs = [subprocess.Popen([sys.executable, "-c", CREATE_STORE, uri, str(go)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(3)]
    try:
        time.sleep(3)  # past the imports
        go.touch()
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(o[-1500:] for o in outs)
    assert len(MlflowClient(uri).search_experiments()) == 1  # Default
