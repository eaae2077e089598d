"""A failure or an interrupt on the preparation thread of a pipelined ``train`` stage
ends the run as one in the step would: FAILED with the error, or KILLED, and no
preparation thread is left."""

from __future__ import annotations

import threading
import time

from test_workflow_support import invoke, runs_of

EXPERIMENT = "pipeline-test"  # the conftest tracking fixture's experiment
FAST = ["-s", "partition.sweep.k=[2]", "-s", "partition.sweep.methods=[range]", "-s", "train.epochs=3"]


def _fail_preparing(monkeypatch, error: BaseException) -> list[str]:
    """Make :meth:`betty.engine.Trainer.prepare` raise ``error`` for epoch 1, and
    record the thread each preparation ran on."""
    from betty.engine import Trainer

    real, threads = Trainer.prepare, []

    def prepare(self, epoch, batch_index, carve=False):
        threads.append(threading.current_thread().name)
        if epoch == 1:
            raise error
        return real(self, epoch, batch_index, carve)

    monkeypatch.setattr(Trainer, "prepare", prepare)
    return threads


def _no_prepare_thread(within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while [t for t in threading.enumerate() if t.name == "betty-prepare"]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _train_runs(uri, exp):
    runs = runs_of(uri, exp)
    return ([r for r in runs if r.data.tags.get("stage") == "train"],
            [r for r in runs if r.data.tags.get("run_kind") == "main"])


def test_an_error_while_preparing_fails_the_run_with_it(tracking, monkeypatch):
    uri, exp = tracking
    threads = _fail_preparing(monkeypatch, OSError("the feature file vanished"))
    res = invoke("run", "tiny", "--experiment", EXPERIMENT, *FAST)
    assert res.exit_code == 1, res.output
    assert "the feature file vanished" in res.stderr
    train, parent = _train_runs(uri, exp)
    assert [r.info.status for r in train] == ["FAILED"]
    assert "the feature file vanished" in train[0].data.tags["error"]
    assert [r.info.status for r in parent] == ["FAILED"]
    assert "betty-prepare" in threads  # it was the preparation thread's error
    assert _no_prepare_thread()


def test_an_interrupt_while_preparing_ends_the_run_killed(tracking, monkeypatch):
    uri, exp = tracking
    _fail_preparing(monkeypatch, KeyboardInterrupt())
    res = invoke("run", "tiny", "--experiment", EXPERIMENT, *FAST)
    assert res.exit_code != 0, res.output
    train, parent = _train_runs(uri, exp)
    assert [r.info.status for r in train] == ["KILLED"]
    assert [r.info.status for r in parent] == ["KILLED"]
    assert not [r for r in runs_of(uri, exp) if r.info.status == "RUNNING"]
    assert _no_prepare_thread()
