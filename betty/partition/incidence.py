"""Sparse incidence matrices of a sampled batch: which source node each output needs.

Notation. Layer ``l`` of an L-layer batch is a bipartite block with ``n_src[l]`` source
and ``n_dst[l]`` destination nodes; the destinations are the first ``n_dst[l]``
sources, and ``n_src[l] = n_dst[l - 1]`` (blocks chain). A destination needs, at its
layer, its own row (DGL's prefix convention) and the rows of its sampled in-neighbours.

* :func:`layer_incidence` ``A_l`` — ``(n_src[l], n_dst[l])`` 0/1:
  ``A_l[s, d] = 1`` iff ``s == d`` or ``s -> d`` is a sampled edge of layer ``l``.
* :func:`reachability` ``P_l`` — ``(n_src[l], n_out)`` 0/1:
  ``P_{L-1} = A_{L-1}``, ``P_l = bool(A_l @ P_{l+1})``. ``P_l[s, j] = 1`` iff source
  ``s`` of layer ``l`` is in output ``j``'s sampled neighbourhood at that layer, i.e.
  iff the micro-batch carved for ``{j}`` (:func:`betty.microbatch.carve`) has ``s``
  among its layer-``l`` sources. A micro-batch's layer-``l`` sources are the union of
  its outputs' columns.
* :func:`multi_hop_incidence` — ``P_0``: output -> layer-0 input incidence over the
  whole L-hop sampled neighbourhood.
* :func:`needed_sources` ``N_l`` — ``(n_dst[l], n_src[l])``, the transpose of ``A_l`` as
  the sampler lists it: row ``d`` holds ``d`` and the sources of ``d``'s sampled edges,
  in edge order. Built from the edge list in O(E) with no sort; entries repeated by
  parallel edges or a self-loop are kept (a product followed by :func:`booleanize`
  counts them once). Products that read a layer from its destinations' side
  (:func:`betty.partition.membership.micro_batch_membership`) use it instead of ``A_l``.

All products are scipy CSR products, boolean-ized after each step (entries stay 1), so
the cost is the number of (edge, reachable output) pairs, never a dense matrix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import scipy.sparse as sp

if TYPE_CHECKING:  # annotations only: betty.batch imports this module lazily
    from betty.batch import LayerEdges, SampledBatch

__all__ = [
    "layer_incidence",
    "batch_layer_incidence",
    "needed_sources",
    "batch_needed_sources",
    "reachability",
    "multi_hop_incidence",
    "output_layer_incidence",
    "booleanize",
    "index_dtype",
]


def index_dtype(n: int):
    """The narrowest index type (int32, else int64) that holds values below ``n``."""
    return np.int32 if n < 2**31 - 1 else np.int64


def booleanize(mat: sp.spmatrix) -> sp.csr_matrix:
    """The 0/1 pattern of ``mat`` as CSR with ``int32`` ones (explicit zeros removed)."""
    mat = sp.csr_matrix(mat)
    mat.eliminate_zeros()
    mat.data = np.ones(mat.nnz, dtype=np.int32)
    return mat


def layer_incidence(layer: LayerEdges) -> sp.csr_matrix:
    """``A`` ``(n_src, n_dst)`` 0/1 CSR: the sources each destination of ``layer`` needs.

    ``A[s, d] = 1`` iff ``s == d`` (a destination is its own source, DGL's prefix
    convention) or ``s -> d`` is a sampled edge. Parallel edges count once.
    """
    n_src, n_dst = layer.num_src, layer.num_dst
    it = index_dtype(max(n_src, n_dst))
    diag = np.arange(n_dst, dtype=it)
    rows = np.concatenate([diag, layer.edge_src.numpy().astype(it, copy=False)])
    cols = np.concatenate([diag, layer.edge_dst.numpy().astype(it, copy=False)])
    ones = np.ones(rows.shape[0], dtype=np.int32)
    return booleanize(sp.csr_matrix((ones, (rows, cols)), shape=(n_src, n_dst)))


def batch_layer_incidence(batch: SampledBatch, l: int) -> sp.csr_matrix:
    """:func:`layer_incidence` of ``batch.layers[l]``, built once per batch
    (:meth:`betty.batch.SampledBatch.derived`); every consumer below shares it."""
    return batch.derived(("layer_incidence", l), lambda: layer_incidence(batch.layers[l]))


def needed_sources(layer: LayerEdges) -> sp.csr_matrix:
    """``N`` ``(n_dst, n_src)`` CSR with 1 entries: row ``d`` lists the sources destination
    ``d`` of ``layer`` needs, ``d`` itself first, then the source of each of its edges in
    edge order. ``bool(N) = A^T`` (:func:`layer_incidence`); a source that two parallel
    edges, or an edge and the diagonal (a self-loop), give twice is listed twice.

    With the edges grouped by destination (as sampled and carved layers are), edge ``e``
    goes to slot ``e + dst[e] + 1`` (one diagonal slot per destination up to and
    including its own) and the diagonal of ``d`` to ``indptr[d]``. Any other order is
    first grouped by a stable sort.
    """
    n_src, n_dst = layer.num_src, layer.num_dst
    dst, src = layer.edge_dst.numpy(), layer.edge_src.numpy()
    if dst.shape[0] > 1 and (dst[1:] < dst[:-1]).any():
        order = np.argsort(dst, kind="stable")
        dst, src = dst[order], src[order]
    it = index_dtype(max(n_src, dst.shape[0] + n_dst) + 1)
    indptr = np.zeros(n_dst + 1, dtype=it)
    np.cumsum(np.bincount(dst, minlength=n_dst) + 1, out=indptr[1:])
    indices = np.empty(int(indptr[-1]), dtype=it)
    indices[indptr[:-1]] = np.arange(n_dst, dtype=it)
    indices[np.arange(dst.shape[0], dtype=it) + dst.astype(it, copy=False) + 1] = src
    ones = np.ones(indices.shape[0], dtype=np.int32)
    return sp.csr_matrix((ones, indices, indptr), shape=(n_dst, n_src))


def batch_needed_sources(batch: SampledBatch, l: int) -> sp.csr_matrix:
    """:func:`needed_sources` of ``batch.layers[l]``, built once per batch."""
    return batch.derived(("needed_sources", l), lambda: needed_sources(batch.layers[l]))


def reachability(batch: SampledBatch) -> list[sp.csr_matrix]:
    """Per layer ``l``, ``P_l`` ``(n_src[l], n_out)`` 0/1 CSR (see the module docstring).

    Returns:
        ``[P_0, ..., P_{L-1}]``; rows follow ``batch.layers[l].src_nid``, columns
        ``batch.output_nid``.
    """
    out: list[sp.csr_matrix | None] = [None] * batch.num_layers
    reach = batch_layer_incidence(batch, batch.num_layers - 1)
    out[-1] = reach
    for l in reversed(range(batch.num_layers - 1)):
        reach = booleanize(batch_layer_incidence(batch, l) @ reach)
        out[l] = reach
    return out  # type: ignore[return-value]


def multi_hop_incidence(batch: SampledBatch) -> sp.csr_matrix:
    """``(n_in, n_out)`` 0/1 CSR: input ``i`` lies in output ``j``'s sampled L-hop
    neighbourhood (``P_0`` of :func:`reachability`).

    Local indices: rows in ``batch.input_nid`` order, columns in ``batch.output_nid``
    order. Computed as ``bool(A_0 @ bool(A_1 @ ... A_{L-1}))``.
    """
    def compute() -> sp.csr_matrix:
        reach = batch_layer_incidence(batch, batch.num_layers - 1)
        for l in reversed(range(batch.num_layers - 1)):
            reach = booleanize(batch_layer_incidence(batch, l) @ reach)
        return reach

    return batch.derived(("multi_hop_incidence",), compute)


def output_layer_incidence(batch: SampledBatch) -> sp.csr_matrix:
    """``(n_src[L-1], n_out)`` 0/1 CSR of the output layer alone (``A_{L-1}``)."""
    return batch_layer_incidence(batch, batch.num_layers - 1)
