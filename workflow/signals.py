"""Interrupts and kills end runs instead of leaving them ``RUNNING``.

Standard library only: entry points install it before importing torch, DGL or MLflow.
After :func:`install`, ``SIGINT`` and ``SIGTERM`` raise :class:`KeyboardInterrupt`
(the run in flight ends ``KILLED``), except where that would break off the work that
ends a run: inside :func:`shield` they are only recorded, inside :func:`defer` (a
tracking-store session) raised when it ends. :func:`check` raises one that a library
swallowed (``import torch`` does; so does any ``weakref.finalize`` callback the handler
interrupts). With ``die_with_parent`` (Linux) the death of the
launching process, also before this one could ask to be told, counts as a ``SIGTERM``.
The details are in docs/workflow.md, "Interrupts and kills".
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["install", "restore", "shield", "defer", "release_hold", "check"]

PR_SET_PDEATHSIG = 1
_received: list[int] = []  # every signal since install()
_deferred: list[int] = []  # those that came inside defer()
_shield_depth = 0
_defer_depth = 0
_held = False


def _interrupt(signum: int, note: str = "") -> KeyboardInterrupt:
    return KeyboardInterrupt(f"signal {signal.Signals(signum).name}{note}")


def _handler(signum, frame):  # noqa: ARG001
    _received.append(signum)
    if _defer_depth:
        _deferred.append(signum)
    elif _shield_depth == 0:
        raise _interrupt(signum)


@contextmanager
def shield() -> Iterator[None]:
    """Signals inside are recorded, not raised (for the code that ends runs: a second
    Ctrl-C, or the ``SIGTERM`` that ``mlflow run`` sends after the terminal's
    ``SIGINT``, must not break it off); :func:`check` raises them afterwards."""
    global _shield_depth
    _shield_depth += 1
    try:
        yield
    finally:
        _shield_depth -= 1


@contextmanager
def defer() -> Iterator[None]:
    """Signals inside are raised when the outermost :func:`defer` is left (unless a
    :func:`shield` is active then): a database session is never broken off halfway.
    Main thread only (where handlers run); elsewhere a no-op."""
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
            raise _interrupt(signum)


def check() -> None:
    """Raise :class:`KeyboardInterrupt` if a signal arrived since :func:`install`
    (outside :func:`shield`), even if the one raised then was swallowed."""
    if _received and _shield_depth == 0:
        raise _interrupt(_received[0], " (received earlier)")


def release_hold() -> None:
    """End ``install(hold=True)``'s shield (a no-op without one)."""
    global _held, _shield_depth
    if _held:
        _held = False
        _shield_depth -= 1


def _launcher_gone(parent: int) -> bool:
    """Whether ``parent``, seen earlier as this process's parent, has died: the parent
    changed or is init, or, under ``mlflow run`` (which starts its entry point in a
    process group of its own), it is outside this process's group (a subreaper)."""
    ppid = os.getppid()
    if ppid == 1 or ppid != parent:
        return True
    if not os.environ.get("MLFLOW_RUN_ID") or os.getpgrp() == os.getpid():
        return False
    try:
        return os.getpgid(ppid) != os.getpgrp()
    except OSError:  # the parent is gone already
        return True


def _die_with_parent() -> None:
    """Ask the kernel for ``SIGTERM`` when the parent exits (Linux; no-op elsewhere); a
    parent already gone counts as a ``SIGTERM`` received now."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if _launcher_gone(parent):
        _received.append(int(signal.SIGTERM))


def install(*, die_with_parent: bool = False, hold: bool = False) -> dict:
    """Install the handlers (see the module docstring); main thread only, else a no-op.
    ``hold``: record signals only, as inside :func:`shield`, until :func:`release_hold`
    (a program's start-up, before the code that turns them into an exit runs).

    Returns:
        the previous handlers, for :func:`restore`.
    """
    global _held, _shield_depth
    if threading.current_thread() is not threading.main_thread():
        return {}
    if signal.getsignal(signal.SIGINT) is not _handler:  # installed already: keep what came
        _received.clear()
    previous = {sig: signal.signal(sig, _handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    if hold and not _held:
        _held = True
        _shield_depth += 1
    if die_with_parent:
        _die_with_parent()
    return previous


def restore(previous: dict) -> None:
    """Put back the handlers :func:`install` returned and forget the signals received
    (a later :func:`check` without :func:`install` does not raise for them)."""
    _received.clear()
    for sig, handler in previous.items():
        if handler is not None:
            signal.signal(sig, handler)
