"""``betty run SPEC`` with ``dataset.store: distributed`` (DistDGL): the runs finish with
the losses of the run that holds the whole graph, on one launcher or two (two machines
on one host), and a graph server that dies ends every run FAILED naming it."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from distributed_cases import graph_server_pids
from test_workflow_support import assert_runs_failed, invoke, run_on_two_machines, runs_of

pytest.importorskip("dgl")
# the graph servers' log folders (kept after the failures injected here) under tmp_path
pytestmark = [pytest.mark.dgl, pytest.mark.workflow, pytest.mark.usefixtures("temp_in_tmp_path")]

EXPERIMENT = "distdgl-test"
FAST = ["-s", "partition.sweep.k=[2]", "-s", "partition.sweep.methods=[range]"]


def _ip_config(folder: Path, machines: int) -> Path:
    from betty.distributed.launch import free_port

    path = folder / f"ip_config_{machines}.txt"
    path.write_text("".join(f"127.0.0.1 {free_port()}\n" for _ in range(machines)))
    return path


def _store(ip_config: Path) -> list[str]:
    return ["-s", "dataset.store=distributed", "-s", f"dataset.store_ip_config={ip_config}"]


def _train_losses(uri: str, exp: str, store: str | None) -> list[float]:
    """The per-epoch losses of the last train run whose ``dataset.store`` is ``store``
    (``None``: not set, the local store)."""
    runs = [r for r in runs_of(uri, exp) if r.data.tags.get("stage") == "train"
            and r.data.params.get("spec.dataset.store") == store]
    return [m.value for m in MlflowClient(uri).get_metric_history(runs[-1].info.run_id, "loss")]


def _local_losses(uri: str, exp: str, *extra: str) -> list[float]:
    """The losses of ``tiny`` trained with the whole graph in each rank."""
    res = invoke("run", "tiny", "--no-reuse", *extra, *FAST)
    assert res.exit_code == 0, res.output
    return _train_losses(uri, exp, None)


def test_run_on_the_distributed_store_equals_the_run_on_the_whole_graph(tracking, tmp_path):
    """One machine (one partition, one server) and two trainers: the train run finishes
    with the losses of two ranks that each hold the whole graph, the partitioning is
    written once and the server is gone."""
    uri, exp = tracking
    ip_config = _ip_config(tmp_path, 1)
    res = invoke("run", "tiny", "--nproc", "2", *FAST, *_store(ip_config))
    assert res.exit_code == 0, res.output
    runs = runs_of(uri, exp)
    assert runs and all(r.info.status == "FINISHED" for r in runs)
    train = [r for r in runs if r.data.tags.get("stage") == "train"][0]
    assert train.data.metrics["world_size"] == 2.0
    assert train.data.params["spec.dataset.store"] == "distributed"
    store = _train_losses(uri, exp, "distributed")
    folders = list((tmp_path / "data" / "distdgl").iterdir())
    assert len(folders) == 1 and (folders[0] / "betty.json").is_file()
    assert not graph_server_pids(str(ip_config))
    assert store == pytest.approx(_local_losses(uri, exp, "--nproc", "2"), rel=1e-6, abs=0)


@pytest.mark.slow
def test_two_launchers_on_one_host_train_as_one_machine(tracking, tmp_path, monkeypatch):
    """``--nnodes 2``: node 1's launcher (its own process) serves partition 1 and lends a
    trainer; node 0 writes the partitioning, serves partition 0 and logs the runs, whose
    losses are those of the whole-graph run."""
    from betty.distributed.launch import free_port

    uri, exp = tracking
    reference = _local_losses(uri, exp, "--nproc", "2")
    for name in ("BETTY_NNODES", "BETTY_NODE_RANK", "BETTY_RDZV_ENDPOINT", "BETTY_RUN_ID"):
        monkeypatch.setenv(name, "")  # node 0's command sets them in this process: undone after the test
        monkeypatch.delenv(name)
    ip_config = _ip_config(tmp_path, 2)
    common = ["--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
              *FAST, *_store(ip_config)]
    res = run_on_two_machines(common, tmp_path, tmp_path / "node1.log")
    assert res.exit_code == 0, res.output
    runs = runs_of(uri, exp)
    assert runs and all(r.info.status == "FINISHED" for r in runs)
    assert not graph_server_pids(str(ip_config))
    assert _train_losses(uri, exp, "distributed") == pytest.approx(reference, rel=1e-6, abs=0)


@pytest.mark.slow
def test_a_dead_graph_server_ends_the_runs_failed_naming_it(tracking, tmp_path):
    uri, exp = tracking
    ip_config = _ip_config(tmp_path, 1)

    def kill_the_server():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not graph_server_pids(str(ip_config)):
            time.sleep(0.1)
        time.sleep(10)  # the trainers train by now
        for pid in graph_server_pids(str(ip_config)):
            os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_the_server)
    killer.start()
    res = invoke("run", "tiny", "--nproc", "2", *FAST, *_store(ip_config),
                 "-s", "train.epochs=100000", "-s", "evaluate.every=0", catch_exceptions=True)
    killer.join()
    assert_runs_failed(res, uri, exp, "graph server of machine 0 exited with code -9")


@pytest.mark.slow
def test_a_failing_trainer_on_the_store_ends_the_runs_failed_naming_it(tracking, tmp_path, monkeypatch):
    uri, exp = tracking
    monkeypatch.setenv("BETTY_FAULT", "raise@1")
    ip_config = _ip_config(tmp_path, 1)
    res = invoke("run", "tiny", "--nproc", "2", *FAST, *_store(ip_config), catch_exceptions=True)
    assert_runs_failed(res, uri, exp, "rank 1 failed: RuntimeError: injected")
    assert not graph_server_pids(str(ip_config))
