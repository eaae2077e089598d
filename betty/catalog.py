"""The names a spec may use, in one place that imports neither numpy nor torch, so that a
spec is checked without them. The modules that implement each name take their lists
from here (``tests/test_catalog.py`` checks that every registry matches)."""

from __future__ import annotations

__all__ = ["ARCHS", "SAGE_AGGREGATORS", "ACTIVATIONS", "OPTIMIZERS", "PARTITION_METHODS",
           "REG_PARTITIONERS", "DEFAULT_REG_PARTITIONER", "CLUSTER_METHODS", "MAX_DROPOUT"]

MAX_DROPOUT = 1.0 - 2.0 ** -24
"""The largest drop probability (``model.dropout``, ``model.attn_dropout``): hash dropout
keeps an element when its 24-bit uniform draw is at least ``round(p · 2^24)``, which must
stay below ``2^24`` (:func:`betty.models.dropout.check_dropout`)."""

ARCHS = ("sage", "gat", "gcn", "revgnn")
"""Model architectures (:func:`betty.models.build_model`)."""

SAGE_AGGREGATORS = ("mean", "gcn", "pool", "lstm")
"""GraphSAGE aggregators (:class:`betty.models.sage.GraphSAGE`)."""

ACTIVATIONS = ("relu", "elu", "leaky_relu", "gelu")
"""Non-linearities between layers (:mod:`betty.models.base`)."""

OPTIMIZERS = ("adam", "sgd")
"""Optimizers (:func:`betty.train.build_optimizer`)."""

PARTITION_METHODS = ("range", "random", "metis", "reg", "reg-unweighted", "reg-all", "hypergraph")
"""Partitioners registered in :data:`betty.partition.PARTITIONERS`."""

REG_PARTITIONERS = ("metis", "kaminpar")
"""Graph partitioners that cut the REG of ``reg`` / ``reg-unweighted`` / ``reg-all``
(``partition.partitioner``; :mod:`betty.partition.reg`)."""

DEFAULT_REG_PARTITIONER = "metis"
"""The default of ``partition.partitioner`` (docs/partitioning.md compares the two)."""

CLUSTER_METHODS = ("random", "metis")
"""How ``revgnn`` cuts the graph into K induced subgraphs (:class:`betty.rev.engine.RevPlan`,
:func:`betty.rev.training.cluster_partition`): ``random`` is re-drawn every epoch."""
