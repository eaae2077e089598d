"""The one call into METIS (pymetis) in betty: a K-way cut of a symmetric sparse graph.

Every METIS use (``metis``, ``reg*`` and RevGNN's METIS clusters) goes through
:func:`metis_cut`. Index width: pymetis is built against a METIS whose ``idx_t`` is
:func:`pymetis.zero_copy_dtype` (64-bit in both environments here); every array handed
to it (CSR pointers and indices, vertex and edge weights) is converted to that type,
and a value or a weight total (METIS sums weights in ``idx_t``) that does not fit raises
a :class:`ValueError` before METIS runs, instead of wrapping around.

**Scheme.** For ``K >= 3`` the cut is METIS's multilevel k-way partitioning
(``METIS_PartGraphKway``, what ``gpmetis`` runs by default); for ``K = 2`` it is one
bisection (``METIS_PartGraphRecursive``), the same problem at less cost. pymetis itself
would pick recursive bisection for every ``K <= 8``; on the full-size synthetic-products
REG, k-way is both cheaper and lower in redundancy at K = 4 to 16 (the figures and their
command: docs/partitioning.md, *The METIS scheme*).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

__all__ = ["metis_cut", "symmetric_simple", "metis_index_dtype", "recursive_bisection"]


def metis_index_dtype() -> np.dtype:
    """The integer type of pymetis's ``idx_t`` (``int32`` or ``int64``)."""
    import pymetis

    return np.dtype(pymetis.zero_copy_dtype())


def recursive_bisection(k: int) -> bool:
    """Whether :func:`metis_cut` cuts ``k`` parts by recursive bisection (only ``k = 2``;
    k-way otherwise)."""
    return int(k) == 2


def symmetric_simple(adj: sp.spmatrix, *, weighted: bool = True) -> sp.csr_matrix:
    """``adj + adjᵀ`` without its diagonal, as CSR with sorted indices.

    With ``weighted=False`` every kept entry is 1 (only the pattern matters). Entries are
    ``int64`` (a symmetrised count may exceed ``int32``).
    """
    adj = sp.csr_matrix(adj)
    if not weighted:
        adj = adj.astype(bool).astype(np.int64)
    else:
        adj = adj.astype(np.int64)
    sym = sp.csr_matrix(adj + adj.T)
    if not weighted:
        sym.data[:] = 1
    sym.setdiag(0)
    sym.eliminate_zeros()
    sym.sort_indices()
    return sym


def _as_idx(name: str, values, dtype: np.dtype, *, total: bool = False) -> np.ndarray:
    """``values`` as a contiguous ``dtype`` array; raises if a value (or, with ``total``,
    the sum METIS computes in ``idx_t``) does not fit."""
    arr = np.asarray(values)
    limit = int(np.iinfo(dtype).max)
    if arr.size:
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"METIS {name} must be integers, got dtype {arr.dtype}")
        top = int(arr.max())
        if top > limit or int(arr.min()) < -limit - 1:
            raise ValueError(
                f"METIS {name} has a value {top} outside its {dtype} idx_t range "
                f"(max {limit}); reduce the graph or the weights (e.g. a smaller hub cap)")
        if total:
            s = int(arr.sum(dtype=np.float64))  # exact enough to detect overflow
            if s > limit:
                raise ValueError(
                    f"METIS sums {name} in {dtype} idx_t: the total {s} exceeds {limit}")
    return np.ascontiguousarray(arr, dtype=dtype)


def metis_cut(
    adj: sp.csr_matrix,
    k: int,
    *,
    vweights: np.ndarray | None = None,
    use_edge_weights: bool,
    seed: int = 0,
    recursive: bool | None = None,
) -> tuple[np.ndarray, int]:
    """K-way METIS partition of a symmetric graph: k-way for ``k >= 3``, one bisection
    for ``k = 2`` (the module's *Scheme*), METIS's default options otherwise.

    Args:
        adj: ``(n, n)`` symmetric CSR, zero diagonal, positive integer entries (the
            edge weights when ``use_edge_weights``).
        k: number of parts, ``2 <= k <= n``.
        vweights: ``(n,)`` positive integer vertex weights to balance (``None``: all 1).
        use_edge_weights: pass ``adj.data`` as edge weights; otherwise every edge
            weighs 1 (what DGL's METIS wrapper does).
        seed: METIS's random seed.
        recursive: force recursive bisection (``True``) or k-way (``False``);
            ``None``: :func:`recursive_bisection` of ``k``.

    Returns:
        ``(groups (n,) int64, edge cut reported by METIS)``. Parts may be empty; the
        caller repairs them.

    Raises:
        ValueError: an index, weight or weight total does not fit METIS's ``idx_t``.
    """
    import pymetis

    n = adj.shape[0]
    idx = metis_index_dtype()
    indptr = _as_idx("CSR pointer (edge count)", adj.indptr, idx)
    indices = _as_idx("CSR indices (vertex count)", adj.indices, idx)
    eweights = None
    if use_edge_weights and adj.nnz:
        eweights = _as_idx("edge weights", adj.data, idx, total=True)
    if vweights is not None:
        vweights = _as_idx("vertex weights", vweights, idx, total=True)
        if vweights.shape != (n,):
            raise ValueError(f"vweights must have shape ({n},), got {vweights.shape}")
    result = pymetis.part_graph(
        int(k),
        adjacency=pymetis.CSRAdjacency(indptr, indices),
        vweights=vweights,
        eweights=eweights,
        recursive=recursive_bisection(k) if recursive is None else bool(recursive),
        options=pymetis.Options(seed=int(seed)),
    )
    groups = np.asarray(result.vertex_part, dtype=np.int64)
    if groups.shape != (n,):
        raise RuntimeError(f"METIS returned {groups.shape} assignments for {n} vertices")
    return groups, int(result.edge_cuts)
