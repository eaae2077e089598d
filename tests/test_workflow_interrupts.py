"""Interrupts and kills of ``mlflow run`` at several moments of a stage's life leave no
run ``RUNNING`` and no process alive (subprocesses on a copy of the project, a temporary
sqlite store, the tiny spec).

Moments: the ``main`` entry point still importing torch/DGL; a stage in flight under
``main`` (its nested run, in the entry point's process); the ``train`` entry point in
the middle of its epochs. Signals: ``SIGINT`` to the whole process group (Ctrl-C in a
terminal) and ``SIGTERM`` to the ``mlflow run`` process alone (which then dies without
cleanup; its children must notice).

After a Ctrl-C, the run ``mlflow run`` created (``MLFLOW_RUN_ID``) ends with the status
MLflow gives it on an interrupt, ``FAILED`` written over betty's ``KILLED``; betty's
``error`` tag on it names the ``KeyboardInterrupt``. betty's own nested runs end
``KILLED``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from test_workflow_support import command_line, new_experiment, new_store, project_copy, runs_of

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
        self._lines: list[str] = []  # read as it comes: a full pipe would block a writer
        self._reader = threading.Thread(target=self._lines.extend, args=(self.proc.stdout,), daemon=True)
        self._reader.start()

    def _output(self) -> str:
        return "".join(self._lines)

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
            assert self.proc.poll() is None, f"mlflow run ended before {what}:\n{self._output()[-3000:]}"
            time.sleep(0.2)
        self.proc.kill()
        raise AssertionError(f"timed out waiting for {what}")

    def process_running(self, *words: str) -> bool:
        for kid in self._watch():
            cmd = command_line(kid)
            if "workflow.mlproject" in cmd and all(w in cmd for w in words):
                return True
        return False

    def run_with(self, stage: str, status: str = "RUNNING", metric: str | None = None):
        for run in runs_of(self.uri, self.exp):
            if run.data.tags.get("stage") == stage and run.info.status == status and \
                    (metric is None or metric in run.data.metrics):
                return run
        return None

    def settle(self, timeout: float = 180.0, require_runs: bool = True,
               allow_unreached: bool = False) -> list:
        """Wait for ``mlflow run`` and every process it started to end (all within
        ``timeout``); return the runs (none RUNNING; at least one if ``require_runs``).
        ``allow_unreached``: a RUNNING run is accepted only if betty never saw it (no
        betty tag) and MLflow's CLI itself aborted ("Aborted!"): MLflow created the run
        and was interrupted before it started betty, so no betty code could end it."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._watch()
            time.sleep(0.05)
        hung = self.proc.poll() is None
        if hung:  # past the bound: stop the whole group so nothing outlives the test
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        alive = []
        while time.monotonic() < deadline:
            alive = [p for p in self.seen.values()
                     if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            if not alive:
                break
            time.sleep(0.2)
        left = [(p.pid, command_line(p)) for p in alive]
        for p in alive:  # left running: stop them, or reading the output below never ends
            p.kill()
        self._reader.join(timeout=10)  # the pipe's writers are gone: it ends
        self.output = self._output()
        assert not hung, f"mlflow run still running after {timeout} s\n{self.output[-3000:]}"
        assert not left, f"still alive: {left}\n{self.output[-3000:]}"
        runs = runs_of(self.uri, self.exp)
        stuck = [r for r in runs if r.info.status == "RUNNING"]
        if allow_unreached and "Aborted!" in self.output:
            stuck = [r for r in stuck if any(k.startswith("betty") or k in ("stage", "spec_sha")
                                             for k in r.data.tags)]
            runs = [r for r in runs if r.info.status != "RUNNING"]
        assert (runs or not require_runs) and not stuck, \
            ([(r.data.tags.get("stage"), r.info.status) for r in stuck], self.output[-3000:])
        return runs


LONG_TRAINING = "set=train.epochs=100000;evaluate.every=0"
"""A train stage that is still running whenever the signal comes."""


def _by_stage(runs) -> dict[str, str]:
    return {r.data.tags.get("stage", r.data.tags.get("mlflow.project.entryPoint")): r.info.status for r in runs}


def _interrupted_by_ctrl_c(runs, stage: str, output: str) -> dict[str, str]:
    """Check the run of ``stage`` that ``mlflow run`` created, after a Ctrl-C: ended
    (``FAILED``, MLflow's status on an interrupt, or ``KILLED``), its ``error`` tag
    naming the ``KeyboardInterrupt``; return every other run's status by stage."""
    (run,) = [r for r in runs if r.data.tags.get("mlflow.project.entryPoint") == stage]
    assert run.info.status in ("FAILED", "KILLED"), (run.info.status, output[-3000:])
    assert run.data.tags.get("error", "").startswith("KeyboardInterrupt"), (run.data.tags, output[-3000:])
    return _by_stage(r for r in runs if r is not run)


def test_sigint_to_group_while_main_imports(project):
    run = Launch(project, "int-imports", "main")
    run.wait_for("the main entry point", lambda: run.process_running("main"))
    time.sleep(1.0)  # inside the entry point's imports (torch, DGL: several seconds)
    assert run.run_with("download") is None  # no stage started yet
    os.killpg(run.proc.pid, signal.SIGINT)
    runs = run.settle()
    assert _interrupted_by_ctrl_c(runs, "main", run.output) == {}, run.output[-3000:]  # no stage run


def test_sigint_to_group_while_a_stage_runs(project):
    run = Launch(project, "int-stage", "main", LONG_TRAINING)
    run.wait_for("an epoch of the train stage", lambda: run.run_with("train", metric="loss") is not None)
    os.killpg(run.proc.pid, signal.SIGINT)
    runs = run.settle()
    assert _interrupted_by_ctrl_c(runs, "main", run.output) == {
        **dict.fromkeys(("download", "sample", "partition"), "FINISHED"), "train": "KILLED"}, run.output[-3000:]


def test_sigterm_to_mlflow_run_alone_while_a_stage_runs(project):
    run = Launch(project, "term-stage", "main", LONG_TRAINING)
    run.wait_for("an epoch of the train stage", lambda: run.run_with("train", metric="loss") is not None)
    os.kill(run.proc.pid, signal.SIGTERM)  # mlflow run dies at once, without cleanup
    runs = run.settle()
    assert _by_stage(runs) == {"main": "KILLED", **dict.fromkeys(("download", "sample", "partition"), "FINISHED"),
                              "train": "KILLED"}, run.output[-3000:]


def test_sigterm_to_mlflow_run_alone_while_training(project):
    run = Launch(project, "term-train", "train", LONG_TRAINING)
    run.wait_for("an epoch of training", lambda: run.run_with("train", metric="loss") is not None)
    os.kill(run.proc.pid, signal.SIGTERM)
    runs = run.settle()
    assert _by_stage(runs) == {"train": "KILLED"}, run.output[-3000:]
    assert "KeyboardInterrupt" in MlflowClient(run.uri).get_run(runs[0].info.run_id).data.tags["error"]


# --- a Ctrl-C during start-up, on a loaded machine -------------------------------------

STARTUP_BOUND_S = 30.0  # from the signal to the end of every process, at load


@pytest.fixture
def cpu_burner():
    """Two busy processes (one per core here) for the test's duration, each ending by
    itself after 10 minutes at most; killed at teardown."""
    code = "import time\nend = time.monotonic() + 600\nwhile time.monotonic() < end:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


STARTUP_MOMENTS = {
    # 0.5 s in: MLflow's CLI still importing (its start-up takes seconds anywhere)
    "launcher": lambda run: time.sleep(0.5) or True,
    # MLflow has created its run and is about to start the entry point
    "run created": lambda run: bool(runs_of(run.uri, run.exp)),
    # the entry point's process exists: betty's imports and spec load
    "entry point": lambda run: run.process_running(),
}


@pytest.mark.parametrize("moment", list(STARTUP_MOMENTS))
def test_sigint_to_group_during_startup_under_load(project, cpu_burner, moment):
    """Ctrl-C (SIGINT to the group) during ``mlflow run -e main``'s start-up: 0.5 s in,
    or at an observed moment (:data:`STARTUP_MOMENTS`), while two CPU burners load the machine:
    everything ends within the bound, no run that betty saw is left RUNNING, none of
    the stages ran. (When the signal reaches MLflow's CLI after it created its run and
    before it started betty, that run stays RUNNING with no betty tag: MLflow's own
    gap, which no betty code is alive to close.)"""
    run = Launch(project, f"startup-{moment.replace(' ', '-')}", "main")
    run.wait_for(moment, lambda: STARTUP_MOMENTS[moment](run), timeout=120)
    os.killpg(run.proc.pid, signal.SIGINT)
    signalled = time.monotonic()
    runs = run.settle(timeout=STARTUP_BOUND_S, require_runs=False, allow_unreached=True)
    assert time.monotonic() - signalled <= STARTUP_BOUND_S
    statuses = _by_stage(runs)
    assert set(statuses) <= {"main"}, (statuses, run.output[-3000:])  # no stage started
    assert all(s in ("KILLED", "FAILED") for s in statuses.values()), (statuses, run.output[-3000:])


ORPHAN_LAUNCHER = """\
import os, subprocess, sys
child = subprocess.Popen(sys.argv[2:], stdout=open(sys.argv[1], "w"), stderr=subprocess.STDOUT)
print(child.pid, flush=True)
os._exit(0)  # the launcher dies before its child could ask to be told (as mlflow run
             # interrupted inside its fork: the signal reached it, not the child)
"""


def test_main_entry_orphaned_at_birth_starts_no_stage(project):
    """The ``main`` entry point whose launcher died before it started (adopted by init,
    never signalled): it ends its run KILLED without starting any stage."""
    root, proj, uri, env = project
    client = MlflowClient(uri)
    exp = new_experiment(uri, "orphan-at-birth", root / "artifacts-orphan")
    parent_run = client.create_run(exp, tags={"mlflow.project.entryPoint": "main"})
    run_id = parent_run.info.run_id
    child_env = {**env, "MLFLOW_RUN_ID": run_id, "MLFLOW_EXPERIMENT_ID": exp}
    log = root / "orphan.log"
    cmd = [sys.executable, "-c", ORPHAN_LAUNCHER, str(log), sys.executable, "-m", "workflow.mlproject", "main",
           "--spec", "tiny", "--set", "", "--reuse", "true", "--nproc", ""]
    launcher = subprocess.run(cmd, cwd=proj, env=child_env, capture_output=True, text=True, timeout=60,
                              start_new_session=True)
    child = psutil.Process(int(launcher.stdout.split()[0]))
    try:
        deadline = time.monotonic() + 120
        while child.is_running() and child.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            stages = [r for r in runs_of(uri, exp) if r.info.run_id != run_id]
            assert not stages, ([(r.data.tags.get("stage"), r.info.status) for r in stages], log.read_text())
            time.sleep(0.5)
        assert not (child.is_running() and child.status() != psutil.STATUS_ZOMBIE), \
            f"the orphan still runs\n{log.read_text()}"
    finally:
        for proc in [child, *child.children(recursive=True)] if child.is_running() else []:
            proc.kill()
    assert client.get_run(run_id).info.status == "KILLED"
    assert [r.info.run_id for r in runs_of(uri, exp)] == [run_id]


KILLED_AFTER_START = """\
import os, signal
import mlflow
import workflow.runs
from workflow.specfile import load_spec

def die(*args):  # SIGKILL right after the run exists, before anything else is written
    os.kill(os.getpid(), signal.SIGKILL)

with mlflow.start_run(run_name="parent"):
    workflow.runs.mark_model_training = die
    with workflow.runs.tracked_run("stage", "sample", load_spec("tiny", []), nested=True):
        pass
"""


def test_run_killed_right_after_creation_has_betty_tags(project, monkeypatch):
    """SIGKILL right after a stage run is created: the run carries betty's tags from the
    start, so ``betty cleanup`` recognises it as stuck (process gone) and ends it."""
    from workflow.commands.cleanup import stale_runs

    root, proj, uri, env = project
    exp = new_experiment(uri, "killed-after-start", root / "artifacts-killed-after-start")
    proc = subprocess.run([sys.executable, "-c", KILLED_AFTER_START], cwd=proj,
                          env={**env, "MLFLOW_EXPERIMENT_ID": exp}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    child = [r for r in runs_of(uri, exp) if r.data.tags.get("mlflow.parentRunId")]
    assert len(child) == 1 and child[0].info.status == "RUNNING"
    assert child[0].data.tags["run_kind"] == "stage" and child[0].data.tags["betty.pid"].isdigit()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    stuck = {r.info.run_id: status for r, status, _ in stale_runs(exp, min_age_s=60)}
    assert stuck.get(child[0].info.run_id) == "KILLED"


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (``SigCgt`` in its
    ``/proc/<pid>/status``, a hexadecimal mask with bit ``sig - 1`` per signal)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(caught, 16) >> (sig - 1) & 1)


@pytest.mark.parametrize("delay_s", [0.1, 0.2, 0.4, 0.6, 0.9])
def test_sigint_while_betty_run_starts(project, tmp_path, delay_s):
    """Ctrl-C in the first second of ``betty run tiny`` (the command still importing),
    counted from the moment it holds its handlers (before that, in the interpreter's own
    start-up, Python's default handler prints the traceback): exit 130 with one line on
    stderr, no traceback, no run left RUNNING."""
    root, proj, uri, env = project
    exp_name = f"cli-start-{delay_s}"
    proc = subprocess.Popen([str(VENV_BIN / "betty"), "run", "tiny", "--experiment", exp_name], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while not _catches(proc.pid, signal.SIGTERM) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)  # Python leaves SIGTERM alone; betty's start-up catches it
    time.sleep(delay_s)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, (proc.returncode, err[-3000:])
    # betty's one line last; on a fast start MLflow may have logged creating the
    # experiment, and betty its progress, before it
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines[-1] == "betty: interrupted", err[-3000:]
    assert all(re.match(r"^(\S+ \S+ INFO mlflow\.|\[betty\] )", line) for line in lines[:-1]), err[-3000:]
    exp = MlflowClient(uri).get_experiment_by_name(exp_name)
    if exp is not None:
        assert all(r.info.status != "RUNNING" for r in runs_of(uri, exp.experiment_id))
