"""A bounded, ordered prefetcher: preparation in a background thread, ahead of its use.

:class:`Prefetcher` runs ``prepare(item)`` for the items of a sequence, in order, on one
preparation thread, and hands the results to the consuming thread in the same order.
At most ``depth`` results exist ahead of the one the consumer holds:

    live results <= depth + 1

(the consumer's current one, released when it asks for the next, plus ``depth`` made or
being made). With ``depth = 1`` batch b+1 is prepared while batch b trains.

Why a thread: the preparation of a sampled batch (neighbour sampling, the graph cut,
the memory estimate, carving) is made of torch, NumPy and partitioner calls that release
the GIL for their heavy parts, and its results are large tensors that a thread hands
over without a copy. Preparation reads only the dataset and its own state, never the
model's parameters, so running it early changes nothing the model computes.

Errors and stops:

* an exception raised by ``prepare`` (anything, ``KeyboardInterrupt`` included) is
  raised in the consumer, with its traceback, when the consumer reaches that item:
  the items before it are delivered first, as a serial loop would;
* :meth:`Prefetcher.close` (also on leaving a ``with`` block, normally or with an
  exception, Ctrl-C included) stops the thread after the item it is preparing, drops
  what it made, and waits for it: no thread goes on running torch code while the
  process ends (a daemon thread inside a torch op at interpreter exit can abort the
  process). The consumer's wait for a result is sliced, so a Ctrl-C reaches it at once;
  the stop then waits at most for the one item in progress;
* with ``finish_allowed``, :meth:`Prefetcher.close` first lets the thread prepare every
  item the consumer's progress has allowed (``depth`` past the one it holds), then
  stops it: the items prepared no longer depend on timing, which preparation that
  takes part in collectives needs (every rank of a data-parallel job prepares the same
  items, so each rank's thread makes the same collective calls).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

__all__ = ["Prefetcher", "Inline", "check_prefetch", "preparation"]

K = TypeVar("K")
T = TypeVar("T")

_DONE = object()


def _as_error(err: BaseException) -> BaseException:
    """``err`` as the consumer must see it: a ``StopIteration`` raised by ``prepare``
    would end the consumer's loop as if the items were done, so it comes as a
    ``RuntimeError`` (raised from it)."""
    if isinstance(err, StopIteration):
        wrapped = RuntimeError(f"prepare raised StopIteration: {err!r}")
        wrapped.__cause__ = err
        return wrapped
    return err


class _Preparation(Generic[K, T]):
    """The preparation thread's side of a :class:`Prefetcher`: the items, the bounded
    slots, the results made and their bytes (the thread holds this, never the
    Prefetcher)."""

    def __init__(self, items: Sequence[K], prepare: Callable[[K], T], depth: int,
                 size: Callable[[T], int] | None) -> None:
        self.items, self.prepare, self.size = list(items), prepare, size
        self.slots = threading.Semaphore(depth + 1)  # the consumer's current result + depth
        self.ready: queue.SimpleQueue = queue.SimpleQueue()
        self.stopped = threading.Event()
        self.draining = threading.Event()  # closed with finish_allowed: no slot will free
        self.lock = threading.Lock()
        self.live_bytes = 0
        self.peak_bytes = 0

    def run(self) -> None:
        try:
            for item in self.items:
                if not self.take_slot() or self.stopped.is_set():
                    return
                result = self.prepare(item)
                if self.stopped.is_set():  # closed while preparing: nobody will take it
                    return
                self.count(self.size(result) if self.size is not None else 0)
                self.ready.put((item, result, None))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, re-raised there
            self.ready.put((None, None, err))
            return
        self.ready.put(_DONE)

    def take_slot(self) -> bool:
        """Wait for a slot; ``False`` once stopped, or once draining when none is free
        (the consumer frees none after :meth:`Prefetcher.close`)."""
        while not self.slots.acquire(timeout=0.05):
            if self.stopped.is_set() or self.draining.is_set():
                return False
        return True

    def stop(self) -> None:
        """End the thread after the item it is preparing (one waiting for a slot wakes up)."""
        self.stopped.set()
        self.slots.release()

    def count(self, nbytes: int) -> None:
        with self.lock:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)


class Prefetcher(Generic[K, T]):
    """Iterates ``(item, prepare(item))`` over ``items``, ``prepare`` running ahead.

    Args:
        items: what to prepare, in delivery order.
        prepare: ``item -> result``, run on the preparation thread.
        depth: results allowed ahead of the consumer's current one (>= 1).
        size: ``result -> bytes`` it holds (for :attr:`peak_bytes`; default: 0).
        name: the preparation thread's name (shown by debuggers and ``py-spy``).
        finish_allowed: :meth:`close` lets the thread prepare the items the consumer
            has allowed first (see the module docstring).

    Attributes:
        wait_s: seconds the consumer spent blocked waiting for a result.
    """

    def __init__(self, items: Sequence[K], prepare: Callable[[K], T], depth: int = 1,
                 size: Callable[[T], int] | None = None, name: str = "betty-prepare",
                 finish_allowed: bool = False) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an integer >= 1, got {depth!r}")
        self._work = _Preparation(items, prepare, depth, size)
        self._finish_allowed = finish_allowed
        self._holding = False  # the consumer holds a result (its slot not yet returned)
        self._closed = False
        self.wait_s = 0.0
        self._held_bytes = 0  # the consumer's current result
        # the thread holds the preparation state, not this object: a Prefetcher dropped
        # without close() is collected, and __del__ stops its thread
        self._thread = threading.Thread(target=self._work.run, name=name, daemon=True)
        self._thread.start()

    @property
    def peak_bytes(self) -> int:
        """The most ``size`` bytes of results alive at once (made and not yet released by
        the consumer) since the start or :meth:`reset_peak`."""
        return self._work.peak_bytes

    def reset_peak(self) -> None:
        """Restart :attr:`peak_bytes` from the bytes alive now."""
        with self._work.lock:
            self._work.peak_bytes = self._work.live_bytes

    def __iter__(self) -> Iterator[tuple[K, T]]:
        return self

    def __next__(self) -> tuple[K, T]:
        if self._closed:
            raise StopIteration
        work = self._work
        if self._holding:  # the consumer is done with its last result: its slot frees
            self._holding = False
            work.count(-self._held_bytes)
            work.slots.release()
        start = time.perf_counter()
        while True:  # in slices, so that a signal (Ctrl-C) reaches the consumer at once
            try:
                entry = work.ready.get(timeout=0.1)
                break
            except queue.Empty:
                if not self._thread.is_alive() and work.ready.empty():
                    raise RuntimeError("the preparation thread ended without a result") from None
        self.wait_s += time.perf_counter() - start
        if entry is _DONE:
            self.close()
            raise StopIteration
        item, result, err = entry
        if err is not None:
            self.close()  # the thread has ended, or is about to
            raise _as_error(err)
        self._holding = True
        self._held_bytes = work.size(result) if work.size is not None else 0
        return item, result

    def close(self, wait: bool = True) -> None:
        """Stop preparing, drop what was prepared and (``wait``, the default) wait for
        the thread to end: it ends after the item it is preparing, whose result it
        drops (with ``finish_allowed``, after the items the consumer allowed). Without
        ``wait`` the caller goes on at once and the thread ends on its own. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._finish_allowed and wait:
            self._work.draining.set()  # the thread uses the slots it has, then returns
        else:
            self._work.stop()
        if wait:
            self._thread.join()
        while True:  # drop the results nobody will take
            try:
                self._work.ready.get_nowait()
            except queue.Empty:
                break

    def __enter__(self) -> "Prefetcher[K, T]":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._work.stop()


class Inline(Generic[K, T]):
    """The serial counterpart of :class:`Prefetcher`, with its interface: ``prepare``
    runs in the consumer's thread when the consumer asks for the next item, so
    :attr:`wait_s` is the preparation's own wall and nothing is made ahead
    (:attr:`peak_bytes` stays 0)."""

    def __init__(self, items: Sequence[K], prepare: Callable[[K], T]) -> None:
        self._items = iter(list(items))
        self._prepare = prepare
        self.wait_s = 0.0
        self.peak_bytes = 0

    def __iter__(self) -> Iterator[tuple[K, T]]:
        return self

    def __next__(self) -> tuple[K, T]:
        item = next(self._items)
        start = time.perf_counter()
        try:
            return item, self._prepare(item)
        except StopIteration as err:
            raise _as_error(err) from err
        finally:
            self.wait_s += time.perf_counter() - start

    def reset_peak(self) -> None:
        """Nothing to reset (kept for :class:`Prefetcher`'s interface)."""

    def close(self, wait: bool = True) -> None:
        """Drop the items not yet prepared (``wait``: kept for :class:`Prefetcher`'s
        interface)."""
        self._items = iter(())

    def __enter__(self) -> "Inline[K, T]":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_prefetch(prefetch: int) -> int:
    """``prefetch`` (an engine's: 0 serial, ``n >= 1`` batches ahead) checked.

    Raises:
        ValueError: not an integer >= 0.
    """
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an integer >= 0, got {prefetch!r}")
    return prefetch


def preparation(items: Sequence[K], prepare: Callable[[K], T], prefetch: int,
                size: Callable[[T], int] | None = None,
                finish_allowed: bool = False) -> "Prefetcher[K, T] | Inline[K, T]":
    """Where an engine's epochs take their prepared items from: ``prefetch = 0`` an
    :class:`Inline` source (``prepare`` in the caller's thread), ``n >= 1`` a
    :class:`Prefetcher` ``n`` items ahead (``size``: its bytes accounting;
    ``finish_allowed``: its close's)."""
    if check_prefetch(prefetch) == 0:
        return Inline(items, prepare)
    return Prefetcher(items, prepare, prefetch, size=size, finish_allowed=finish_allowed)
