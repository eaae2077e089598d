"""How many CPU threads a process may use, and how many it should.

``train.threads: auto`` resolves through :func:`auto_threads`:

* the cores this process may actually run on, :func:`available_cores`: the CPU affinity
  mask (``taskset``, a container's cpuset) capped by a CFS bandwidth quota (cgroup v2
  ``cpu.max``, cgroup v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``), rounded up, at
  least 1; ``os.cpu_count()`` counts the host's cores and would overcommit a container;
* the work at hand: one thread per :data:`EDGES_PER_THREAD` edges of the graph, at
  least 1. Below that size an OpenMP team costs more than it saves: on a busy 2-core
  host two threads made carving small batches several times slower than one (the
  workers wait for cores the other jobs hold);
* less the cores other work keeps busy: the one-minute load average beyond this
  process's own thread, rounded (:func:`idle_cores`); an OpenMP team that waits for
  cores other jobs hold is slower than one thread (measured with
  ``benchmarks/threads.py``, docs/benchmarks.md);
* divided among the ranks of a ``--nproc`` job (``ranks`` per machine), so that N ranks
  never ask for more threads than there are cores.

It is resolved once when a process starts its work, so the same spec can get other
counts on a busier or a bigger machine.

The count never changes what is computed beyond floating-point summation order; betty's
exactness tests run at one thread and at several.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["EDGES_PER_THREAD", "auto_threads", "available_cores", "cgroup_cpu_limit", "idle_cores",
           "resolve_threads", "local_ranks"]

#: Edges of work that justify one more thread (see the module docstring; measured with
#: ``benchmarks/threads.py``: docs/benchmarks.md).
EDGES_PER_THREAD = 2_000_000

_CGROUP = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = _CGROUP) -> float | None:
    """The CFS bandwidth limit of this process's cgroup in cores (quota / period), or
    None when there is none. Reads cgroup v2's ``cpu.max`` (``"max 100000"`` or
    ``"200000 100000"``) or cgroup v1's ``cpu/cpu.cfs_quota_us`` (``-1``: unlimited)
    and ``cpu/cpu.cfs_period_us``; unreadable or malformed files mean no limit."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        if quota == "max":
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period


def available_cores(root: Path = _CGROUP) -> int:
    """The cores this process may run on: the affinity mask, capped by the cgroup's CPU
    quota (rounded up), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cores = min(cores, math.ceil(limit))
    return max(1, cores)


def idle_cores(cores: int | None = None, load: float | None = None) -> int:
    """The cores of ``cores`` (default :func:`available_cores`) that other work leaves
    idle: ``cores - round(load - 1)``, where ``load`` (default: the one-minute load
    average) counts this process's running thread too; at least 1."""
    cores = available_cores() if cores is None else cores
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # no load average: assume an idle machine
            load = 0.0
    return max(1, min(cores, cores - round(max(0.0, load - 1.0))))


def auto_threads(work_edges: int | None = None, *, ranks: int = 1, cores: int | None = None,
                 load: float | None = None) -> int:
    """Threads for one process of ``ranks`` on this machine: the idle cores
    (:func:`idle_cores` of ``cores`` at ``load``) divided by ``ranks``, at least 1, and no
    more than one per :data:`EDGES_PER_THREAD` edges of ``work_edges`` when the work
    size is known."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    share = max(1, idle_cores(cores, load) // ranks)
    if work_edges is None:
        return share
    return max(1, min(share, math.ceil(work_edges / EDGES_PER_THREAD)))


def local_ranks() -> int:
    """The ranks on this machine: ``LOCAL_WORLD_SIZE`` (set in each rank by the
    launcher), else 1."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def resolve_threads(threads: int | str | None, work_edges: int | None = None, *,
                    ranks: int | None = None) -> int | None:
    """A thread setting as a count: an int as given, ``"auto"`` through
    :func:`auto_threads` for ``work_edges`` edges and ``ranks`` processes on this machine
    (default: this machine's ranks), ``None`` as ``None`` (the libraries' own default)."""
    if threads != "auto":
        return threads
    return auto_threads(work_edges, ranks=local_ranks() if ranks is None else ranks)

