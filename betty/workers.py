"""Threads for host preparation (``train.prep_workers``), and the map that uses them.

Preparation steps whose parts are independent run their parts on a shared pool of
:func:`prep_workers` threads: the micro-batch-membership product one block of micro-batches per part
(:func:`betty.partition.membership.micro_batch_membership`), carving one micro-batch per part
(:func:`betty.train.carve_all`), the sorted feature gather for a device one chunk of
rows per part (:func:`betty.data.store.gather_rows`). Their heavy
calls (scipy's sparse products, torch and NumPy array ops) release the GIL, so the
parts run on separate cores. The parts' results are put together in a fixed order, so
the count never changes what is computed: bit for bit the one-thread result.

The count: :func:`set_prep_workers` (``train.prep_workers``: an int, or ``auto`` = the
cores the trainers' threads leave, shared among this machine's ranks: :func:`spare_cores`).
One worker runs every part in the calling thread, as a plain loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["prep_workers", "set_prep_workers", "spare_cores", "parallel_map", "configure_threads"]

T = TypeVar("T")
R = TypeVar("R")

POOL_THREAD_PREFIX = "betty-prep-pool"
"""The names of the pool's threads (``betty-prep-pool_0``, ...): a map called from one
of them is a part's own, run in that thread."""
_lock = threading.Lock()
_count: int | None = None  # None: spare_cores() when asked
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def spare_cores(trainer_threads: int | None = None, cores: int | None = None, *, ranks: int | None = None) -> int:
    """The cores one process's helpers may use: what the trainer threads of this
    machine's ``ranks`` leave, shared among the ranks, at least 1:
    ``max(1, (cores - trainer_threads x ranks) // ranks)`` (``cores`` default
    :func:`betty.threads.available_cores`, ``trainer_threads`` default
    ``torch.get_num_threads()``, ``ranks`` default :func:`betty.threads.local_ranks`;
    one process: ``cores - trainer_threads``)."""
    from betty.threads import available_cores, local_ranks

    if trainer_threads is None:
        import torch

        trainer_threads = torch.get_num_threads()
    cores = available_cores() if cores is None else int(cores)
    ranks = local_ranks() if ranks is None else int(ranks)
    return max(1, (cores - int(trainer_threads) * ranks) // ranks)


def set_prep_workers(count: int | str | None) -> int:
    """Set the preparation threads: an int >= 1, or ``"auto"`` / ``None`` for
    :func:`spare_cores` at the time of each use. Returns the count now in effect."""
    global _count
    if count in ("auto", None):
        _count = None
    elif isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"prep_workers must be 'auto' or an integer >= 1, got {count!r}")
    else:
        _count = count
    return prep_workers()


def prep_workers() -> int:
    """The preparation threads in effect (see :func:`set_prep_workers`)."""
    return spare_cores() if _count is None else _count


def _executor(size: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size != size:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix=POOL_THREAD_PREFIX)
            _pool_size = size
        return _pool


def parallel_map(fn: Callable[[T], R], parts: Sequence[T], workers: int | None = None) -> list[R]:
    """``[fn(p) for p in parts]``, the parts run on ``workers`` threads (default
    :func:`prep_workers`; the calling thread alone when 1 or when there is one part).
    Results in ``parts`` order; the first exception a part raises is raised here, after
    every part has finished; an interrupt while waiting (Ctrl-C) drops the parts not yet
    started. A map inside a part runs in that part's thread (a part never waits for the
    pool it runs on)."""
    parts = list(parts)
    workers = prep_workers() if workers is None else int(workers)
    nested = threading.current_thread().name.startswith(POOL_THREAD_PREFIX)  # a part's own map
    if workers <= 1 or len(parts) <= 1 or nested:
        return [fn(p) for p in parts]
    futures = [_executor(workers).submit(fn, p) for p in parts]
    try:
        errors = [f.exception() for f in futures]  # waits for every part
    except BaseException:  # KeyboardInterrupt: the queued parts would still run, unwanted
        for f in futures:
            f.cancel()
        raise
    for error in errors:
        if error is not None:
            raise error
    return [f.result() for f in futures]


def configure_threads(threads: int | str | None = "auto", prep_workers: int | str = "auto", *,
                      work_edges: int | None = None) -> int | None:
    """Size this process's thread pools: PyTorch's and, where DGL is installed, DGL's
    OpenMP pool to :func:`betty.threads.resolve_threads` of ``threads`` (left alone for
    ``None``), and the preparation threads (:func:`set_prep_workers`) to
    ``prep_workers``. Returns the thread count set (``None``: left alone)."""
    import torch

    from betty.threads import resolve_threads

    count = resolve_threads(threads, work_edges)
    set_prep_workers(prep_workers)
    if count is not None:
        torch.set_num_threads(count)
        try:
            from dgl.utils import set_num_threads
        except ImportError:  # the PyG stack: no DGL pool to size
            return count
        set_num_threads(count)
    return count
