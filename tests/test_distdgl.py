"""DistDGL as the graph store (:mod:`betty.backends.distdgl`): the partitions keep the
original IDs, two graph servers and two trainers on 127.0.0.1 train exactly as one
process with the whole graph (float64, dropout), and a dead server or trainer ends the
launch naming it, with no process or shared memory left behind."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("dgl")
pytestmark = pytest.mark.dgl

from betty.backends.distdgl import (GraphServerError, connect, launch, read_ip_config,  # noqa: E402
                                    read_layout, write_partitions)
from betty.backends.distdgl.cluster import READY  # noqa: E402
from betty.distributed.launch import free_port  # noqa: E402
from distributed_cases import (case_name, dataset, graph_server_pids, rank_distdgl_cases,  # noqa: E402
                               rank_fail_on_one, rank_join_and_wait, train_case)

CASES = [("sage", "mean", 3), ("sage", "gcn", 3), ("sage", "pool", 3), ("sage", "lstm", 3), ("gat", None, 4),
         ("gcn", None, 3)]
PIPELINED = [("sage", "mean", 3)]  # sampling on the preparation thread while the step reads features
RELATIVE_TOLERANCE = 1e-10


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    return write_partitions(dataset(), tmp_path_factory.mktemp("parts") / "graph", 2)


def _ip_config(tmp_path: Path, machines: int = 2) -> Path:
    path = tmp_path / "ip_config.txt"
    path.write_text("".join(f"127.0.0.1 {free_port()}\n" for _ in range(machines)))
    return path


def _our_shared_memory(ip_config: Path, machines: int = 2) -> set[str]:
    """The shared-memory objects of the cluster of ``ip_config`` (other clusters on this
    host, such as another test process's, have other names)."""
    from betty.backends.distdgl.shm import prefix

    ours = tuple(prefix(m, ip_config) for m in range(machines))
    return {n for n in os.listdir("/dev/shm") if n.startswith(ours) and "kvdata" in n}


def test_the_partitions_keep_the_original_ids(layout):
    import dgl

    ds = dataset()
    new_of_orig, orig_of_new = layout.node_maps()
    assert np.array_equal(orig_of_new[new_of_orig], np.arange(ds.num_nodes))
    assert (layout.num_parts, layout.num_nodes, layout.num_edges) == (2, ds.num_nodes, ds.num_edges)
    assert torch.equal(layout.split("train_idx"), ds.train_idx)
    src, dst = ds.graph.edges()
    for part in range(2):
        g, nodes, edges, book, *_ = dgl.distributed.load_partition(str(layout.config), part)
        inner = g.ndata["inner_node"].bool()
        new = g.ndata[dgl.NID][inner]
        assert torch.equal(nodes["_N/feat"], ds.feat[orig_of_new[new.numpy()]])
        assert torch.equal(nodes["_N/label"], ds.label[orig_of_new[new.numpy()]])
        # each inner edge's stored original ID names an edge with the same endpoints
        inner_edges = g.edata["inner_edge"].bool()
        u, v = (t[inner_edges] for t in g.edges())
        eid = edges["_N:_E:_N/betty_eid"]
        gu, gv = g.ndata[dgl.NID][u], g.ndata[dgl.NID][v]
        assert torch.equal(src[eid], torch.from_numpy(orig_of_new[gu.numpy()]))
        assert torch.equal(dst[eid], torch.from_numpy(orig_of_new[gv.numpy()]))


def test_partitioning_refuses_bad_arguments(tmp_path, layout):
    with pytest.raises(ValueError, match="num_parts"):
        write_partitions(dataset(), tmp_path / "a", 0)
    with pytest.raises(ValueError, match="method must be one of metis, random"):
        write_partitions(dataset(), tmp_path / "b", 2, method="kway")
    with pytest.raises(ValueError, match="not empty"):
        write_partitions(dataset(), layout.folder, 2)
    with pytest.raises(FileNotFoundError, match="betty.json"):
        read_layout(tmp_path)


def test_the_ip_configuration_needs_one_line_per_partition(tmp_path):
    path = tmp_path / "ip"
    path.write_text("127.0.0.1 3000\n")
    with pytest.raises(ValueError, match="names 1 machines; the partitioning has 2"):
        read_ip_config(path, 2)
    path.write_text("127.0.0.1 3000\n127.0.0.1\n")
    with pytest.raises(ValueError, match="expected 'HOST PORT'"):
        read_ip_config(path, 2)
    path.write_text("10.0.0.1 3000\n\n10.0.0.2 3001\n")
    assert read_ip_config(path, 2) == [("10.0.0.1", 3000), ("10.0.0.2", 3001)]


def test_connect_outside_a_distdgl_trainer_says_how_to_start_one(layout, monkeypatch):
    monkeypatch.delenv("DGL_ROLE", raising=False)
    with pytest.raises(RuntimeError, match="cluster.launch"):
        connect(layout)


def test_two_servers_and_two_trainers_train_as_one_process(tmp_path, layout):
    """The update of each data-parallel trainer on the partitioned graph equals the
    update of one process with the whole graph (3 steps, float64, dropout 0.5): the same
    samples, micro-batches and gradients; pipelined too (the preparation thread and the step
    both ask the servers)."""
    ip_config = _ip_config(tmp_path)
    results = launch(rank_distdgl_cases, (str(layout.folder), CASES, PIPELINED), layout=layout,
                     ip_config=ip_config, nproc=2, machines=[0, 1], log_dir=tmp_path / "logs")
    assert sorted(results) == [0, 1]
    named = [(case, case_name(*case)) for case in CASES] + \
            [(case, case_name(*case) + "-pipelined") for case in PIPELINED]
    for case, run in named:
        ref = train_case(dataset(), *case)
        for rank, states in results.items():
            got = states[run]
            # the step's loss is summed over the ranks: the same terms, another order
            assert torch.allclose(got["_losses"], ref["_losses"], rtol=RELATIVE_TOLERANCE, atol=0), (case, rank)
            for name, want in ref.items():
                err = float((got[name] - want).norm() / want.norm().clamp_min(1e-300))
                assert err <= RELATIVE_TOLERANCE, (run, rank, name, err)
    assert not graph_server_pids(str(ip_config))
    assert not _our_shared_memory(ip_config)
    for machine in (0, 1):
        assert "shutdown" in (tmp_path / "logs" / f"server{machine}.log").read_text()


def test_two_clusters_on_one_host_keep_their_shared_memory_apart(tmp_path, layout):
    """Two clusters on one host (two jobs; each its own ports) serving the same
    partitioning at once: each server puts its tensors in shared-memory objects of its
    own, and a cluster that stops removes its objects and leaves the other's alone."""
    from betty.backends.distdgl import GraphServers

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    configs = [_ip_config(tmp_path / name) for name in ("a", "b")]
    with GraphServers(layout, [0, 1], configs[0], clients=1, log_dir=tmp_path / "a" / "logs") as first:
        first_names = _our_shared_memory(configs[0])
        with GraphServers(layout, [0, 1], configs[1], clients=1, log_dir=tmp_path / "b" / "logs") as second:
            second_names = _our_shared_memory(configs[1])
            second.stop()
        assert first_names and first_names.isdisjoint(second_names), (first_names, second_names)
        tensors = {n.split("_", 2)[2] for n in first_names}
        assert tensors == {n.split("_", 2)[2] for n in second_names}  # each cluster its own copy
        assert not _our_shared_memory(configs[1]) and _our_shared_memory(configs[0]) == first_names
        first.stop()
    assert not _our_shared_memory(configs[0])


@pytest.mark.slow
def test_a_dead_server_ends_the_launch_naming_it(tmp_path, layout):
    """DistDGL's requests have no timeout: the supervisor, not the trainers, notices a
    server that died, ends the launch and names the server."""
    ip_config = _ip_config(tmp_path)

    def kill_server_1():
        log = tmp_path / "logs" / "server1.log"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (log.exists() and READY in log.read_text()):
            time.sleep(0.1)
        time.sleep(8)  # the trainers have joined by now
        for pid in graph_server_pids(str(ip_config)):
            if "--machine 1" in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_server_1)
    killer.start()
    started = time.monotonic()
    with pytest.raises(GraphServerError, match=r"graph server of machine 1 exited with code -9"):
        launch(rank_join_and_wait, (str(layout.folder), 120.0), layout=layout, ip_config=ip_config,
               nproc=2, machines=[0, 1], log_dir=tmp_path / "logs")
    killer.join()
    assert time.monotonic() - started < 60  # the trainers would have waited 120 s
    assert not graph_server_pids(str(ip_config))
    assert not _our_shared_memory(ip_config)


@pytest.mark.slow
def test_a_failing_trainer_ends_the_launch_and_stops_the_servers(tmp_path, layout):
    from betty.distributed.launch import RankFailed

    ip_config = _ip_config(tmp_path)
    with pytest.raises(RankFailed) as err:
        launch(rank_fail_on_one, (str(layout.folder),), layout=layout, ip_config=ip_config,
               nproc=2, machines=[0, 1], log_dir=tmp_path / "logs")
    assert "rank 1 failed" in str(err.value) and "trainer 1 gave up" in str(err.value)
    assert not graph_server_pids(str(ip_config))
    assert not _our_shared_memory(ip_config)


def test_server_logs_in_a_folder_of_their_own_go_when_the_servers_end_cleanly(temp_in_tmp_path, layout):
    """The default log folder is removed after a clean end and kept after a failure (its
    messages name the logs); a folder the caller gave is never removed."""
    from betty.backends.distdgl.cluster import GraphServers

    tmp_path = temp_in_tmp_path
    ip_config = _ip_config(tmp_path)
    clean, failed = (GraphServers(layout, [0], ip_config, clients=1) for _ in range(2))
    given = GraphServers(layout, [0], ip_config, clients=1, log_dir=tmp_path / "mine")
    given.log_dir.mkdir()
    raised = GraphServers(layout, [0], ip_config, clients=1)
    failed.failure = "the graph server of machine 0 exited"
    for servers in (clean, failed, given):
        servers.__exit__(None, None, None)
    raised.__exit__(RuntimeError, RuntimeError("the trainers failed"), None)
    assert not clean.log_dir.exists()
    assert failed.log_dir.is_dir() and given.log_dir.is_dir() and raised.log_dir.is_dir()


def _finished_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_ensure_partitions_writes_once_and_checks_what_it_finds(tmp_path):
    from betty.backends.distdgl.partition import ensure_partitions
    from betty.owner import Owner

    calls = []

    def load():
        calls.append(1)
        return dataset()

    folder = tmp_path / "store" / "parts"
    here = Owner.current()
    killed = folder.parent / (Owner(_finished_pid(), 1, here.pidns, here.boot).prefix("parts") + "x")
    killed.mkdir(parents=True)  # the staging folder of a writer killed by SIGKILL
    layout = ensure_partitions(load, folder, 2, method="random", dataset="dist-test")
    assert (layout.num_parts, layout.method, calls) == (2, "random", [1])
    assert sorted(p.name for p in folder.parent.iterdir()) == ["parts"]  # no staging left
    again = ensure_partitions(load, folder, 2, write=False, dataset="dist-test", timeout_s=1)
    assert again == layout and calls == [1]
    with pytest.raises(ValueError, match="holds 2 partitions; this run has 3 machines"):
        ensure_partitions(load, folder, 3)
    with pytest.raises(ValueError, match="not of 'other'"):
        ensure_partitions(load, folder, 2, dataset="other")
    with pytest.raises(TimeoutError, match="copy node 0's folder"):
        ensure_partitions(load, tmp_path / "missing", 2, write=False, timeout_s=0.2)
