"""A symbolic allocation timeline, evaluated for many micro-batches at once.

The estimator replays, op by op, the allocations and frees one training micro-batch
makes (see :mod:`betty.memory.replay`), without running anything. Every buffer size is
a vector ``(P,)`` of byte counts, one entry per micro-batch, so a whole
K-way split is estimated with one replay of numpy vector operations.

Live bytes after event ``t`` (per micro-batch) are

    live(t) = baseline + Σ_{buffers b allocated at or before t, not yet freed} size(b)

and the estimate is ``peak = max_t live(t)``, the same quantity the memory meter
measures. Buffers are reference counted like tensors: :meth:`Timeline.alloc` returns a
buffer held once (the local variable that received it); :meth:`Timeline.hold` adds a
holder (autograd saving it for backward, a DGL frame keeping it until its scope ends);
:meth:`Timeline.release` drops one and frees the buffer when none is left.

Every buffer belongs to a *component* (``"features"``, ``"activations"``, ...);
:meth:`Timeline.breakdown` gives, per micro-batch, the live bytes of each component at the
moment that micro-batch reached its peak (the components sum to the peak), and
:meth:`Timeline.peak_event` names the event at which it was reached.

An optional ``granule`` rounds every allocation up to a multiple of that many bytes
(CUDA's caching allocator counts 512-byte blocks); zero-byte allocations stay zero.

Where the micro-batches of one replay run different op sequences (a layer whose block has
edges in some of them and none in others), each sequence allocates inside
:meth:`Timeline.within` its micro-batches: 0 bytes in the others.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

__all__ = ["Timeline", "Buffer"]


class Buffer:
    """One symbolic tensor storage: per-micro-batch sizes, component and holder count."""

    __slots__ = ("size", "component", "name", "holders")

    def __init__(self, size: np.ndarray, component: str, name: str) -> None:
        self.size = size
        self.component = component
        self.name = name
        self.holders = 1

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"Buffer({self.name}, {self.component}, holders={self.holders})"


class Timeline:
    """Running live/peak bytes of ``num_micro_batches`` replays done in lock-step.

    Args:
        num_micro_batches: P, the number of micro-batches replayed together.
        granule: round each allocation up to a multiple of this many bytes (1: exact).
    """

    def __init__(self, num_micro_batches: int, granule: int = 1) -> None:
        self.num_micro_batches = int(num_micro_batches)
        self.granule = int(granule)
        self.live = np.zeros(self.num_micro_batches)
        self.peak = np.zeros(self.num_micro_batches)
        self._by_component: dict[str, np.ndarray] = {}
        self._peak_by_component: dict[str, np.ndarray] = {}
        self._peak_event = np.zeros(self.num_micro_batches, dtype=np.int64)
        self._event_names: list[str] = ["start"]
        self.phase = "start"
        self.log: list[tuple[str, str, str, np.ndarray]] | None = None
        """Set to a list to record every ``("alloc" | "free", name, component, sizes)`` event in
        order (the replay's side of a trace diff, :mod:`betty.memory.trace`)."""
        self._within: np.ndarray | None = None  # the micro-batches that allocate (None: all)

    # ------------------------------------------------------------------ sizes
    def _size(self, nbytes) -> np.ndarray:
        size = np.broadcast_to(np.asarray(nbytes, dtype=np.float64), (self.num_micro_batches,))
        size = np.maximum(size, 0.0)
        if self.granule > 1:
            size = np.ceil(size / self.granule) * self.granule
        return size

    # ------------------------------------------------------------------ events
    def _component(self, name: str) -> np.ndarray:
        arr = self._by_component.get(name)
        if arr is None:
            arr = np.zeros(self.num_micro_batches)
            self._by_component[name] = arr
            self._peak_by_component[name] = np.zeros(self.num_micro_batches)
        return arr

    def _note(self, label: str) -> None:
        higher = self.live > self.peak
        if higher.any():
            self._event_names.append(f"{self.phase}: {label}")
            event = len(self._event_names) - 1
            self.peak = np.where(higher, self.live, self.peak)
            self._peak_event[higher] = event
            for comp, arr in self._by_component.items():
                self._peak_by_component[comp][higher] = arr[higher]

    def add_baseline(self, nbytes, component: str) -> None:
        """Bytes alive for the whole region (counted in the baseline and the peak)."""
        size = self._size(nbytes)
        self._component(component)[:] += size
        self.live += size
        self._note("baseline")

    @contextlib.contextmanager
    def within(self, mask) -> Iterator[None]:
        """Allocate in the micro-batches where ``mask`` (``(P,)`` bools) is True only, 0
        bytes in the others, until the context ends: an op sequence that those
        micro-batches run and the others do not. Replaces the mask of an enclosing
        ``within`` (another sequence run in the middle of this one), restored at exit."""
        saved = self._within
        self._within = np.broadcast_to(np.asarray(mask, dtype=bool), (self.num_micro_batches,))
        try:
            yield
        finally:
            self._within = saved

    def alloc(self, nbytes, component: str, name: str) -> Buffer:
        """A new buffer of ``nbytes`` (scalar or ``(P,)``), held once (0 bytes outside
        :meth:`within`'s micro-batches)."""
        size = self._size(nbytes)
        if self._within is not None:
            size = np.where(self._within, size, 0.0)
        buf = Buffer(size, component, name)
        self._component(component)[:] += size
        self.live += size
        self._note(name)
        if self.log is not None:
            self.log.append(("alloc", name, component, size))
        return buf

    def temp(self, nbytes, component: str, name: str) -> None:
        """A buffer allocated and freed right away (a transient spike)."""
        self.release(self.alloc(nbytes, component, name))

    def hold(self, *bufs: Buffer | None) -> None:
        """One more holder for each buffer (e.g. autograd saved it)."""
        for buf in bufs:
            if buf is not None:
                buf.holders += 1

    def release(self, *bufs: Buffer | None) -> None:
        """Drop one holder of each buffer; free the ones nobody holds any more."""
        for buf in bufs:
            if buf is None:
                continue
            if buf.holders <= 0:
                raise RuntimeError(f"buffer {buf.name} released more often than held")
            buf.holders -= 1
            if buf.holders == 0:
                self._by_component[buf.component][:] -= buf.size
                self.live -= buf.size
                if self.log is not None:
                    self.log.append(("free", buf.name, buf.component, buf.size))

    def release_where(self, buf: Buffer, mask) -> None:
        """Free ``buf`` only in the micro-batches where ``mask`` is True; elsewhere it stays
        alive for the rest of the region (e.g. a gradient that becomes ``.grad`` in the
        first micro-batch and is accumulated in place and freed in the others)."""
        mask = np.broadcast_to(np.asarray(mask, dtype=bool), (self.num_micro_batches,))
        freed = np.where(mask, buf.size, 0.0)
        self._by_component[buf.component][:] -= freed
        self.live -= freed
        buf.size = buf.size - freed
        buf.holders = 0

    def free_where(self, buf: Buffer, mask) -> None:
        """Free ``buf``'s bytes in the micro-batches where ``mask`` is True; it stays held
        (and alive) in the others (a tensor that exists in some micro-batches only)."""
        mask = np.broadcast_to(np.asarray(mask, dtype=bool), (self.num_micro_batches,))
        freed = np.where(mask, buf.size, 0.0)
        self._by_component[buf.component][:] -= freed
        self.live -= freed
        buf.size = buf.size - freed

    def merge(self, *bufs: Buffer) -> Buffer:
        """One buffer standing for ``bufs`` (same component; each held once), e.g. the
        per-micro-batch parts of one tensor; live bytes do not change."""
        out = Buffer(sum(b.size for b in bufs), bufs[0].component, bufs[0].name)
        for b in bufs:
            if b.holders != 1 or b.component != out.component:
                raise RuntimeError(f"cannot merge buffer {b.name}")
            b.holders, b.size = 0, np.zeros_like(b.size)
        return out

    # ------------------------------------------------------------------ results
    def breakdown(self) -> list[dict[str, int]]:
        """Per micro-batch, live bytes of every component at that micro-batch's peak."""
        comps = sorted(self._peak_by_component)
        return [
            {c: int(round(self._peak_by_component[c][p])) for c in comps
             if self._peak_by_component[c][p] != 0}
            for p in range(self.num_micro_batches)
        ]

    def peak_event(self) -> list[str]:
        """Per micro-batch, the phase and op at which its peak was reached."""
        return [self._event_names[i] for i in self._peak_event]
