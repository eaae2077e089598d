"""Quality of a split, computed without carving any block.

Piece membership is propagated down the layers with sparse products, piece by piece.
With ``G`` ``(K, n_out)`` the piece matrix (``G[k, j] = 1`` iff output ``j`` is in piece
``k``) and ``N_l`` ``(n_dst[l], n_src[l])`` the sources each destination needs
(:func:`betty.partition.incidence.needed_sources`, the transpose of ``A_l``),

    M_{L-1} = bool(G @ N_{L-1}),   M_l = bool(M_{l+1} @ N_l)      (shape (K, n_src[l])),

``M_l[k, s] = 1`` iff source ``s`` of layer ``l`` belongs to piece ``k``'s micro-batch at
that layer (exactly the sources :func:`betty.microbatch.carve` keeps); row ``k`` of
``M_l`` is piece ``k``'s layer-``l`` source set, and ``M_l``'s columns below ``n_dst[l-1]``
are layer ``l - 1``'s destinations. Hence
``Σ_k |sources of piece k at layer l| = nnz(M_l)`` and

    redundancy_per_layer[l] = nnz(M_l) / n_src[l],

with ``n_src[l]`` the full batch's source count at layer ``l``. Cost: one product per
layer, O(edges × pieces per node), no per-piece loop and no transpose.
"""

from __future__ import annotations

import hashlib

import numpy as np
import scipy.sparse as sp
import torch

from betty.batch import SampledBatch
from betty.microbatch import validate_groups
from betty.partition.incidence import batch_needed_sources
from betty.workers import parallel_map, prep_workers

__all__ = ["piece_membership", "split_metrics"]


def piece_membership(batch: SampledBatch, groups, k: int) -> list[sp.csr_matrix]:
    """Per layer ``l``, ``M_l`` ``(k, n_src[l])`` 0/1 CSR: row ``p`` marks the layer-``l``
    sources of piece ``p`` (see the module docstring; column indices unsorted).

    Kept on the batch for the latest split (:meth:`betty.batch.SampledBatch.derived`,
    keyed by a digest of ``groups``), so the memory estimate and :func:`split_metrics`
    of one split build it once."""
    groups = validate_groups(groups, batch.num_outputs, k).numpy()

    def compute() -> list[sp.csr_matrix]:
        n_out = batch.num_outputs
        member = sp.csr_matrix(
            (np.ones(n_out, dtype=np.int32), (groups, np.arange(n_out))), shape=(k, n_out)
        )
        out: list[sp.csr_matrix | None] = [None] * batch.num_layers
        for l in reversed(range(batch.num_layers)):
            member = _rows_times(member, batch_needed_sources(batch, l))
            member.data[:] = 1  # a product of 0/1 matrices has no explicit zeros
            out[l] = member
        return out  # type: ignore[return-value]

    digest = hashlib.blake2b(np.ascontiguousarray(groups, dtype=np.int64).tobytes(), digest_size=16).hexdigest()
    return batch.derived(("piece_membership", k, digest), compute, slot="piece_membership")


def _rows_times(member: sp.csr_matrix, needed: sp.csr_matrix) -> sp.csr_matrix:
    """``member @ needed``, one block of ``member``'s rows (pieces) per preparation
    thread (:func:`betty.workers.parallel_map`). A CSR product computes each row on
    its own, so the stacked blocks are the one-thread product entry for entry, in the
    same order."""
    k = member.shape[0]
    workers = min(prep_workers(), k)
    if workers <= 1:
        return member @ needed
    bounds = np.linspace(0, k, workers + 1).round().astype(int)
    blocks = parallel_map(lambda ab: member[ab[0]:ab[1]] @ needed, list(zip(bounds[:-1], bounds[1:])))
    return sp.vstack(blocks, format="csr")


def split_metrics(batch: SampledBatch, groups, k: int) -> dict:
    """Redundancy and balance of splitting ``batch`` by ``groups``.

    Args:
        batch: the full sampled batch.
        groups: ``(n_out,)`` piece index of each output, in ``[0, k)``, no empty piece.
        k: number of pieces.

    Returns:
        A dict with
        ``redundancy_per_layer`` (list of L floats, layer 0 = input layer):
        ``Σ_k |sources of piece k at layer l| / |sources of the full batch at layer l|``;
        ``redundancy``: the layer-0 value;
        ``imbalance``: ``max / mean`` of the pieces' layer-0 input counts;
        ``input_nodes_per_piece``: list of K ints;
        ``outputs_per_piece``: list of K ints.
    """
    members = piece_membership(batch, groups, k)
    per_layer = [m.nnz / batch.layers[l].num_src for l, m in enumerate(members)]
    inputs = np.diff(members[0].indptr)
    outputs = torch.bincount(torch.as_tensor(groups, dtype=torch.int64), minlength=k)
    return {
        "redundancy_per_layer": per_layer,
        "redundancy": per_layer[0],
        "imbalance": float(inputs.max() / inputs.mean()),
        "input_nodes_per_piece": inputs.tolist(),
        "outputs_per_piece": outputs.tolist(),
    }
