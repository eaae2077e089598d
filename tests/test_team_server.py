"""Team mode for real: PostgreSQL + ``mlflow server``, two ``betty run`` at once.

Starts Debian's PostgreSQL (``initdb``/``pg_ctl``; as the ``postgres`` user when the
tests run as root, since ``initdb`` refuses root) on a free loopback port, then
``mlflow server --backend-store-uri postgresql://... --artifacts-destination <folder>``
on another, runs the ``tiny`` spec twice concurrently against
``MLFLOW_TRACKING_URI=http://127.0.0.1:PORT`` and checks the runs, metrics, artifacts and
logged model through the client. Missing PostgreSQL binaries or ``psycopg2`` FAIL the
test (``.ci/run`` installs PostgreSQL; ``betty[server]`` brings ``psycopg2-binary``).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from test_workflow_support import PROJECT

pytestmark = pytest.mark.slow

FAST = ["-s", "partition.sweep.k=[2]", "-s", "partition.sweep.methods=[range]"]


def _pg_bin() -> Path:
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not candidates:
        pytest.fail("PostgreSQL server binaries not found (initdb): apt-get install -y postgresql "
                    "(.ci/run does this)")
    return Path(candidates[-1]).parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _as_pg_user(cmd: list[str]) -> list[str]:
    """``cmd`` as the ``postgres`` user when running as root (initdb refuses root)."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"mlflow server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"mlflow server not answering {url} after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


@pytest.fixture
def postgres():
    """A throw-away PostgreSQL cluster on 127.0.0.1; yields the database URI."""
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        pytest.fail("psycopg2 missing: pip install -e '.[server]'")
    bin_dir = _pg_bin()
    root = Path(tempfile.mkdtemp(prefix="betty-pg-"))  # not under pytest's root-only tmp
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        shutil.chown(sock, "postgres")
    port = _free_port()
    subprocess.run(_as_pg_user([str(bin_dir / "initdb"), "-D", str(data), "-U", "betty", "--auth=trust",
                                "-E", "UTF8"]), check=True, capture_output=True)
    subprocess.run(_as_pg_user([str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "pg.log"), "-w",
                                "-o", f"-p {port} -k {sock} -h 127.0.0.1", "start"]), check=True, capture_output=True)
    try:
        subprocess.run([str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "betty", "mlflow"],
                       check=True, capture_output=True)
        yield f"postgresql+psycopg2://betty@127.0.0.1:{port}/mlflow"
    finally:
        subprocess.run(_as_pg_user([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"]),
                       capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def server(postgres, tmp_path):
    """``mlflow server`` on the PostgreSQL store, artifacts proxied to a local folder;
    yields ``(tracking URI, artifacts folder)``."""
    artifacts = tmp_path / "artifacts"
    port = _free_port()
    log = tmp_path / "server.log"
    # No job runner: betty logs runs, metrics, artifacts and models, none of which uses
    # MLflow's server-side jobs (GenAI evaluation), and its seven huey consumers took
    # most of this test's CPU on a 2-core machine.
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", postgres,
             "--artifacts-destination", str(artifacts), "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1"], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc, log)
        yield f"http://127.0.0.1:{port}", artifacts
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_two_members_run_tiny_at_once_on_a_postgres_server(server, tmp_path, monkeypatch):
    import mlflow
    import mlflow.pytorch
    from mlflow.tracking import MlflowClient

    from workflow.tracking import EXPERIMENT_KIND_TAG, MODEL_TRAINING

    uri, artifacts = server
    env = {k: v for k, v in os.environ.items()
           if k not in ("MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID")}
    env.update(MLFLOW_TRACKING_URI=uri, MLFLOW_DISABLE_TELEMETRY="true",
               PYTHONPATH=os.pathsep.join([str(PROJECT), env.get("PYTHONPATH", "")]))
    procs = []
    for member in ("alice", "bob"):
        work = tmp_path / member  # each member's own working copy / data root
        work.mkdir()
        procs.append(subprocess.Popen(
            [sys.executable, "-c", "from workflow.cli import app; app()", "run", "tiny", "--json", *FAST],
            cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout))

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("tiny")
    assert exp.tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING
    assert {o["experiment_id"] for o in outs} == {exp.experiment_id}
    runs = client.search_runs([exp.experiment_id])
    assert runs and {r.info.status for r in runs} == {"FINISHED"}
    parents = [r for r in runs if r.data.tags.get("run_kind") == "main"]
    assert sorted(r.info.run_id for r in parents) == sorted(o["run_id"] for o in outs)
    for out in outs:
        parent = client.get_run(out["run_id"])
        assert {"test_acc", "valid_acc", "redundancy", "peak_mem_measured_bytes"} <= set(parent.data.metrics)
        assert parent.data.metrics["test_acc"] == out["metrics"]["test_acc"]
        train = out["stages"]["train"]["run_id"]
        assert [m.step for m in client.get_metric_history(train, "loss")] == [0, 1]
        names = {a.path for a in client.list_artifacts(train)}
        assert {"model.pt", "spec.yaml", "memory_per_microbatch.csv", "models.json"} <= names
        model = mlflow.pytorch.load_model(f"runs:/{train}/model", dst_path=str(tmp_path / "loaded"))
        assert sum(p.numel() for p in model.parameters()) > 0
    logged = client.search_logged_models([exp.experiment_id])
    trains = {o["stages"]["train"]["run_id"] for o in outs}
    assert trains <= {m.source_run_id for m in logged}
    # artifacts went through the server into its destination folder
    stored = {p.name for p in artifacts.rglob("*") if p.is_file()}
    assert {"model.pt", "spec.yaml", "MLmodel"} <= stored
