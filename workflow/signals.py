"""Interrupts and kills that end runs ``KILLED`` instead of leaving them ``RUNNING``.

Light on purpose (standard library only): entry points install it before importing
torch, DGL or MLflow, so a signal that arrives while those load (seconds) is already
an ordinary :class:`KeyboardInterrupt` that the entry point's ``try`` turns into a
``KILLED`` run.

:func:`install`:

* ``SIGINT`` and ``SIGTERM`` raise :class:`KeyboardInterrupt`, except inside
  :func:`shield` (the code that ends runs after an interrupt), where they are only
  recorded: a second Ctrl-C, or the ``SIGTERM`` that ``mlflow run`` sends its child
  right after the terminal's ``SIGINT`` reached the whole process group, cannot break
  off that cleanup. Outside it every signal raises again;
* inside :func:`defer` (the tracking store's database sessions) they are held back
  until the block ends, then raised;
* :func:`check` raises :class:`KeyboardInterrupt` if a signal arrived since
  :func:`install`: importing torch swallows a ``KeyboardInterrupt`` raised while it
  loads (measured: ``SIGINT`` 0.5 s into ``import torch`` and the import completes, the
  process goes on), so the entry points call it after their imports and at every
  stage boundary;
* on Linux, ``prctl(PR_SET_PDEATHSIG, SIGTERM)``: when the parent process dies (e.g.
  ``mlflow run`` killed by ``SIGTERM``, which ends it without any cleanup), this process
  gets ``SIGTERM`` and ends its runs instead of going on as an orphan. A parent that died
  before that request (:func:`launcher_gone`: ``mlflow run`` interrupted while it was
  forking this process, so the terminal's ``SIGINT`` reached it but not this process)
  counts as a ``SIGTERM`` received at :func:`install`.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["install", "restore", "shield", "defer", "hold", "release_hold", "check", "launcher_gone"]

_received: list[int] = []
_shield_depth = 0
PR_SET_PDEATHSIG = 1


_defer_depth = 0
_deferred: list[int] = []


def _handler(signum, frame):  # noqa: ARG001
    _received.append(signum)
    if _defer_depth:
        _deferred.append(signum)
    elif _shield_depth == 0:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


@contextmanager
def defer() -> Iterator[None]:
    """Signals inside are held back and raised (as :class:`KeyboardInterrupt`) when the
    outermost :func:`defer` is left, unless a :func:`shield` is active then. For code
    that must not be broken off halfway, e.g. a database session of the tracking store
    (a ``KeyboardInterrupt`` inside one left the transaction half closed). Main thread
    only (where handlers run); elsewhere a no-op."""
    global _defer_depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _defer_depth += 1
    try:
        yield
    finally:
        _defer_depth -= 1
    if _defer_depth == 0 and _deferred:
        signum = _deferred[0]
        _deferred.clear()
        if _shield_depth == 0:
            raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def check() -> None:
    """Raise :class:`KeyboardInterrupt` if a signal arrived since :func:`install`
    (outside :func:`shield`), even if the one raised then was swallowed."""
    if _received and _shield_depth == 0:
        raise KeyboardInterrupt(f"signal {signal.Signals(_received[0]).name} (received earlier)")


@contextmanager
def shield() -> Iterator[None]:
    """Signals inside are recorded, not raised (for the code that ends runs)."""
    global _shield_depth
    _shield_depth += 1
    try:
        yield
    finally:
        _shield_depth -= 1


def launcher_gone(parent: int | None = None) -> bool:
    """Whether the process that started this one has died (Linux ``/proc`` semantics).

    An orphan is adopted by init (``getppid() == 1``) or by a subreaper. Under ``mlflow
    run`` (``MLFLOW_RUN_ID`` set) a process that does not lead its process group was
    started by a parent in that group (MLflow's CLI starts its entry point, through
    ``bash -c``, in its own group); an adoptive parent is outside it. ``parent``: the
    parent seen earlier (a different one now means it died meanwhile).
    """
    ppid = os.getppid()
    if ppid == 1 or (parent is not None and ppid != parent):
        return True
    if not os.environ.get("MLFLOW_RUN_ID") or os.getpgrp() == os.getpid():
        return False
    try:
        return os.getpgid(ppid) != os.getpgrp()
    except OSError:  # the parent is gone already
        return True


_held = False


def hold() -> None:
    """Record signals only, as inside :func:`shield`, until :func:`release_hold` (for a
    program's start-up, before the code that turns them into an exit is running)."""
    global _held, _shield_depth
    if not _held:
        _held = True
        _shield_depth += 1


def release_hold() -> None:
    """End :func:`hold` (a no-op without one); :func:`check` then raises what came."""
    global _held, _shield_depth
    if _held:
        _held = False
        _shield_depth -= 1


def _die_with_parent() -> None:
    """Ask the kernel for ``SIGTERM`` when the parent exits (Linux; no-op elsewhere).

    A launcher that died before the request took effect (``mlflow run`` interrupted while
    it was still starting this process: the signal reached it and not this process, not
    yet born) counts as a ``SIGTERM`` received now: :func:`check` raises it.
    """
    parent = os.getppid()
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if launcher_gone(parent):
        _received.append(int(signal.SIGTERM))


def install(*, die_with_parent: bool = False) -> dict:
    """Install the handlers (see the module docstring); main thread only, else a no-op.

    Returns:
        the previous handlers, for :func:`restore`.
    """
    if threading.current_thread() is not threading.main_thread():
        return {}
    if signal.getsignal(signal.SIGINT) is not _handler:  # installed already: keep what came
        _received.clear()
    previous = {sig: signal.signal(sig, _handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    if die_with_parent:
        _die_with_parent()
    return previous


def restore(previous: dict) -> None:
    """Put back the handlers :func:`install` returned and forget the signals received
    (so a later :func:`check` without :func:`install` does not raise for them)."""
    _received.clear()
    for sig, handler in previous.items():
        if handler is not None:
            signal.signal(sig, handler)
