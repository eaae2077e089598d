"""Start ranks with ``torch.distributed``'s elastic launcher (what ``torchrun`` runs).

:func:`launch` calls ``fn(*args)`` in ``nproc`` fresh processes on this machine (one
device per rank: ``cuda:<local_rank>`` when CUDA is present, else the CPU), after
``init_process_group`` (:func:`default_backend`: gloo for CPU tensors and, where CUDA
is present, NCCL for CUDA tensors), and returns this node's
results by global rank. Several machines: every machine runs the same call with
``nnodes=M``, its own ``node_rank``, the same ``rdzv_endpoint`` and ``run_id``; the
static rendezvous (a store hosted by ``node_rank`` 0 at the endpoint) gives machine
``i`` the global ranks ``i * nproc`` to ``i * nproc + nproc - 1``, so global rank 0,
whose result the caller reports, is always on machine 0. A failing rank makes the launcher
stop the others and raise :class:`RankFailed`, whose message names each failed rank and
its error (the elastic launcher's ``ChildFailedError``, with the tracebacks, is its
cause). A rank whose launcher dies (even by ``SIGKILL``) ends within half a second.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from betty.environment import environ

__all__ = ["launch", "RankFailed", "describe_failures", "free_port", "rank_device", "default_backend", "BACKENDS"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


BACKENDS = ("gloo", "nccl", "cpu:gloo,cuda:nccl")
"""What :func:`launch` accepts: gloo, NCCL, or gloo for CPU tensors beside NCCL for CUDA ones."""


def default_backend() -> str:
    """``"cpu:gloo,cuda:nccl"`` when CUDA is present, else ``"gloo"``: NCCL reduces CUDA
    tensors only, and a rank also reduces CPU tensors (its loss and accuracy sums, the
    parameter checksums, a mixed-precision step's inf/NaN flag, and every gradient when
    it trains on the CPU of a machine with GPUs)."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def rank_device() -> torch.device:
    """This rank's device: ``cuda:<LOCAL_RANK>`` with CUDA, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _quiesce() -> None:
    """Let the process group's worker threads go idle before it is destroyed.

    A gloo worker thread may drop the last reference to a tensor of a finished collective,
    which needs the GIL; the group's destructor joins those threads while holding the GIL,
    so destroying it at that moment deadlocks (seen here: a rank stuck in
    ``~ProcessGroupGloo`` -> ``std::thread::join``). A barrier completes every earlier
    collective, and a short sleep releases the GIL for the threads to finish.
    """
    import gc

    import torch.distributed as dist

    dist.barrier()
    gc.collect()
    time.sleep(0.2)


# What a collective raises on a rank whose peer process died (gloo's TCP transport).
_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
PEER_LOSS_DELAY_S = 2.0


def _defer_peer_loss(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, but a rank that fails only because a peer vanished waits before failing.

    When rank r raises, its process exits and every other rank's pending collective fails
    with "connection closed by peer" a moment later. The launcher reports the first rank
    it sees exit, so without this delay the report could name a bystander instead of r;
    with it, the rank with the real error exits first (the launcher polls every 0.1 s).
    """
    def run(*args: Any) -> Any:
        try:
            return fn(*args)
        except RuntimeError as exc:
            if any(text in str(exc) for text in _PEER_LOSS):
                time.sleep(PEER_LOSS_DELAY_S)
            raise

    return run


LAUNCHER_POLL_S = 0.5


def _die_with_launcher(launcher_pid: int, poll_s: float = LAUNCHER_POLL_S) -> threading.Thread:
    """Start a daemon thread that ends this rank at once when ``launcher_pid`` (the
    process that started it) is no longer its parent: a launcher killed by ``SIGKILL``
    cannot stop its ranks, which would otherwise go on as orphans."""
    def watch() -> None:
        while os.getppid() == launcher_pid:
            time.sleep(poll_s)
        os._exit(1)

    thread = threading.Thread(target=watch, name="betty-launcher-watch", daemon=True)
    thread.start()
    return thread


def _join_group(backend: str, local_store: tuple[str, int, str] | None) -> None:
    """``init_process_group``: on one machine through the launcher's loopback store
    (``local_store = (host, port, prefix)``; no rank hosts a store, and gloo/NCCL talk
    over the loopback interface), else through the launcher's environment (``env://``)."""
    import torch.distributed as dist

    if local_store is None:
        dist.init_process_group(backend)
        return
    host, port, prefix = local_store
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    store = dist.PrefixStore(prefix, dist.TCPStore(host, port, is_master=False))
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))


def _rank_main(fn: Callable[..., Any], backend: str, threads: int | None, launcher_pid: int,
               local_store: tuple[str, int, str] | None, *args: Any) -> Any:
    """Body of one rank: watch the launcher, set threads and device, join the group, run
    ``fn``, leave."""
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    _die_with_launcher(launcher_pid)

    if threads is not None:
        torch.set_num_threads(threads)
    if "nccl" in backend:  # one GPU per rank: NCCL's device, and every CUDA call's default
        torch.cuda.set_device(rank_device())
    _join_group(backend, local_store)
    try:
        result = record(_defer_peer_loss(fn))(*args)
        _defer_peer_loss(_quiesce)()  # a rank done with fn may be the bystander of a peer's error
    finally:
        dist.destroy_process_group()
    # Plain bytes back to the launcher: a tensor in the return value would otherwise go
    # through torch's shared-memory pickling (file descriptors handed over by a socket
    # the launcher has to fetch), which stalled runs here.
    return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)


def launch(fn: Callable[..., Any], args: tuple = (), *, nproc: int = 1, nnodes: int = 1,
           node_rank: int = 0, rdzv_endpoint: str | None = None, run_id: str | None = None,
           backend: str | None = None, threads: int | None = 1,
           join_timeout_s: int = 120, monitor_interval_s: float = 0.1) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nproc`` ranks per node, ``nnodes`` nodes.

    Args:
        fn: a module-level (importable, picklable) function; ``args`` must pickle.
        nproc: ranks on this machine.
        nnodes, node_rank, rdzv_endpoint: several machines: ``HOST:PORT`` of node 0
            (required when ``nnodes > 1``; default for one node: a free local port).
            Every machine must run the same ``nproc``.
        run_id: rendezvous id shared by all nodes (default: random, one node only).
        backend: one of :data:`BACKENDS` (default :func:`default_backend`).
        threads: ``torch.set_num_threads`` in each rank (``None``: torch's default).
        join_timeout_s: how long the rendezvous waits for every node.

    Returns:
        ``{global rank: fn's return value}`` for this node's ranks.

    Raises:
        ValueError: bad counts, or several nodes without an endpoint or a run id.
        RankFailed: a rank failed (the message names the rank and its error).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 1 or nnodes < 1:
        raise ValueError(f"nproc and nnodes must be >= 1, got nproc={nproc}, nnodes={nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in [0, {nnodes}), got {node_rank}")
    if nnodes > 1 and (rdzv_endpoint is None or run_id is None):
        raise ValueError("several nodes need rdzv_endpoint (HOST:PORT of node 0) and a shared run_id")
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    run_id = run_id or f"betty-{uuid.uuid4().hex[:12]}"
    with contextlib.ExitStack() as stack:
        local_store = None
        if rdzv_endpoint is None:  # one machine: nothing listens beyond loopback
            # newer torch has the rendezvous host a second store for the ranks, on
            # every interface; the ranks use the loopback one instead
            stack.enter_context(environ(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
            port = stack.enter_context(_loopback_store())
            rdzv_endpoint = f"127.0.0.1:{port}"
            local_store = ("127.0.0.1", port, f"betty/{run_id}/group/")
        if local_store is None:  # several machines: node i's ranks are i * nproc + local rank
            backend_name, rdzv_configs = "static", {"rank": node_rank, "timeout": join_timeout_s}
        else:
            backend_name, rdzv_configs = "c10d", {"is_host": False, "join_timeout": join_timeout_s}
        config = LaunchConfig(
            min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc, run_id=run_id,
            rdzv_endpoint=rdzv_endpoint, rdzv_backend=backend_name, rdzv_configs=rdzv_configs,
            max_restarts=0, monitor_interval=monitor_interval_s, start_method="spawn",
            **_log_folder(stack.enter_context(_ranks_folder())))
        held = stack.enter_context(_closing_notes_held())
        stack.enter_context(_signal_handlers_kept())
        start = elastic_launch(config, _rank_main)
        try:
            results = _rejoining(lambda: start(fn, backend, threads, os.getpid(), local_store, *args),
                                 rejoin=node_rank > 0, within_s=join_timeout_s)
        except BaseException as exc:
            held.release()
            if isinstance(exc, ChildFailedError):
                raise RankFailed(describe_failures(exc)) from exc
            if isinstance(exc, SignalException) and exc.sigval in _INTERRUPTS:
                raise KeyboardInterrupt(f"signal {exc.sigval.name}") from exc  # what the caller handles
            raise
    return {rank: pickle.loads(blob) for rank, blob in results.items()}


def _rejoining(start: Callable[[], Any], *, rejoin: bool, within_s: float) -> Any:
    """``start()``; with ``rejoin`` (a machine other than node 0) ``start()`` again, for
    ``within_s`` seconds at most, while its connection to node 0's rendezvous store
    breaks (``DistNetworkError``). Node 0 hosts one store per launch: a machine that
    ends a launch before node 0 and starts the next one (the next repeat) can meet the
    previous launch's store just before node 0 closes it. The ranks start after the
    rendezvous, so a broken one has started none. (The launches meeting there must
    differ in ``run_id``: the old store may still hold the previous launch's keys.)"""
    import torch.distributed as dist

    deadline = time.monotonic() + within_s
    while True:
        try:
            return start()
        except dist.DistNetworkError:
            if not rejoin or time.monotonic() >= deadline:
                raise
            time.sleep(1.0)


_INTERRUPTS = (signal.SIGINT, signal.SIGTERM)
_LAUNCHER_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
                          if hasattr(signal, name))
"""The signals torch elastic's launcher takes over while it runs (raising its
``SignalException``)."""


@contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """Put back the caller's handlers of :data:`_LAUNCHER_SIGNALS` after a launch: torch
    elastic installs its own and leaves them, so a later Ctrl-C was a ``SignalException``
    instead of the ``KeyboardInterrupt`` (or the handler) the caller had. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in _LAUNCHER_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)


def _ranks_folder() -> tempfile.TemporaryDirectory:
    """The launcher's folder of per-rank files in the temporary directory, named after
    this process (:class:`betty.owner.Owner`, ``.ranks.betty-<owner>-...``), after removing
    the folders there whose owner is gone: a launcher killed by SIGKILL cannot remove its
    own."""
    from betty.owner import Owner, reclaim_stale_folders

    parent = tempfile.gettempdir()
    reclaim_stale_folders(parent)
    return tempfile.TemporaryDirectory(prefix=Owner.current().prefix("ranks"), dir=parent)


def _log_folder(folder: str) -> dict[str, Any]:
    """The ``LaunchConfig`` keyword that puts the launcher's per-rank files (error
    records) in ``folder``, which :func:`launch` removes when it returns; by default
    the launcher makes a ``torchelastic_*`` folder in the temporary directory and
    leaves it there. torch 2.2 takes ``log_dir``, later versions ``logs_specs``."""
    from torch.distributed.launcher.api import LaunchConfig

    if "logs_specs" not in LaunchConfig.__dataclass_fields__:
        return {"log_dir": folder}
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    return {"logs_specs": DefaultLogsSpecs(log_dir=folder)}


class RankFailed(RuntimeError):
    """A rank of :func:`launch` failed; the message names every failed rank and its
    error (:func:`describe_failures`)."""


def describe_failures(exc) -> str:
    """``"rank 1 failed: RuntimeError: ..."`` / ``"rank 1 was killed by SIGKILL"`` for
    every failed rank of a ``ChildFailedError`` (first failure first). A rank that
    recorded its error and then died of a signal on the way out (a DistDGL client left
    without its exit aborts) is named by its error."""
    parts = []
    for rank, failure in sorted(exc.failures.items(), key=lambda kv: kv[1].timestamp):
        recorded = bool(failure.error_file) and os.path.isfile(failure.error_file)  # the rank wrote its error
        if failure.exitcode is not None and failure.exitcode < 0 and not recorded:
            parts.append(f"rank {rank} was killed by {failure.signal_name()}")
        else:
            message = failure.message
            if isinstance(message, dict):  # the error file's {"message": ..., "extraInfo": ...}
                message = message.get("message", message)
            message = str(message or f"exit code {failure.exitcode}").strip()
            parts.append(f"rank {rank} failed: {message.splitlines()[0]}")
    return "; ".join(parts) or str(exc)


@contextmanager
def _loopback_store() -> Iterator[int]:
    """A ``TCPStore`` hosted by this process on a socket bound to 127.0.0.1 (torch's own
    server binds every interface); yields its port. The rendezvous and the ranks' group
    connect to it as clients."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = int(sock.getsockname()[1])
    except BaseException:
        sock.close()
        raise
    # the store owns the socket from here on (it closes it)
    store = dist.TCPStore("127.0.0.1", port, is_master=True, master_listen_fd=sock.detach(),
                          wait_for_workers=False)
    try:
        yield port
    finally:
        del store



class _HeldRecords(logging.Filter):
    """Holds back torch elastic's "Closing process N via signal SIGTERM" records and
    drops its "failed (exitcode: ...)" ones: a failed rank's traceback, dozens of lines,
    that :class:`RankFailed` names in one (and chains, with the traceback, as its
    cause)."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger = logger
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Closing process"):
            self.records.append(record)
            return False
        return not str(record.msg).startswith("failed (exitcode")

    def release(self) -> None:
        """Emit the held records (the launch failed: they tell which ranks were stopped)."""
        self.logger.removeFilter(self)
        for record in self.records:
            self.logger.handle(record)
        self.records.clear()


@contextmanager
def _closing_notes_held() -> Iterator[_HeldRecords]:
    """While the ranks run, hold back the launcher's warning that it closes a rank "via
    signal SIGTERM". After every rank has returned, the launcher stops the ones still
    exiting and logs that warning for each: on success that is routine, not something
    to act on, so it is dropped; on failure :meth:`_HeldRecords.release` emits it."""
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    held = _HeldRecords(logger)
    logger.addFilter(held)
    try:
        yield held
    finally:
        logger.removeFilter(held)
