"""Exact redundancy minimisation: a K-way hypergraph partition of the output nodes.

Model. Vertices are the ``n_out`` output nodes. Each layer-0 input node ``i`` is a
hyperedge ``e_i = {j : P_0[i, j] = 1}`` over the outputs whose sampled L-hop
neighbourhood contains it (:func:`~betty.partition.incidence.multi_hop_incidence`). A
K-way split loads input ``i`` once per piece its hyperedge touches, ``λ(e_i)`` times, so

    Σ_k |inputs of piece k| = Σ_i λ(e_i) = n_in + Σ_i (λ(e_i) - 1) = n_in + km1,

i.e. the connectivity-minus-one objective (km1) with unit hyperedge weights is exactly
the number of redundant input-feature loads, and ``redundancy = 1 + km1 / n_in``.
Hyperedges of size 1 never cost anything and are dropped before partitioning.

The partitioner is Mt-KaHyPar with its ``DETERMINISTIC`` preset (reproducible for a
seed and thread count), imbalance ``epsilon = 0.03`` on the vertex weights (the same
tolerance as METIS's default ``ufactor = 30``). That preset ignores
``mtkahypar.set_seed`` (checked on mtkahypar 1.7), so betty does not call it: the seed
instead relabels the vertices with a seeded random permutation before partitioning:
the same seed (and thread count) gives the same split, different seeds give different
splits.
"""

from __future__ import annotations

import os
import time

import numpy as np

from betty.batch import SampledBatch
from betty.partition.balance import fill_empty_pieces, integer_vertex_weights
from betty.partition.base import PartitionResult, register
from betty.partition.incidence import multi_hop_incidence

__all__ = ["hypergraph_partition", "mtkahypar_initializer", "IMBALANCE_EPSILON"]

#: Allowed block-weight imbalance (max block weight <= (1 + eps) * average).
IMBALANCE_EPSILON = 0.03

_INITIALIZER = None


def mtkahypar_initializer():
    """Mt-KaHyPar's process-wide initializer, created once with one thread per core."""
    global _INITIALIZER
    if _INITIALIZER is None:
        import mtkahypar

        _INITIALIZER = mtkahypar.initialize(max(1, os.cpu_count() or 1), False)
    return _INITIALIZER


@register("hypergraph")
def hypergraph_partition(
    batch: SampledBatch,
    k: int,
    *,
    seed: int = 0,
    weights=None,
    graph=None,
    epsilon: float = IMBALANCE_EPSILON,
    preset: str = "DETERMINISTIC",
) -> PartitionResult:
    """Minimise km1 (= redundant input loads) with Mt-KaHyPar.

    ``preset`` names a ``mtkahypar.PresetType``; ``"DEFAULT"`` is several times faster
    on large batches but, with more than one thread, not reproducible.

    ``info`` holds ``km1`` (as reported by Mt-KaHyPar; equals
    ``Σ_k |inputs of piece k| - n_in`` before any empty-piece repair),
    ``hyperedges`` and ``pins`` (after dropping size-1 hyperedges).
    """
    import mtkahypar

    start = time.perf_counter()
    n_out = batch.num_outputs
    incidence = multi_hop_incidence(batch)  # (n_in, n_out) CSR: row i = hyperedge of i
    size = np.diff(incidence.indptr)
    shared = incidence[size >= 2]
    # seeded relabelling: vertex v is passed to Mt-KaHyPar as perm[v]
    perm = np.random.default_rng(int(seed)).permutation(n_out).astype(np.int32)
    pins = perm[shared.indices]
    # Mt-KaHyPar's Python API takes a sequence of pin sequences: views into one array
    edges = np.split(pins, shared.indptr[1:-1]) if shared.shape[0] else []
    vweights = np.empty(n_out, dtype=np.int32)
    vweights[perm] = integer_vertex_weights(weights, n_out)

    mk = mtkahypar_initializer()
    presets = mtkahypar.PresetType.__members__
    if preset not in presets:
        raise ValueError(f"preset must be one of {sorted(presets)}, got {preset!r}")
    ctx = mk.context_from_preset(presets[preset])
    ctx.set_partitioning_parameters(int(k), float(epsilon), mtkahypar.Objective.KM1)
    ctx.logging = False
    hg = mk.create_hypergraph(
        ctx, n_out, len(edges), edges, vweights, np.ones(len(edges), dtype=np.int32)
    )
    built = time.perf_counter()
    phg = hg.partition(ctx)
    groups = np.asarray(phg.get_partition(), dtype=np.int64)[perm]
    km1 = int(phg.km1())
    done = time.perf_counter()
    groups, moved = fill_empty_pieces(groups, k)
    info = {
        "km1": km1,
        "hyperedges": len(edges),
        "pins": int(shared.nnz),
        "moved_to_empty": moved,
        "epsilon": float(epsilon),
        "preset": preset,
    }
    return PartitionResult(groups, k, "hypergraph", built - start, done - built, info)
