"""``python -m workflow.finalize RUN_ID PID``: end ``RUN_ID`` ``KILLED`` once process
``PID`` has exited, if that process marked it ``FAILED`` over an interrupt.

Why: ``mlflow run`` (3.17), interrupted, stops its entry point's process, waits for it,
then ends the run ``FAILED`` unless it has already ended; its check compares the status
string with integer codes (``RunStatus.is_terminated("KILLED")`` is ``False``), so it
overwrites the ``KILLED`` that betty set. An entry point started by ``mlflow run``
cannot outlive it, so it starts this watcher (detached, :func:`spawn`) as soon as it
starts (an interrupted process may not get the chance later); the watcher waits for the
``mlflow run`` process to exit and then calls :func:`restore_killed`: the status goes
back to ``KILLED`` when the run ended ``FAILED`` and its ``error`` tag says
``KeyboardInterrupt``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["spawn", "watch", "restore_killed", "process_alive"]


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0; a process of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def spawn(run_id: str, pid: int) -> subprocess.Popen:
    """Start the watcher for ``run_id`` and process ``pid``, detached from this one."""
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.Popen([sys.executable, "-m", "workflow.finalize", run_id, str(pid)], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def restore_killed(client, run_id: str) -> bool:
    """End ``run_id`` ``KILLED`` if it ended ``FAILED`` with an ``error`` tag that says
    ``KeyboardInterrupt`` (MLflow's overwrite, see the module docstring). Returns
    whether it changed the status."""
    run = client.get_run(run_id)
    if run.info.status == "FAILED" and run.data.tags.get("error", "").startswith("KeyboardInterrupt"):
        client.set_terminated(run_id, "KILLED", end_time=run.info.end_time)
        return True
    return False


def watch(run_id: str, pid: int, timeout_s: float | None = None) -> bool:
    """Wait for ``pid`` to exit (at most ``timeout_s``), then :func:`restore_killed`."""
    from mlflow.tracking import MlflowClient  # imported before the wait: act at once after it

    client = MlflowClient()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while process_alive(pid) and (deadline is None or time.monotonic() < deadline):
        time.sleep(0.05)
    return restore_killed(client, run_id)


if __name__ == "__main__":
    watch(sys.argv[1], int(sys.argv[2]))
