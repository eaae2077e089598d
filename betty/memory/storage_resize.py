"""Listeners of ``UntypedStorage.resize_``, which is not an ATen op.

A dispatch mode sees ``Tensor.resize_`` and ``out=`` ops but not
``x.untyped_storage().resize_(n)`` (how a reversible block frees its input and rebuilds
it in the backward). While anyone listens (:func:`listen`), ``torch.UntypedStorage.resize_``
is wrapped to call every listener with the storage once it has been resized; the
original method is put back when the last listener stops (:func:`stop_listening`). The
memory meter and the allocation trace both listen through here, so that one wrapper is
installed however their regions nest.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

__all__ = ["listen", "stop_listening"]

Listener = Callable[[torch.UntypedStorage], None]

_LISTENERS: list[Listener] = []
_LOCK = threading.Lock()
_ORIGINAL_RESIZE = torch.UntypedStorage.resize_
"""Saved once: a thread that entered the wrapper just as the last listener left still calls it."""


def _resize_and_notify(storage: torch.UntypedStorage, size: int):
    result = _ORIGINAL_RESIZE(storage, size)
    for listener in list(_LISTENERS):
        listener(storage)
    return result


def listen(listener: Listener) -> None:
    """Call ``listener(storage)`` after every ``UntypedStorage.resize_`` until :func:`stop_listening`."""
    with _LOCK:
        if not _LISTENERS:
            torch.UntypedStorage.resize_ = _resize_and_notify
        _LISTENERS.append(listener)


def stop_listening(listener: Listener) -> None:
    """Stop calling ``listener``; the last one to stop puts the original method back."""
    with _LOCK:
        _LISTENERS.remove(listener)
        if not _LISTENERS:
            torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE
