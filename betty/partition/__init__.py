"""Split the output nodes of a sampled batch into K micro-batches.

Every method is a function ``(batch, k, *, seed, weights, graph) -> PartitionResult``
registered in :data:`PARTITIONERS` under its spec name; :func:`partition_batch` is the
single entry point (it validates the result).
"""

from betty.partition.base import (
    PARTITIONERS,
    PartitionResult,
    partition_batch,
    register,
)
from betty.partition import baselines as _baselines  # noqa: F401  (registers range, random)

__all__ = ["PARTITIONERS", "PartitionResult", "partition_batch", "register"]
