"""``python -m workflow.finalize RUN_ID PID``: end ``RUN_ID`` ``KILLED`` once process
``PID`` has exited, if that process marked it ``FAILED`` over an interrupt.

Why: ``mlflow run`` (3.17), interrupted, stops its entry point's process, waits for it,
then ends the run ``FAILED`` unless it has already ended; its check compares the status
string with integer codes (``RunStatus.is_terminated("KILLED")`` is ``False``), so it
overwrites the ``KILLED`` that betty set. The same happens to a stage run under the
``main`` entry point (``mlflow.projects.run``, synchronous). The interrupted entry point cannot outlive
that write, so it starts this watcher (detached, :func:`spawn`) before it exits; the
watcher waits for the ``mlflow run`` process to exit (at most ``timeout_s``) and sets
the status back to ``KILLED`` when the run's ``error`` tag says ``KeyboardInterrupt``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["spawn", "watch"]


def _alive(pid: int) -> bool:
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


def watch(run_id: str, pid: int, timeout_s: float = 300.0) -> bool:
    """Wait for ``pid`` to exit, then end ``run_id`` ``KILLED`` if it was marked ``FAILED``
    over an interrupt. Returns whether it changed the status."""
    from mlflow.tracking import MlflowClient  # imported before the wait: act at once after it

    client = MlflowClient()
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    run = client.get_run(run_id)
    if run.info.status == "FAILED" and run.data.tags.get("error", "").startswith("KeyboardInterrupt"):
        client.set_terminated(run_id, "KILLED", end_time=run.info.end_time)
        return True
    return False


if __name__ == "__main__":
    watch(sys.argv[1], int(sys.argv[2]))
