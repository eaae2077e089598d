"""Op sequences that both symbolic replays model: :mod:`betty.memory.replay` (one
sampled micro-batch) and :mod:`betty.rev.replay` (one RevGNN part).

Each function records, on a :class:`~betty.memory.timeline.Timeline`, the tensors one
stretch of PyTorch / PyG / DGL ops allocates and frees, in the order they do. Sizes are
bytes, scalars or ``(P,)`` per-piece vectors (every piece of a split is replayed at
once). A function here is written once and called by both replayers; where the two
replays model different op sequences they keep their own code (see their modules).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["numel"]


def numel(shape: Iterable[int]) -> int:
    """Number of elements of a tensor of ``shape`` (``1`` for ``()``)."""
    n = 1
    for s in shape:
        n *= int(s)
    return n
