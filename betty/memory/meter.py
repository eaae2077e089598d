"""Peak live-tensor memory of a region of code, on any device.

A :class:`MemoryMeter` measures one region at a time (typically one micro-batch's
forward + backward) and reports

    peak_bytes = max over time t in the region of  B(t) + sum_{s in R(t)} nbytes(s)

where ``B(t)`` is the size of the *tracked* persistent storages still alive at time t
(parameters, their gradients, buffers, optimizer state; ``B(start)`` is the reading's
``baseline_bytes``) and ``R(t)`` is the set of storages allocated inside the region that
are alive at time t. It is the number ``torch.cuda.max_memory_allocated`` gives on CUDA
after ``reset_peak_memory_stats``, and an estimator can be checked against it on a
machine without an accelerator.

Two backends:

``"dispatch"`` (any device; the default off CUDA)
    A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every ATen op that
    runs below autograd, forward and backward alike. For each output tensor it looks at
    the tensor's ``untyped_storage()``; a storage the region has not seen, that no input
    of the op shares (so not a view, an in-place or an ``out=`` result) and that lives on
    the meter's device is *allocated in the region*: its ``nbytes()`` is added once and a
    weak reference to the storage has it subtracted once the storage is freed. Storages
    are identified by their ``StorageImpl`` (``storage._cdata``), which, unlike
    ``data_ptr()``, stays the same when the storage is resized and is distinct for
    zero-byte storages. Tracked storages get the same reference at region start, so
    freeing a gradient inside the region (``zero_grad(set_to_none=True)``) lowers the
    live count.

    Size changes are followed: ``Tensor.resize_`` and ``out=`` ops are dispatched, so
    their effect on a counted storage is re-read after the op; ``UntypedStorage.resize_``
    (the reversible-GNN trick of freeing an input with ``resize_(0)`` and rebuilding it in
    backward) is not an ATen op, so while a dispatch region is open the meter listens to
    it (:mod:`betty.memory.storage_resize`) to re-read the size of counted storages.

    The autograd engine runs backward on the calling thread for CPU tensors, and for
    device tensors on worker threads that install the caller's ``at::ThreadLocalState``,
    which carries the dispatch-mode stack; backward allocations are therefore seen
    (tested on CPU). Storages may be freed on those threads: the ledger is locked.

    Not counted (limitations):

    * storages created before the region and neither tracked nor counted
      (:meth:`MemoryMeter.count`), including when they are freed inside it (they were
      never added, so they are never subtracted);
    * scratch memory a kernel allocates and frees internally (it never becomes an op
      output), e.g. a BLAS packing buffer;
    * memory outside PyTorch tensors: DGL's C++ graph index (the COO/CSR/CSC formats of a
      block, built on demand), DGL NDArrays handed to torch through DLPack (e.g. the
      result of ``in_degrees()``), allocator caching and fragmentation;
    * storages on another device (a CPU gather followed by ``.to('cuda')`` counts only the
      CUDA copy on a CUDA meter).

    Tensors made from Python data or NumPy (``torch.tensor``, ``torch.as_tensor``,
    ``torch.from_numpy``) are built outside the dispatcher and then passed through
    ``aten.lift_fresh``; the meter counts them at that point (Adam's ``step`` tensors are
    created this way). A ``from_numpy`` tensor over an array that existed before the
    region is counted too, although its memory was allocated earlier.

``"cuda"`` (the default on CUDA)
    ``reset_peak_memory_stats`` at region start, ``peak = max_memory_allocated`` and
    ``baseline = memory_allocated`` at start. The caching allocator sees *every* live
    tensor on the device, tracked or not, and kernel scratch memory too, so the CUDA
    baseline is at least the dispatch one; ``track`` does not change a CUDA reading.
    Allocator caching and cuBLAS/cuDNN workspaces are excluded by both backends.

Regions:
    Sequential regions on one meter are independent (the main use: one per micro-batch).
    Regions can nest: each has its own ledger, the outer one counts everything the inner
    one allocates, and the inner one counts only its own allocations on top of its
    baseline. On CUDA, opening an inner region folds the device peak reached so far into
    every open outer region before resetting the counter, so outer peaks stay exact.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from betty.memory import storage_resize

__all__ = [
    "MemoryMeter",
    "MemoryReading",
    "tensor_bytes",
    "module_bytes",
    "optimizer_state_bytes",
]

BACKENDS = ("auto", "dispatch", "cuda")


# --------------------------------------------------------------------------- helpers


def _iter_tensors(obj, *, grads: bool = True) -> Iterator[torch.Tensor]:
    """Every tensor held by ``obj``: a tensor, a module (parameters, their ``.grad`` if
    ``grads``, buffers), an optimizer (every tensor in ``optimizer.state``), or a
    list/tuple/dict of those."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            yield p
            if grads and p.grad is not None:
                yield p.grad
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            yield from _iter_tensors(state, grads=grads)
    elif isinstance(obj, dict):
        for value in obj.values():
            if isinstance(value, (torch.Tensor, dict, list, tuple)):
                yield from _iter_tensors(value, grads=grads)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _iter_tensors(item, grads=grads)
    else:
        raise TypeError(
            f"cannot find tensors in an object of type {type(obj).__name__}; allowed: "
            "torch.Tensor, torch.nn.Module, torch.optim.Optimizer, or a list/tuple/dict "
            "of those"
        )


def _device_matcher(device: torch.device | None):
    """``match(d)``: storage device ``d`` belongs to ``device`` (``None``: any device;
    a device without an index matches every index of its type; the host has one memory, so
    ``cpu:0`` is ``cpu``)."""
    if device is None:
        return lambda d: True
    if device.index is None or device.type == "cpu":
        return lambda d: d.type == device.type
    return lambda d: d.type == device.type and d.index == device.index


def _unique_storages(tensors: Iterable[torch.Tensor], device: torch.device | None):
    """The distinct storages behind ``tensors`` on ``device``, deduplicated by
    ``(device, data_ptr)`` (zero-byte storages are dropped)."""
    match = _device_matcher(device)
    seen: set[tuple[str, int]] = set()
    for t in tensors:
        storage = t.untyped_storage()
        if not match(storage.device) or storage.nbytes() == 0:
            continue
        key = (str(storage.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            yield storage


def tensor_bytes(*tensors, device: torch.device | str | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors``.

    Views of one storage count once, and a view counts its whole storage (a slice of a
    1 GB tensor keeps the 1 GB alive). Arguments may be tensors or lists/tuples/dicts of
    them; ``device`` keeps only storages on that device.
    """
    dev = None if device is None else torch.device(device)
    return sum(s.nbytes() for s in _unique_storages(_iter_tensors(list(tensors)), dev))


def module_bytes(
    module: torch.nn.Module, grads: bool = True, *, device: torch.device | str | None = None
) -> int:
    """Bytes of a module's parameters and buffers, plus its parameters' ``.grad`` if
    ``grads`` (storage-deduplicated, so tied weights count once)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    dev = None if device is None else torch.device(device)
    return sum(s.nbytes() for s in _unique_storages(_iter_tensors(module, grads=grads), dev))


def optimizer_state_bytes(
    optimizer: torch.optim.Optimizer, *, device: torch.device | str | None = None
) -> int:
    """Bytes of every tensor in ``optimizer.state`` (e.g. Adam's ``exp_avg``,
    ``exp_avg_sq`` and 0-d ``step`` per parameter), storage-deduplicated."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    dev = None if device is None else torch.device(device)
    return sum(s.nbytes() for s in _unique_storages(_iter_tensors(optimizer), dev))


# --------------------------------------------------------------------------- reading


@dataclass
class MemoryReading:
    """What one :meth:`MemoryMeter.measure` region measured (filled when it exits).

    Attributes:
        peak_bytes: max over the region of live bytes (see the module docstring).
        baseline_bytes: live bytes at region start (dispatch: tracked storages; cuda:
            ``memory_allocated``).
        end_bytes: live bytes at region exit (same accounting as ``peak_bytes``).
        backend: ``"dispatch"`` or ``"cuda"``.
    """

    peak_bytes: int = 0
    baseline_bytes: int = 0
    end_bytes: int = 0
    backend: str = ""

    @property
    def region_peak_bytes(self) -> int:
        """``peak_bytes - baseline_bytes``: the most the region added on top of its start."""
        return self.peak_bytes - self.baseline_bytes


# --------------------------------------------------------------------------- dispatch backend


class _Ledger:
    """Live bytes of the storages one dispatch region counts, and their running max.

    ``entries[key] = [nbytes, ref]`` with ``key = storage._cdata`` (the StorageImpl
    address; stable across resizes, unique among live storages) and ``ref`` a weak
    reference to the storage whose callback is ``freed.append``. That callback is C code:
    a freed storage runs no Python, so no signal handler can run inside it. (Python drops
    whatever a callback written in Python raises, the ``KeyboardInterrupt`` of a Ctrl-C
    included: with one per storage, a Ctrl-C in a metered loop would often be lost.)
    :meth:`settle` subtracts the freed storages; every other method settles first, so
    the ledger reads as if each storage were subtracted the moment it was freed.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.entries: dict[int, list] = {}
        self.keys: dict[int, int] = {}  # id(ref) -> key, for the refs in entries
        self.freed: list[weakref.ref] = []  # refs whose storage was freed, not yet settled
        self.live = 0
        self.peak = 0
        self.open = True

    def settle(self) -> None:
        """Subtract the storages freed since the last call."""
        with self.lock:
            while self.freed:
                entry = self.entries.pop(self.keys.pop(id(self.freed.pop()), None), None)
                if entry is not None:
                    self.live -= entry[0]

    def counts(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` is counted (allocated in the region, or tracked)."""
        self.settle()
        return storage._cdata in self.entries

    def add(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        nbytes = storage.nbytes()
        with self.lock:
            self.settle()  # a freed storage's key may be this one's
            if key in self.entries or not self.open:
                return
            ref = weakref.ref(storage, self.freed.append)
            self.entries[key] = [nbytes, ref]
            self.keys[id(ref)] = key
            self.live += nbytes

    def refresh(self, storage: torch.UntypedStorage) -> None:
        """Re-read the size of a counted storage (after a resize)."""
        with self.lock:
            self.settle()
            entry = self.entries.get(storage._cdata)
            if entry is None:
                return
            nbytes = storage.nbytes()
            self.live += nbytes - entry[0]
            entry[0] = nbytes

    def resized(self, storage: torch.UntypedStorage) -> None:
        """``UntypedStorage.resize_`` ran on ``storage`` (:mod:`betty.memory.storage_resize`)."""
        self.refresh(storage)
        self.note_peak()

    def note_peak(self) -> None:
        with self.lock:
            self.settle()
            if self.live > self.peak:
                self.peak = self.live

    def close(self) -> int:
        """Stop counting, drop every weak reference (their callbacks never run) and
        return the live bytes."""
        with self.lock:
            self.settle()
            self.open = False
            live = self.live
            self.entries.clear()
            self.keys.clear()
            return live


def _storage_of(obj) -> torch.UntypedStorage | None:
    if not isinstance(obj, torch.Tensor):
        return None
    try:
        return obj.untyped_storage()
    except (RuntimeError, NotImplementedError):  # storage-less tensor subclasses
        return None


class _LiveBytesMode(TorchDispatchMode):
    """Adds every storage an op allocates on ``device`` to ``ledger``."""

    def __init__(self, ledger: _Ledger, device: torch.device) -> None:
        super().__init__()
        self.ledger = ledger
        self.match = _device_matcher(device)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outputs = [s for s in map(_storage_of, tree_flatten(out)[0]) if s is not None]
        if not outputs:
            return out
        ledger = self.ledger
        fresh_by_contract = func is torch.ops.aten.lift_fresh.default
        input_keys: set[int] | None = None
        input_ptrs: set[int] | None = None
        for storage in outputs:
            if not self.match(storage.device):
                continue
            if ledger.counts(storage):
                ledger.refresh(storage)  # in-place, view or out=: size may have changed
                continue
            if not fresh_by_contract:
                if input_keys is None:
                    inputs = [s for s in map(_storage_of, tree_flatten((args, kwargs))[0])
                              if s is not None]
                    input_keys = {s._cdata for s in inputs}
                    input_ptrs = {s.data_ptr() for s in inputs if s.data_ptr() != 0}
                ptr = storage.data_ptr()
                if storage._cdata in input_keys or (ptr != 0 and ptr in input_ptrs):
                    continue  # aliases an input that existed before: not allocated here
            ledger.add(storage)
        ledger.note_peak()
        return out


# --------------------------------------------------------------------------- cuda backend


class _CudaRegion:
    """One open CUDA region: the peak it has seen before a nested reset."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.folded_peak = 0


_OPEN_CUDA_REGIONS: list[_CudaRegion] = []


# --------------------------------------------------------------------------- meter


class MemoryMeter:
    """Peak live tensor bytes of code regions on one device.

    Args:
        device: the device whose memory is measured.
        backend: ``"auto"`` (``"cuda"`` on a CUDA device, else ``"dispatch"``),
            ``"dispatch"`` (any device) or ``"cuda"``.

    Example::

        meter = MemoryMeter(device)
        meter.track(model, optimizer)
        with meter.measure() as reading:
            loss = model(batch).sum(); loss.backward()
        reading.peak_bytes
    """

    def __init__(self, device: torch.device | str = "cpu", backend: str = "auto") -> None:
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"device must name a torch device, got {device!r}") from err
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "auto":
            backend = "cuda" if self.device.type == "cuda" else "dispatch"
        if backend == "cuda":
            if self.device.type != "cuda":
                raise ValueError(
                    f"backend 'cuda' needs a CUDA device, got device {str(self.device)!r}; "
                    "use backend 'dispatch' for other devices"
                )
            if not torch.cuda.is_available():
                raise ValueError("backend 'cuda' needs CUDA, but torch.cuda.is_available() is False")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        self.backend = backend
        self._tracked: list[weakref.ref] = []
        self._open: list[_Ledger] = []  # this meter's open dispatch regions, innermost last

    # ---------------------------------------------------------------- tracking

    def track(self, *objs) -> None:
        """Register persistent objects whose tensors live across regions.

        Accepts ``nn.Module`` (parameters, their ``.grad``, buffers), ``Optimizer``
        (every tensor in ``optimizer.state``), tensors, or lists/tuples of those. Their
        tensors are looked up afresh at each region start, so gradients and optimizer
        state created later are counted from the next region on. Objects are held by
        weak reference.
        """
        for obj in objs:
            if isinstance(obj, (list, tuple)):
                self.track(*obj)
                continue
            if not isinstance(obj, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)):
                raise TypeError(
                    f"track() takes nn.Module, Optimizer or Tensor objects, got "
                    f"{type(obj).__name__}"
                )
            self._tracked.append(weakref.ref(obj))

    def tracked_storages(self) -> list[torch.UntypedStorage]:
        """The distinct live storages of the tracked objects on the meter's device."""
        alive = [ref() for ref in self._tracked]
        self._tracked = [ref for ref, obj in zip(self._tracked, alive) if obj is not None]
        objs = [obj for obj in alive if obj is not None]
        return list(_unique_storages(_iter_tensors(objs), self.device))

    def tracked_bytes(self) -> int:
        """Bytes of :meth:`tracked_storages` right now."""
        return sum(s.nbytes() for s in self.tracked_storages())

    def count(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count ``tensors``, made before the innermost open region, as allocated in it
        now, until they are freed (a micro-batch's inputs copied to the device during
        the region before its own). Holds no reference to them. The ``"cuda"`` backend
        counts every live tensor anyway, and outside a region there is nothing to add
        them to: then it does nothing."""
        if self.backend == "cuda" or not self._open:
            return
        ledger = self._open[-1]
        # one expression, as for the tracked storages: no variable keeps one alive
        any(map(ledger.add, _unique_storages(_iter_tensors(list(tensors)), self.device)))
        ledger.note_peak()

    # ---------------------------------------------------------------- measuring

    @contextmanager
    def measure(self) -> Iterator[MemoryReading]:
        """Measure the enclosed block; the yielded reading is filled on exit (also when
        the block raises)."""
        if self.backend == "cuda":
            with self._measure_cuda() as reading:
                yield reading
        else:
            with self._measure_dispatch() as reading:
                yield reading

    @contextmanager
    def _measure_dispatch(self) -> Iterator[MemoryReading]:
        reading = MemoryReading(backend="dispatch")
        ledger = _Ledger()
        # added in one expression: no loop variable may keep a tracked storage alive,
        # or freeing it inside the region would go unnoticed
        any(map(ledger.add, self.tracked_storages()))
        ledger.settle()
        reading.baseline_bytes = ledger.peak = ledger.live
        storage_resize.listen(ledger.resized)
        self._open.append(ledger)
        try:
            with _LiveBytesMode(ledger, self.device):
                yield reading
        finally:
            self._open.remove(ledger)
            storage_resize.stop_listening(ledger.resized)
            ledger.note_peak()
            reading.peak_bytes = ledger.peak
            reading.end_bytes = ledger.close()

    @contextmanager
    def _measure_cuda(self) -> Iterator[MemoryReading]:
        device = self.device
        reading = MemoryReading(backend="cuda")
        torch.cuda.synchronize(device)
        for outer in _OPEN_CUDA_REGIONS:
            if outer.device == device:
                outer.folded_peak = max(outer.folded_peak, torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
        region = _CudaRegion(device)
        reading.baseline_bytes = torch.cuda.memory_allocated(device)
        _OPEN_CUDA_REGIONS.append(region)
        try:
            yield reading
        finally:
            _OPEN_CUDA_REGIONS.remove(region)
            torch.cuda.synchronize(device)
            reading.peak_bytes = max(region.folded_peak, torch.cuda.max_memory_allocated(device))
            reading.end_bytes = torch.cuda.memory_allocated(device)
