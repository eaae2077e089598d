"""This machine's DistDGL graph servers, supervised, and the ranks launched beside them.

A DistDGL run has one graph server per partition (per machine) and trainers on every
machine, all named by one IP configuration: a text file with a line ``HOST PORT`` per
machine, line ``m`` the server of partition ``m`` (DGL's ``ip_config``; on one host every
line is ``127.0.0.1`` with its own port). On each machine, :func:`launch` starts that
machine's server(s) (:class:`GraphServers`), waits until they listen, then runs the
trainer ranks with :func:`betty.distributed.launch.launch`, each joining the servers
(:func:`betty.backends.distdgl.store.connect`) and the ranks' process group.

Failures end everything, with the culprit named: DistDGL's requests have no timeout, so
a dead server would leave its trainers waiting for ever. :class:`GraphServers` watches
its servers while the ranks run; one that exits stops the launch (the ranks are
terminated) and :func:`launch` raises :class:`GraphServerError` with the server's
machine, exit code and the end of its log. A failing rank ends the launch as with
``--nproc`` (:class:`betty.distributed.launch.RankFailed` naming the rank); the servers are then
stopped (``SIGTERM``, on which DGL unlinks its shared memory; ``SIGKILL`` after
:data:`STOP_GRACE_S`), and shared-memory objects a killed server left behind are
removed. A server process dies with its launcher (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import _thread
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from betty.backends.distdgl.partition import PartitionLayout
from betty.backends.distdgl.shm import prefix as shm_prefix

__all__ = ["GraphServers", "GraphServerError", "read_ip_config", "client_environment", "launch",
           "START_TIMEOUT_S", "STOP_GRACE_S"]

#: what DGL prints once a server listens (the supervisor waits for it: a connection made
#: to test the port would count as one of the trainers DGL waits for)
READY = "Server is waiting for connections"
#: the graph forms a server keeps: ``csc`` to sample in-edges, ``coo`` for out-degrees
GRAPH_FORMATS = ("csc", "coo")
START_TIMEOUT_S = 120.0
STOP_GRACE_S = 3.0
#: after the trainers finish, how long a server may take to shut down on its own
SHUTDOWN_WAIT_S = 15.0
_SHM = Path("/dev/shm")


class GraphServerError(RuntimeError):
    """A graph server failed to start, or exited while the trainers ran."""


def read_ip_config(path: str | Path, num_parts: int) -> list[tuple[str, int]]:
    """The ``(host, port)`` of each machine in the IP configuration at ``path``.

    Raises:
        ValueError: a malformed line, or not one line per partition.
    """
    path = Path(path)
    machines = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit() or not 0 < int(parts[1]) < 65536:
            raise ValueError(f"{path}:{number}: expected 'HOST PORT', got {line!r}")
        machines.append((parts[0], int(parts[1])))
    if len(machines) != num_parts:
        raise ValueError(f"{path} names {len(machines)} machines; the partitioning has {num_parts} "
                         f"partitions: give one line 'HOST PORT' per partition")
    return machines


def client_environment(layout: PartitionLayout, ip_config: str | Path, clients: int) -> dict[str, str]:
    """The environment a trainer joins the servers with (DGL reads it in
    ``dgl.distributed.initialize``): ``clients`` trainers over all machines, no sampler
    processes, one server per machine."""
    return {"DGL_DIST_MODE": "distributed", "DGL_ROLE": "client", "DGL_NUM_SAMPLER": "0",
            "DGL_NUM_CLIENT": str(clients), "DGL_NUM_SERVER": "1", "DGL_GROUP_ID": "0",
            "DGL_IP_CONFIG": str(Path(ip_config).resolve()), "DGL_CONF_PATH": str(layout.config.resolve()),
            "DGL_GRAPH_FORMAT": ",".join(GRAPH_FORMATS), "DGLBACKEND": "pytorch"}


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class GraphServers:
    """The graph servers of ``machines`` on this host, as a context manager: entered,
    they run and listen; left, they are stopped and their shared memory is gone.

    Args:
        layout: the partitioning they serve.
        machines: the partitions (IP configuration lines) served here.
        ip_config: the IP configuration file.
        clients: trainers over all machines.
        log_dir: where each server's output goes (``server<m>.log``; default: a new
            temporary folder, removed when the servers end cleanly and kept when one
            failed, for its log).
        on_exit: called (from a watch thread) when a server fails (exits with a code
            other than 0, that of a shutdown the trainers asked for) while the servers
            are entered; default: interrupt the main thread, which stops a launch in
            progress.
    """

    def __init__(self, layout: PartitionLayout, machines: Sequence[int], ip_config: str | Path,
                 clients: int, *, log_dir: str | Path | None = None,
                 on_exit: Callable[[], None] | None = None) -> None:
        self.layout, self.ip_config, self.clients = layout, Path(ip_config), int(clients)
        read_ip_config(self.ip_config, layout.num_parts)
        self.machines = sorted({int(m) for m in machines})
        bad = [m for m in self.machines if not 0 <= m < layout.num_parts]
        if bad or not self.machines:
            raise ValueError(f"machines must be partitions in [0, {layout.num_parts}), got {list(machines)}")
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="betty-servers-"))
        self._on_exit = on_exit or _thread.interrupt_main
        self.procs: dict[int, subprocess.Popen] = {}
        self.failure: str | None = None
        self._stopping = threading.Event()
        self._shm_before: set[str] = set()
        self._shm_prefixes: tuple[str, ...] = ()

    def log(self, machine: int) -> Path:
        return self.log_dir / f"server{machine}.log"

    def _exited(self, machine: int, when: str, lines: int = 20) -> str:
        """What a server that exited ``when`` is reported with: its machine, exit code
        and the last ``lines`` of its log."""
        try:
            tail = "\n".join(self.log(machine).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            tail = ""
        return (f"the graph server of machine {machine} exited with code {self.procs[machine].returncode} "
                f"{when}; its log ({self.log(machine)}) ends:\n{tail}")

    def __enter__(self) -> "GraphServers":
        self._shm_before = set(os.listdir(_SHM)) if _SHM.is_dir() else set()
        self._shm_prefixes = tuple(shm_prefix(m, self.ip_config) for m in self.machines)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        root = str(Path(__file__).resolve().parents[3])
        env = {**os.environ, "DGLBACKEND": "pytorch", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        try:
            for m in self.machines:
                with self.log(m).open("w") as out:
                    self.procs[m] = subprocess.Popen(
                        [sys.executable, "-u", "-m", "betty.backends.distdgl.server",
                         "--config", str(self.layout.config), "--machine", str(m),
                         "--ip-config", str(self.ip_config), "--clients", str(self.clients)],
                        env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                        preexec_fn=_die_with_parent)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        threading.Thread(target=self._watch, name="betty-graph-servers", daemon=True).start()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = set(self.machines)
        while waiting:
            for m in sorted(waiting):
                if READY in self.log(m).read_text(errors="replace"):
                    waiting.discard(m)
                elif self.procs[m].poll() is not None:
                    raise GraphServerError(self._exited(m, "while starting"))
            if waiting and time.monotonic() > deadline:
                raise GraphServerError(f"the graph servers of machines {sorted(waiting)} did not listen "
                                       f"within {START_TIMEOUT_S:.0f} s (logs in {self.log_dir})")
            time.sleep(0.05)

    def _watch(self) -> None:
        while not self._stopping.is_set():
            for m, proc in self.procs.items():
                # 0: shut down on the trainers' request, which comes after all of them finished
                if proc.poll() not in (None, 0) and not self._stopping.is_set():
                    self.failure = self._exited(m, "while the trainers ran")
                    self._on_exit()
                    return
            time.sleep(0.1)

    def wait_shutdown(self, timeout_s: float = SHUTDOWN_WAIT_S) -> None:
        """Give the servers ``timeout_s`` to exit on their own (after the trainers'
        shutdown request) before :meth:`stop` ends them."""
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    def stop(self) -> None:
        """End every server still running (``SIGTERM``, then ``SIGKILL`` after
        :data:`STOP_GRACE_S`) and remove the shared memory they left."""
        self._stopping.set()
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        self._remove_shared_memory()

    def _remove_shared_memory(self) -> None:
        if not _SHM.is_dir():
            return
        ours = self._shm_prefixes
        for name in set(os.listdir(_SHM)) - self._shm_before:
            if name.startswith(ours) and "kvdata" in name:
                try:
                    (_SHM / name).unlink()
                except OSError:
                    pass

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.wait_shutdown()
        self.stop()
        if kind is None and self.failure is None and self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)


def launch(fn: Callable[..., Any], args: tuple = (), *, layout: PartitionLayout, ip_config: str | Path,
           nproc: int = 1, nnodes: int = 1, node_rank: int = 0, machines: Sequence[int] | None = None,
           log_dir: str | Path | None = None, **launch_kwargs) -> dict[int, Any]:
    """:func:`betty.distributed.launch.launch` with this machine's graph servers beside
    the ranks.

    Args:
        fn, args: as for :func:`betty.distributed.launch.launch`; ``fn`` joins the
            servers itself (:func:`betty.backends.distdgl.store.connect`).
        layout: the partitioning (one partition per machine of the IP configuration).
        ip_config: the IP configuration file.
        nproc, nnodes, node_rank: ranks on this machine, machines, this machine's index.
        machines: the partitions whose servers run here (default ``[node_rank]``; on one
            host a single launcher may serve all of them).
        log_dir: the servers' logs (default: a temporary folder).
        launch_kwargs: passed on (``rdzv_endpoint``, ``run_id``, ``threads``, ...).

    Raises:
        GraphServerError: a server failed to start or exited while the ranks ran.
        RankFailed: a rank failed (:func:`betty.distributed.launch.launch`).
    """
    from betty.distributed.launch import launch as launch_ranks
    from betty.environment import environ

    machines = [node_rank] if machines is None else list(machines)
    servers = GraphServers(layout, machines, ip_config, clients=nproc * nnodes, log_dir=log_dir)
    with servers, environ(**client_environment(layout, ip_config, nproc * nnodes)):
        try:
            return launch_ranks(fn, args, nproc=nproc, nnodes=nnodes, node_rank=node_rank, **launch_kwargs)
        except BaseException as err:
            if servers.failure is not None:
                raise GraphServerError(servers.failure) from err
            raise
