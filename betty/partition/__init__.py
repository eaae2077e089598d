"""Split the output nodes of a sampled batch into K micro-batches.

Every method is a function ``(batch, k, *, seed, weights, graph) -> PartitionResult``
registered in :data:`PARTITIONERS` under its spec name; :func:`partition_batch` is the
single entry point (it validates the result).

Methods: ``range`` and ``random`` (baselines), ``metis`` (METIS on the original graph
induced by the outputs), ``reg`` / ``reg-unweighted`` / ``reg-all`` (Betty's
redundancy-embedded graph cut by METIS or KaMinPar, ``partitioner``) and ``hypergraph`` (Mt-KaHyPar minimising the
exact number of redundant input loads). :func:`split_metrics` measures a split;
:mod:`betty.partition.sweep` measures a trainer's first split
(:func:`measure_batch_split`) and compares methods over K (:func:`sweep_batch`).
"""

from betty.partition.base import (
    EXPENSIVE_METHODS,
    PARTITION_OPTIONS,
    PARTITIONERS,
    PartitionResult,
    partition_batch,
    register,
)
from betty.partition import baselines as _baselines  # noqa: F401  (registers range, random)
from betty.partition import graph_metis as _graph_metis  # noqa: F401  (registers metis)
from betty.partition import hypergraph as _hypergraph  # noqa: F401  (registers hypergraph)
from betty.partition import reg as _reg  # noqa: F401  (registers reg, reg-unweighted, reg-all)
from betty.partition.incidence import multi_hop_incidence
from betty.partition.metrics import split_metrics
from betty.partition.sweep import Split, measure_batch_split, sweep_batch, sweep_grid

__all__ = [
    "EXPENSIVE_METHODS",
    "PARTITION_OPTIONS",
    "PARTITIONERS",
    "PartitionResult",
    "partition_batch",
    "register",
    "multi_hop_incidence",
    "split_metrics",
    "Split",
    "measure_batch_split",
    "sweep_batch",
    "sweep_grid",
]
