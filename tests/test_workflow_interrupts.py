"""Interrupts and kills of ``mlflow run`` at several moments of a stage's life leave no
run ``RUNNING`` and no process alive (subprocesses on a copy of the project, a temporary
sqlite store, the tiny spec).

Moments: the ``main`` entry point still importing torch/DGL; a stage process in flight
under ``main``; the ``train`` entry point in the middle of its epochs. Signals: ``SIGINT``
to the whole process group (Ctrl-C in a terminal) and ``SIGTERM`` to the ``mlflow run``
process alone (which then dies without cleanup; its children must notice).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from test_workflow_support import new_experiment, new_store, project_copy, runs_of

VENV_BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("interrupts")
    proj = project_copy(root / "project")
    uri = new_store(root / "store")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    return root, proj, uri, env


class Launch:
    """``mlflow run`` in its own process group, watching its descendants."""

    def __init__(self, project, name: str, entry: str, *params: str) -> None:
        root, proj, self.uri, env = project
        self.exp = new_experiment(self.uri, name, root / f"artifacts-{name}")
        cmd = [str(VENV_BIN / "mlflow"), "run", str(proj), "-e", entry, "--env-manager", "local",
               "--experiment-id", self.exp, "-P", "spec=tiny"]
        for p in params:
            cmd += ["-P", p]
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.seen: dict[int, psutil.Process] = {}

    def _watch(self) -> list[psutil.Process]:
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        for kid in kids:
            self.seen.setdefault(kid.pid, kid)
        return kids

    def wait_for(self, what: str, ready, timeout: float = 300.0) -> None:
        """Poll until ``ready()`` (watching the process tree meanwhile)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._watch()
            if ready():
                return
            assert self.proc.poll() is None, f"mlflow run ended before {what}:\n{self.proc.stdout.read()[-3000:]}"
            time.sleep(0.2)
        self.proc.kill()
        raise AssertionError(f"timed out waiting for {what}")

    def process_running(self, *words: str) -> bool:
        for kid in self._watch():
            try:
                cmd = " ".join(kid.cmdline())
            except psutil.Error:
                continue
            if "workflow.mlproject" in cmd and all(w in cmd for w in words):
                return True
        return False

    def run_with(self, stage: str, status: str = "RUNNING", metric: str | None = None):
        for run in runs_of(self.uri, self.exp):
            if run.data.tags.get("stage") == stage and run.info.status == status and \
                    (metric is None or metric in run.data.metrics):
                return run
        return None

    def _watchers(self) -> list[psutil.Process]:
        """``workflow.finalize`` processes for this experiment's runs (detached, so not
        descendants of ``mlflow run``)."""
        ids = {r.info.run_id for r in runs_of(self.uri, self.exp)}
        out = []
        for proc in psutil.process_iter(["cmdline"]):
            cmd = proc.info["cmdline"] or []
            if "workflow.finalize" in cmd and ids & set(cmd):
                out.append(proc)
        return out

    def settle(self, timeout: float = 180.0) -> list:
        """Wait for ``mlflow run`` and every process it started to end; return the runs."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._watch()
            time.sleep(0.05)
        self.proc.wait(timeout=1)
        alive = []
        while time.monotonic() < deadline:
            alive = [p for p in [*self.seen.values(), *self._watchers()]
                     if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            if not alive:
                break
            time.sleep(0.2)
        left = [(p.pid, " ".join(p.cmdline())) for p in alive]
        for p in alive:  # left running: stop them, or reading the output below never ends
            p.kill()
        self.output = self.proc.stdout.read()
        assert not left, f"still alive: {left}\n{self.output[-3000:]}"
        runs = runs_of(self.uri, self.exp)
        assert runs and all(r.info.status != "RUNNING" for r in runs), \
            ([(r.data.tags.get("stage"), r.info.status) for r in runs], self.output[-3000:])
        return runs


def _by_stage(runs) -> dict[str, str]:
    return {r.data.tags.get("stage", r.data.tags.get("mlflow.project.entryPoint")): r.info.status for r in runs}


def test_sigint_to_group_while_main_imports(project):
    run = Launch(project, "int-imports", "main")
    run.wait_for("the main entry point", lambda: run.process_running("main"))
    time.sleep(1.0)  # inside the entry point's imports (torch, DGL: several seconds)
    assert run.run_with("download") is None  # no stage started yet
    os.killpg(run.proc.pid, signal.SIGINT)
    runs = run.settle()
    assert _by_stage(runs) == {"main": "KILLED"}, run.output[-3000:]


def test_sigint_to_group_while_a_stage_runs(project):
    run = Launch(project, "int-stage", "main")
    run.wait_for("the sample stage", lambda: run.run_with("sample") is not None and run.process_running("sample"))
    time.sleep(1.0)
    os.killpg(run.proc.pid, signal.SIGINT)
    runs = run.settle()
    assert _by_stage(runs) == {"main": "KILLED", "download": "FINISHED", "sample": "KILLED"}, run.output[-3000:]


def test_sigterm_to_mlflow_run_alone_while_a_stage_runs(project):
    run = Launch(project, "term-stage", "main")
    run.wait_for("the sample stage", lambda: run.run_with("sample") is not None and run.process_running("sample"))
    time.sleep(1.0)
    os.kill(run.proc.pid, signal.SIGTERM)  # mlflow run dies at once, without cleanup
    runs = run.settle()
    assert _by_stage(runs) == {"main": "KILLED", "download": "FINISHED", "sample": "KILLED"}, run.output[-3000:]


def test_sigterm_to_mlflow_run_alone_while_training(project):
    run = Launch(project, "term-train", "train", "set=train.epochs=100000;evaluate.every=0")
    run.wait_for("an epoch of training", lambda: run.run_with("train", metric="loss") is not None)
    os.kill(run.proc.pid, signal.SIGTERM)
    runs = run.settle()
    assert _by_stage(runs) == {"train": "KILLED"}, run.output[-3000:]
    assert "KeyboardInterrupt" in MlflowClient(run.uri).get_run(runs[0].info.run_id).data.tags["error"]
