"""One call into METIS (pymetis) on a symmetric sparse graph over the output nodes."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

__all__ = ["metis_cut", "symmetric_simple"]


def symmetric_simple(adj: sp.spmatrix, *, weighted: bool = True) -> sp.csr_matrix:
    """``adj + adjᵀ`` without its diagonal, as int32 CSR with sorted indices.

    With ``weighted=False`` every kept entry is 1 (only the pattern matters).
    """
    adj = sp.csr_matrix(adj)
    if not weighted:
        adj = adj.astype(bool).astype(np.int32)
    sym = sp.csr_matrix(adj + adj.T)
    if not weighted:
        sym.data[:] = 1
    sym.setdiag(0)
    sym.eliminate_zeros()
    sym.sort_indices()
    return sym.astype(np.int32)


def metis_cut(
    adj: sp.csr_matrix,
    k: int,
    *,
    vweights: np.ndarray,
    use_edge_weights: bool,
    seed: int = 0,
) -> tuple[np.ndarray, int]:
    """K-way METIS partition of a symmetric graph with METIS's default settings.

    Args:
        adj: ``(n, n)`` symmetric CSR, zero diagonal, positive integer entries (the
            edge weights when ``use_edge_weights``).
        k: number of pieces, ``2 <= k <= n``.
        vweights: ``(n,)`` positive integer vertex weights to balance.
        use_edge_weights: pass ``adj.data`` as edge weights; otherwise every edge
            weighs 1 (what DGL's METIS wrapper does).
        seed: METIS's random seed.

    Returns:
        ``(groups (n,) int64, edge cut reported by METIS)``. Pieces may be empty; the
        caller repairs them.
    """
    import pymetis

    n = adj.shape[0]
    indptr = np.ascontiguousarray(adj.indptr, dtype=np.int32)
    indices = np.ascontiguousarray(adj.indices, dtype=np.int32)
    eweights = (
        np.ascontiguousarray(adj.data, dtype=np.int32) if use_edge_weights and adj.nnz else None
    )
    result = pymetis.part_graph(
        int(k),
        adjacency=pymetis.CSRAdjacency(indptr, indices),
        vweights=np.ascontiguousarray(vweights, dtype=np.int32),
        eweights=eweights,
        options=pymetis.Options(seed=int(seed)),
    )
    groups = np.asarray(result.vertex_part, dtype=np.int64)
    if groups.shape != (n,):
        raise RuntimeError(f"METIS returned {groups.shape} assignments for {n} vertices")
    return groups, int(result.edge_cuts)
