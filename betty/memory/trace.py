"""An allocation trace of real code: every storage it allocates and frees, in order.

:class:`AllocationTrace` is the oracle the symbolic replays (:mod:`betty.memory.replay`,
:mod:`betty.rev.replay`) are checked against. Inside ``with AllocationTrace() as trace:``
a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every ATen op that runs
below autograd (forward and backward, autocast's casts included) and appends to
``trace.events``:

* an ``"alloc"`` event for each output storage the op created: a storage the trace has
  not seen that aliases no input (not a view, an in-place or an ``out=`` result), with
  the op (``aten.mm.default``), its bytes, and the dtype and shape of the output
  tensor that first showed it;
* a ``"free"`` event when that storage is freed (a ``weakref.finalize`` on it);
* a ``"resize"`` event when an op changes the size of a recorded storage
  (``Tensor.resize_``, ``out=``) or ``UntypedStorage.resize_`` does (op
  ``"UntypedStorage.resize_"``; a reversible block frees its input's storage so), with
  the new bytes.

The live bytes after event ``t`` are ``Σ alloc - Σ free (+ resize deltas)`` up to ``t``
(:meth:`AllocationTrace.live_bytes`), the region-local part of what
:class:`~betty.memory.meter.MemoryMeter` measures with the same rules (tensors made
from Python data are counted at ``aten.lift_fresh``). Storages that existed before the
region (parameters, ``.grad``, optimizer state) are not recorded, nor are their frees.

Limitations: scratch memory freed inside a kernel and memory outside PyTorch tensors
(DGL's C++ graph formats) are not seen. ``UntypedStorage.resize_``, not an ATen op,
reaches the trace through :mod:`betty.memory.storage_resize`.
Works with torch 2.2 and later (``torch.utils._python_dispatch`` is a private module
whose ``TorchDispatchMode`` has kept this interface).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from betty.memory import storage_resize

__all__ = ["TraceEvent", "AllocationTrace"]


@dataclass(frozen=True)
class TraceEvent:
    """One event of an :class:`AllocationTrace`.

    Attributes:
        kind: ``"alloc"``, ``"free"`` or ``"resize"``.
        op: the ATen op that allocated (or resized) the storage, e.g.
            ``"aten.mm.default"``; for a free, the op that had allocated it.
        nbytes: bytes allocated or freed (for a resize: the new size).
        dtype: dtype of the output tensor that showed the storage, e.g. ``"torch.bfloat16"``.
        shape: that tensor's shape.
        storage: an id of the storage, unique within the trace (0, 1, ...).
    """

    kind: str
    op: str
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    storage: int

    @property
    def op_name(self) -> str:
        """The op without namespace and overload: ``"mm"`` for ``"aten.mm.default"``."""
        parts = self.op.split(".")
        return parts[1] if len(parts) >= 2 else self.op


def _storage_of(obj) -> tuple[torch.UntypedStorage, torch.Tensor] | None:
    if not isinstance(obj, torch.Tensor):
        return None
    try:
        return obj.untyped_storage(), obj
    except (RuntimeError, NotImplementedError):  # storage-less tensor subclasses
        return None


class _RecordingMode(TorchDispatchMode):
    def __init__(self, trace: "AllocationTrace") -> None:
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outputs = [s for s in map(_storage_of, tree_flatten(out)[0]) if s is not None]
        if outputs:
            self.trace._record(func, args, kwargs, outputs)
        return out


class AllocationTrace:
    """Record the storages a region allocates and frees (see the module docstring).

    Args:
        device: record storages on this device only (``None``: every device).

    Example::

        with AllocationTrace() as trace:
            model(x).sum().backward()
        [(e.kind, e.op_name, e.nbytes) for e in trace.events]
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = None if device is None else torch.device(device)
        self.events: list[TraceEvent] = []
        self._lock = threading.RLock()
        self._live: dict[int, list] = {}  # StorageImpl address -> [id, nbytes, alloc event, finalizer]
        self._next_id = 0
        self._open = False
        self._mode: _RecordingMode | None = None

    # ---------------------------------------------------------------- region
    def __enter__(self) -> "AllocationTrace":
        self._open = True
        self._mode = _RecordingMode(self)
        self._mode.__enter__()
        storage_resize.listen(self._resized)
        return self

    def __exit__(self, *exc) -> None:
        storage_resize.stop_listening(self._resized)
        self._mode.__exit__(*exc)
        self._mode = None
        with self._lock:
            self._open = False
            for entry in self._live.values():
                entry[3].detach()
            self._live.clear()

    def _resized(self, storage) -> None:
        """``UntypedStorage.resize_`` ran on ``storage``: :meth:`_note_size` where it is recorded."""
        with self._lock:
            entry = self._live.get(storage._cdata) if self._open else None
            if entry is not None:
                self._note_size(entry, storage.nbytes(), "UntypedStorage.resize_", entry[2].shape)

    def _note_size(self, entry: list, nbytes: int, op: str, shape: tuple[int, ...]) -> None:
        """A ``"resize"`` event where a recorded storage's size is no longer ``entry``'s."""
        if nbytes != entry[1]:
            entry[1] = nbytes
            self.events.append(TraceEvent("resize", op, nbytes, entry[2].dtype, shape, entry[0]))

    # ---------------------------------------------------------------- recording
    def _matches(self, device: torch.device) -> bool:
        d = self.device
        if d is None:
            return True
        return device.type == d.type and (d.index is None or device.index == d.index)

    def _record(self, func, args, kwargs, outputs) -> None:
        fresh_by_contract = func is torch.ops.aten.lift_fresh.default
        input_keys: set[int] | None = None
        input_ptrs: set[int] | None = None
        op = str(func)
        with self._lock:
            if not self._open:
                return
            for storage, tensor in outputs:
                if not self._matches(storage.device):
                    continue
                key = storage._cdata
                entry = self._live.get(key)
                if entry is not None:
                    self._note_size(entry, storage.nbytes(), op, tuple(tensor.shape))
                    continue
                if not fresh_by_contract:
                    if input_keys is None:
                        inputs = [s for s, _ in filter(None, map(_storage_of,
                                                                 tree_flatten((args, kwargs))[0]))]
                        input_keys = {s._cdata for s in inputs}
                        input_ptrs = {s.data_ptr() for s in inputs if s.data_ptr() != 0}
                    ptr = storage.data_ptr()
                    if key in input_keys or (ptr != 0 and ptr in input_ptrs):
                        continue  # aliases an input: not allocated here
                ev = TraceEvent("alloc", op, storage.nbytes(), str(tensor.dtype),
                                tuple(tensor.shape), self._next_id)
                self._next_id += 1
                finalizer = weakref.finalize(storage, self._freed, key)
                finalizer.atexit = False
                self._live[key] = [ev.storage, ev.nbytes, ev, finalizer]
                self.events.append(ev)

    def _freed(self, key: int) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is None or not self._open:
                return
            alloc = entry[2]
            self.events.append(TraceEvent("free", alloc.op, entry[1], alloc.dtype, alloc.shape,
                                          entry[0]))

    # ---------------------------------------------------------------- reading
    def allocations(self, min_bytes: int = 0) -> list[TraceEvent]:
        """The ``"alloc"`` events of at least ``min_bytes``, in order."""
        return [e for e in self.events if e.kind == "alloc" and e.nbytes >= min_bytes]

    def live_bytes(self) -> list[int]:
        """Bytes the region holds after each event (same length as ``events``)."""
        sizes: dict[int, int] = {}
        live, out = 0, []
        for e in self.events:
            if e.kind == "alloc":
                sizes[e.storage] = e.nbytes
                live += e.nbytes
            elif e.kind == "free":
                live -= sizes.pop(e.storage, 0)
            else:
                live += e.nbytes - sizes.get(e.storage, 0)
                sizes[e.storage] = e.nbytes
            out.append(live)
        return out

    def peak_bytes(self) -> int:
        """The most the region held at once (0 for an empty trace)."""
        return max(self.live_bytes(), default=0)

    def bytes_by_dtype(self) -> dict[str, int]:
        """Bytes allocated per dtype over the whole region."""
        out: dict[str, int] = {}
        for e in self.allocations():
            out[e.dtype] = out.get(e.dtype, 0) + e.nbytes
        return out

    def format(self, min_bytes: int = 0) -> str:
        """One line per event of at least ``min_bytes``: kind, op, bytes, dtype, shape."""
        return "\n".join(f"{e.kind:6s} {e.op:40s} {e.nbytes:12d} {e.dtype:15s} {list(e.shape)}"
                         for e in self.events if e.nbytes >= min_bytes)
