"""Make a memory budget real on CUDA, and report an OOM with the estimate behind it.

:func:`apply_budget` caps PyTorch's caching allocator at ``memory_budget`` bytes of the
device (``torch.cuda.set_per_process_memory_fraction``), so a run whose micro-batches
were sized for that budget fails with an out-of-memory error as soon as the estimate was
too low, instead of silently using the rest of the card.

:func:`oom_guard` wraps a training step: a CUDA out-of-memory error inside it is
re-raised as :class:`EstimatedOOMError`, whose message gives the budget, the estimated
per-micro-batch peaks and the breakdown of the largest one, with the original error chained.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

__all__ = ["apply_budget", "oom_guard", "EstimatedOOMError"]


def apply_budget(device: torch.device | str, memory_budget: int) -> float:
    """Limit the caching allocator on ``device`` to ``memory_budget`` bytes.

    Returns the fraction of the device's total memory that was set. A no-op returning
    1.0 on non-CUDA devices (the host has no per-process allocator cap).

    Raises:
        ValueError: not a finite number of bytes >= 1 (:func:`~betty.memory.ksearch.check_memory_budget`),
            or larger than the device's memory.
    """
    from betty.memory.ksearch import check_memory_budget

    dev = torch.device(device)
    check_memory_budget(memory_budget)
    if dev.type != "cuda":
        return 1.0
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    if memory_budget > total:
        raise ValueError(
            f"memory_budget {int(memory_budget)} bytes exceeds the {total} bytes of cuda:{index}")
    fraction = float(memory_budget) / float(total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return fraction


class EstimatedOOMError(RuntimeError):
    """A CUDA out-of-memory error, with the memory estimate that sized the run."""

    def __init__(self, message: str, *, budget: int | None, estimates: Sequence) -> None:
        super().__init__(message)
        self.budget = budget
        self.estimates = list(estimates)


def _is_oom(err: BaseException) -> bool:
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(err, oom_type):
        return True
    return isinstance(err, RuntimeError) and "out of memory" in str(err).lower()


def _describe(estimates: Sequence) -> str:
    peaks = [int(getattr(e, "peak", e)) for e in estimates]
    if not peaks:
        return "no estimate"
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    text = f"estimated peak per micro-batch (bytes): {peaks}; largest: micro-batch {worst}"
    breakdown = getattr(estimates[worst], "breakdown", None)
    if breakdown:
        parts = ", ".join(f"{k}={v}" for k, v in sorted(breakdown.items(), key=lambda kv: -kv[1]))
        text += f" ({parts})"
    return text


@contextmanager
def oom_guard(estimates: Sequence, memory_budget: int | None = None) -> Iterator[None]:
    """Re-raise a CUDA OOM inside the block as :class:`EstimatedOOMError`.

    Args:
        estimates: per-micro-batch :class:`~betty.memory.estimator.MemoryEstimate` (or peak
            byte counts) of the micro-batches about to run.
        memory_budget: the budget the run was sized for (bytes), if any.
    """
    try:
        yield
    except Exception as err:  # noqa: BLE001 - only OOMs are translated
        if not _is_oom(err):
            raise
        budget = "none" if memory_budget is None else f"{int(memory_budget)} bytes"
        raise EstimatedOOMError(
            f"out of memory with memory_budget {budget}: the memory model underestimated "
            f"this batch. {_describe(estimates)}. Original error: {err}. Raise "
            f"safety_margin, or recalibrate with `betty calibrate` on this device.",
            budget=memory_budget, estimates=estimates) from err
