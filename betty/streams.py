"""Where a micro-batch's inputs are copied to the device: on the stream that computes,
or on a side CUDA stream that copies the next micro-batch while the current one
computes (copy-ahead, :func:`betty.train.accumulate_gradients`).

One code path for every device. A :class:`CopyStream` opens a *staging*
(:meth:`CopyStream.staging`); inside it every input reaches the device through
:meth:`Staged.to`, which records the device tensor; before the compute stream reads
them, :meth:`CopyStream.use` orders it after their copies. What differs per device:

* **CUDA with a side stream** (``side=True``): the staging runs on its own
  ``torch.cuda.Stream``, which first waits for everything the compute stream has been
  given so far (``wait_stream``: an input the compute stream made, such as a micro-batch
  carved on the device, is complete before it is copied). Host tensors are copied from
  pinned memory (pinned on the way where they are not; torch's caching host allocator
  keeps a pinned buffer until the copy that reads it is done), ``non_blocking``, so the
  host returns at once and the copies run beside the compute stream's kernels; an
  event marks their end. :meth:`CopyStream.use` makes the compute stream wait for that
  event and ``record_stream``-s every recorded tensor on it: the caching allocator ties
  a block to the stream that allocated it, and without the record would hand the
  memory out again once the tensor is freed, before the compute stream's work on it is
  done.
* **CUDA without a side stream**: the copies run on the compute stream, in order;
  pinned host tensors (features gathered ahead) are copied ``non_blocking``, the others
  as ordinary copies. :meth:`CopyStream.use` does nothing.
* **The CPU** (and any other device): every copy runs where it is called, synchronously;
  :meth:`CopyStream.use` does nothing. A staging made ahead holds its tensors from the
  moment it is made, which is the memory profile of the CUDA path, so the CPU meter can
  check the memory model's count of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["Staged", "CopyStream"]


class Staged:
    """The tensors one staging put on ``device``, in order, and the CUDA event that
    marks the end of their copies (``None`` where they ran on the compute stream).

    ``pin``: pin host tensors bound for CUDA before copying them (a side stream's
    copies; pinned memory is what lets a copy run ``non_blocking``)."""

    def __init__(self, device: torch.device | str, pin: bool = False) -> None:
        self.device = torch.device(device)
        self.pin = pin
        self.tensors: list[torch.Tensor] = []
        self.event = None

    def to(self, tensor: torch.Tensor, copy: bool = False) -> torch.Tensor:
        """``tensor`` on the device, recorded. A host tensor bound for CUDA is copied,
        ``non_blocking`` from pinned memory (with :attr:`pin`, pinned first); anything
        else is ``tensor.to(device, copy=copy)`` (the tensor itself where it is on the
        device already and ``copy`` is false)."""
        if self.device.type == "cuda" and tensor.device.type == "cpu":
            if self.pin and not tensor.is_pinned():
                tensor = tensor.pin_memory()
            out = tensor.to(self.device, non_blocking=tensor.is_pinned())
        else:
            out = tensor.to(self.device, copy=copy)
        self.tensors.append(out)
        return out


class CopyStream:
    """The stream a step's input copies run on (module docstring).

    Args:
        device: the device the inputs go to.
        side: copy on a side CUDA stream (copy-ahead); ignored off CUDA, where copies
            run synchronously.
    """

    def __init__(self, device: torch.device | str, side: bool = False) -> None:
        self.device = torch.device(device)
        self.side = torch.cuda.Stream(self.device) if side and self.device.type == "cuda" else None

    @contextmanager
    def staging(self) -> Iterator[Staged]:
        """A :class:`Staged` whose copies run on this stream: the side stream (after
        the compute stream's work so far; an event recorded at the end) or, without
        one, where the caller is."""
        staged = Staged(self.device, pin=self.side is not None)
        if self.side is None:
            yield staged
            return
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            yield staged
        staged.event = self.side.record_event()

    def use(self, staged: Staged) -> None:
        """Hand ``staged``'s tensors to the compute (current) stream: order it after
        their copies and tie their memory to it (``record_stream``), nothing more where
        they ran on the compute stream; ``staged`` lets go of them (their users hold
        them from here on)."""
        tensors, staged.tensors = staged.tensors, []
        if staged.event is None:
            return
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(staged.event)
        for tensor in tensors:
            tensor.record_stream(compute)
