"""Helpers for the workflow tests (MLflow stores, run queries, the CLI in-process), plus
their own checks. The ``tracking`` fixture built on :func:`activate_store` is in
``conftest.py``.

Creating a new sqlite tracking store runs MLflow's schema migrations (about 10 s here),
so a migrated empty database is built once per machine under the temp folder and
copied for each test store. Tests never use the Default experiment (its artifact
location is fixed when the database is created): they create experiments with an
explicit artifact location inside their temporary folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

__all__ = ["new_store", "new_experiment", "activate_store", "end_active_runs", "runs_of", "metric_names",
           "project_copy", "invoke", "PROJECT"]

PROJECT = Path(__file__).resolve().parent.parent


def _template_db() -> Path:
    path = Path(tempfile.gettempdir()) / f"betty-test-mlflow-{mlflow.__version__}.db"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(suffix=".db", dir=path.parent)
        os.close(fd)
        os.unlink(tmp)
        MlflowClient(f"sqlite:///{tmp}").search_experiments()  # runs the migrations
        os.replace(tmp, path)
    return path


def new_store(folder: Path) -> str:
    """A fresh, migrated sqlite store in ``folder``; returns its tracking URI."""
    folder.mkdir(parents=True, exist_ok=True)
    db = folder / "mlflow.db"
    shutil.copyfile(_template_db(), db)
    return f"sqlite:///{db}"


def new_experiment(uri: str, name: str, artifacts: Path) -> str:
    """Create experiment ``name`` with artifacts under ``artifacts``; returns its ID."""
    return MlflowClient(uri).create_experiment(name, artifact_location=artifacts.resolve().as_uri())


def activate_store(tmp_path: Path, monkeypatch, experiment: str = "workflow-test") -> tuple[str, str]:
    """Point MLflow (in this process) at a fresh store with an active experiment named
    ``experiment``, and make ``tmp_path`` the working directory (the data root).
    Returns ``(tracking URI, experiment ID)``."""
    uri = new_store(tmp_path / "store")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    exp = new_experiment(uri, experiment, tmp_path / "artifacts")
    mlflow.set_experiment(experiment_id=exp)
    return uri, exp


def end_active_runs() -> None:
    """End runs a failing test may have left active, so no later test inherits them."""
    while mlflow.active_run() is not None:
        mlflow.end_run("FAILED")


def runs_of(uri: str, experiment_id: str, query: str = "") -> list:
    """Every run of the experiment (all statuses), oldest first."""
    return MlflowClient(uri).search_runs([experiment_id], query, max_results=1000,
                                         order_by=["attributes.start_time ASC"])


def assert_runs_failed(res, uri: str, experiment_id: str, words: str) -> None:
    """The command failed, the train and parent (``main``) runs ended FAILED, the train
    run's ``error`` tag holds ``words``, and no run is left RUNNING."""
    assert res.exit_code != 0
    runs = runs_of(uri, experiment_id)
    assert not [r for r in runs if r.info.status == "RUNNING"]
    train = [r for r in runs if r.data.tags.get("stage") == "train"][0]
    assert train.info.status == "FAILED"
    assert words in train.data.tags.get("error", ""), train.data.tags.get("error")
    main = [r for r in runs if r.data.tags.get("stage") == "main"][0]
    assert main.info.status == "FAILED"


def metric_names(run) -> set[str]:
    return set(run.data.metrics)


def project_copy(dest: Path) -> Path:
    """Copy the files ``mlflow run`` needs (MLproject, conda.yaml, specs/, betty/,
    workflow/) to ``dest``, so concurrent edits of the working tree cannot change the
    code version between two runs of a test."""
    dest.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("betty", "workflow", "specs"):
        shutil.copytree(PROJECT / name, dest / name, ignore=ignore)
    for name in ("MLproject", "conda.yaml"):
        shutil.copy2(PROJECT / name, dest / name)
    return dest


def command_line(proc) -> str:
    """``proc``'s (a ``psutil.Process``) command line, or "" when it cannot be read: a
    short-lived child may already be a zombie, or gone, by the time it is looked at."""
    import psutil

    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def invoke(*args: str, catch_exceptions: bool = False):
    """Run the ``betty`` CLI in this process with ``args`` (Typer's runner); returns its
    ``Result``. With ``catch_exceptions=False`` an uncaught exception fails the test with
    its own traceback instead of a bare exit code."""
    from typer.testing import CliRunner

    from workflow.cli import app

    return CliRunner().invoke(app, list(args), catch_exceptions=catch_exceptions)


def test_store_template_is_reusable(tmp_path):
    uri = new_store(tmp_path / "a")
    exp = new_experiment(uri, "x", tmp_path / "art")
    assert MlflowClient(uri).get_experiment(exp).artifact_location.startswith("file:")
    assert new_store(tmp_path / "b") != uri


def test_tests_run_outside_the_checkout():
    """conftest puts every test in a temporary working directory: the default data root
    (``data/``, with betty's cache) and MLflow's default store resolve outside the checkout."""
    from betty.data import cache_path

    cwd = Path.cwd().resolve()
    assert PROJECT not in (cwd, *cwd.parents)
    assert PROJECT not in cache_path("synthetic", num_nodes=50).resolve().parents


def run_on_two_machines(common: list[str], folder: Path, log: Path):
    """``betty run tiny`` as two machines on this host: node 1 in a process of its own
    (output in ``log``), node 0 here (:func:`invoke`), both with the arguments
    ``common`` (``--nnodes 2 ...``); returns node 0's result once node 1 ended with
    exit code 0 (a failing node 1 fails the test with the end of its log)."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(PROJECT), "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        node1 = subprocess.Popen([str(Path(sys.executable).parent / "betty"), "run", "tiny", "--node-rank", "1",
                                  *common], cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            res = invoke("run", "tiny", "--node-rank", "0", *common)
            assert node1.wait(timeout=240) == 0, log.read_text()[-3000:]
        finally:
            if node1.poll() is None:
                node1.kill()
    return res
