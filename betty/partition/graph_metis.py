"""The generic-partitioner baseline ``metis``: METIS on the original graph's subgraph
induced by the output nodes.

Let ``o = batch.output_nid`` (``n_out`` global IDs). The induced graph has an edge
``a — b`` (local indices into ``o``) iff the original graph has ``o[a] -> o[b]`` or
``o[b] -> o[a]``; it is symmetrized, de-duplicated, self-loops dropped, unit edge
weights. Only the in-edges of the outputs are read (every edge between two outputs is
an in-edge of one of them), so the cost is O(Σ in-degree of the outputs), not O(|E|).

Global -> local mapping: a dense ``(num_nodes,)`` array ``pos`` with ``pos[o[a]] = a``
and ``-1`` elsewhere; both endpoints go through it (Betty's artifact mapped only one
side, which made this baseline a random split). Outputs with no neighbour among the
outputs are isolated vertices; METIS still places them to balance the micro-batches.
"""

from __future__ import annotations

import time

import numpy as np
import scipy.sparse as sp
import torch

from betty.batch import SampledBatch
from betty.graph import as_graph
from betty.partition.balance import fill_empty_micro_batches, integer_vertex_weights
from betty.partition.base import PartitionResult, register
from betty.partition.metis_cut import metis_cut, symmetric_simple
from betty.sampling import sample_neighbors

__all__ = ["induced_output_graph", "metis_partition"]


def induced_output_graph(graph, output_nid: torch.Tensor) -> sp.csr_matrix:
    """``(n_out, n_out)`` symmetric 0/1 int64 CSR of ``graph`` induced on ``output_nid``.

    Args:
        graph: a :class:`betty.graph.Graph` (or a ``dgl.DGLGraph``, converted).
        output_nid: ``(n_out,)`` distinct global IDs; row/column ``a`` is
            ``output_nid[a]``.
    """
    output_nid = torch.as_tensor(output_nid, dtype=torch.int64).cpu()
    n_out = output_nid.numel()
    num_nodes = graph.num_nodes()
    if n_out and (int(output_nid.min()) < 0 or int(output_nid.max()) >= num_nodes):
        raise ValueError(
            f"output IDs must lie in [0, {num_nodes}) (graph=...'s node count), got "
            f"[{int(output_nid.min())}, {int(output_nid.max())}]"
        )
    graph = as_graph(graph)
    row, at = sample_neighbors(graph, output_nid, -1)  # every in-edge of the outputs
    src, dst = graph.in_csr[1][at].to(torch.int64), output_nid[row]
    pos = torch.full((num_nodes,), -1, dtype=torch.int64)
    pos[output_nid] = torch.arange(n_out, dtype=torch.int64)
    a, b = pos[src], pos[dst]
    keep = (a >= 0) & (b >= 0)
    a, b = a[keep].numpy(), b[keep].numpy()
    adj = sp.csr_matrix(
        (np.ones(a.size, dtype=np.int32), (a, b)), shape=(n_out, n_out)
    )
    return symmetric_simple(adj, weighted=False)


@register("metis")
def metis_partition(
    batch: SampledBatch, k: int, *, seed: int = 0, weights=None, graph=None
) -> PartitionResult:
    """METIS on the original graph restricted to the outputs (needs ``graph=``)."""
    if graph is None:
        raise ValueError(
            "method 'metis' cuts the original graph: pass graph=<the betty.graph.Graph the "
            "batch was sampled from>"
        )
    start = time.perf_counter()
    adj = induced_output_graph(graph, batch.output_nid)
    vweights = integer_vertex_weights(weights, batch.num_outputs)
    built = time.perf_counter()
    groups, cut = metis_cut(adj, k, vweights=vweights, use_edge_weights=False, seed=seed)
    done = time.perf_counter()
    groups, moved = fill_empty_micro_batches(groups, k)
    info = {
        "edge_cut": cut,
        "induced_edges": int(adj.nnz // 2),
        "isolated_outputs": int((np.diff(adj.indptr) == 0).sum()),
        "moved_to_empty": moved,
    }
    return PartitionResult(groups, k, "metis", built - start, done - built, info)
