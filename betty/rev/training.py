"""Training and inference regime for reversible GNNs: full graph or K induced subgraphs.

A reversible block needs the same node set at its input and output, so RevGNN cannot
run on shrinking sampled blocks (``betty.sampling``). It trains either on the full graph
or, as in the paper's ogbn-proteins runs, on K parts of a node partition per step:

* :func:`cluster_partition` splits the nodes into K parts (uniformly random, or METIS
  clusters) and returns each part's *induced* subgraph; edges between parts are dropped,
  so this is a different (cheaper, lossy) computation than the full graph;
* the training step over the parts is :func:`betty.rev.engine.train_step_parts`;
* :func:`full_graph_inference` and :func:`multiview_inference` (average of the
  predictions over several random partitions, RevGNN's "multi-view" evaluation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import scipy.sparse as sp
import torch
from torch import Tensor, nn

from betty.catalog import CLUSTER_METHODS
from betty.partition.metis_cut import metis_cut, symmetric_simple
from betty.precision import parameter_dtype

__all__ = [
    "GraphPart",
    "backend_graph",
    "cluster_partition",
    "count_train_nodes",
    "features_on",
    "full_graph_inference",
    "multiview_inference",
]

PARTITION_METHODS = CLUSTER_METHODS  # the catalog's list: what a spec may name


@dataclass(frozen=True)
class GraphPart:
    """One part of a node partition.

    Attributes:
        graph: the induced subgraph on ``node_ids`` (local node ``i`` is global node
            ``node_ids[i]``; also recorded on the graph, see the backend's
            ``graph_node_ids``); a ``dgl.DGLGraph`` or a ``PygGraph``.
        node_ids: ``(n_part,)`` int64 global node IDs, increasing.
    """

    graph: Any
    node_ids: Tensor


def backend_graph(model: nn.Module, graph) -> Any:
    """``graph`` (a :class:`betty.graph.Graph`, or already a backend graph) as the
    whole-graph object of ``model``'s backend (``model.backend_name``)."""
    from betty.backends import backend_of

    return backend_of(model).full_graph(graph)


def _metis_labels(graph, k: int, seed: int) -> np.ndarray:
    """METIS part of every node, on the symmetrised graph without self-loops (unit
    edge and vertex weights), through betty's one METIS wrapper."""
    n = graph.num_nodes()
    src, dst = (t.cpu().numpy() for t in graph.edges())
    adj = sp.csr_matrix((np.ones(src.shape[0], dtype=np.int64), (src, dst)), shape=(n, n))
    labels, _ = metis_cut(symmetric_simple(adj, weighted=False), k, use_edge_weights=False,
                          seed=seed)
    return labels


def cluster_partition(
    graph, k: int, method: str = "random", seed: int = 0
) -> list[GraphPart]:
    """Split the nodes of ``graph`` into ``k`` parts and return their induced subgraphs.

    Args:
        graph: the full graph (``N`` nodes), a whole graph of either backend
            (``get_backend(name).full_graph(...)``); the parts are of the same backend.
        k: number of parts, ``1 <= k <= N``.
        method: ``"random"`` (a random permutation cut into ``k`` parts of sizes
            ``floor(N/k)`` or ``ceil(N/k)``, as RevGNN's random partitions) or ``"metis"``
            (METIS on the symmetrised graph; a part may be empty and is then omitted).
        seed: seeds the permutation or METIS.

    Returns:
        ``k`` :class:`GraphPart` (fewer if METIS left parts empty), whose ``node_ids``
        cover every node exactly once.
    """
    n = graph.num_nodes()
    if not 1 <= k <= max(n, 1):
        raise ValueError(f"k must be in [1, num_nodes={n}], got {k}")
    if method not in PARTITION_METHODS:
        raise ValueError(f"method must be one of {PARTITION_METHODS}, got {method!r}")
    if method == "random" or k == 1:
        gen = torch.Generator().manual_seed(seed)
        parts = [p.sort().values for p in torch.randperm(n, generator=gen).tensor_split(k)]
    else:
        labels = _metis_labels(graph, k, seed)
        order = np.argsort(labels, kind="stable")  # node ids increasing within a part
        bounds = np.cumsum(np.bincount(labels, minlength=k))[:-1]
        parts = [torch.from_numpy(p) for p in np.split(order, bounds) if p.size]
    from betty.backends import backend_of_graph

    ops, device = backend_of_graph(graph), graph.device
    return [GraphPart(ops.node_subgraph(graph, ids.to(device)), ids.to(device)) for ids in parts]


def edges_kept_fraction(parts: Sequence[GraphPart], num_edges: int) -> float:
    """``sum_P |E(P)| / |E|``: the share of the graph's edges the induced parts keep."""
    if num_edges == 0:
        return 1.0
    return sum(int(p.graph.num_edges()) for p in parts) / num_edges


def count_train_nodes(train_mask: Tensor) -> int:
    """The number of training nodes of a bool ``(N,)`` mask; a non-bool or empty mask is
    an error (every part's loss is divided by this count)."""
    if train_mask.dtype != torch.bool:
        raise ValueError(f"train_mask must be bool, got dtype {train_mask.dtype}")
    n_train = int(train_mask.sum())
    if n_train == 0:
        raise ValueError("train_mask selects no training nodes")
    return n_train


def features_on(feat: Tensor, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None,
                *, chunk_rows: int = 1 << 16) -> Tensor:
    """``feat.to(device, dtype)`` without a whole cast copy anywhere else: rows are copied
    and cast ``chunk_rows`` at a time into the result, so a host matrix (perhaps
    memory-mapped, perhaps larger than the device's share of it in another dtype) costs
    the result plus one chunk. Shapes: ``(N, F)`` -> ``(N, F)``; ``feat`` itself when it
    is on ``device`` in ``dtype`` already (``None``: its own)."""
    device = torch.device(device) if device is not None else feat.device
    dtype = dtype or feat.dtype
    if feat.device == device and feat.dtype == dtype:
        return feat
    out = torch.empty(feat.shape, dtype=dtype, device=device)
    for lo in range(0, feat.shape[0], chunk_rows):
        out[lo:lo + chunk_rows].copy_(feat[lo:lo + chunk_rows])
    return out


@torch.no_grad()
def full_graph_inference(
    model: nn.Module, graph, feat: Tensor, *, device: Optional[torch.device] = None,
    dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """``model(graph, feat)`` in eval mode without gradients: ``(N, C)``. ``dtype``:
    the compute dtype (default: the model's parameters'), cast as ``feat`` moves
    (:func:`features_on`)."""
    device = torch.device(device) if device is not None else feat.device
    model.eval()
    return model(graph.to(device), features_on(feat, device, dtype or parameter_dtype(model)))


@torch.no_grad()
def multiview_inference(
    model: nn.Module,
    graph,
    feat: Tensor,
    k: int,
    num_views: int,
    *,
    method: str = "random",
    seed: int = 0,
    device: Optional[torch.device] = None,
    transform: Optional[Callable[[Tensor], Tensor]] = None,
    dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """Average of the predictions over ``num_views`` partitions into ``k`` parts.

    View ``v`` partitions with ``cluster_partition(graph, k, method, seed + v)``, runs the
    model on every part and scatters the outputs back to global order; the result is
    ``(1 / V) sum_v transform(out_v)``, ``(N, C)`` (``transform`` e.g. ``torch.sigmoid``
    to average probabilities; default: raw outputs). ``k = 1`` is full-graph inference.
    ``dtype``: the compute dtype (default: the model's parameters'), each part's rows cast
    as they move.
    """
    if num_views < 1:
        raise ValueError(f"num_views must be >= 1, got {num_views}")
    dtype = dtype or parameter_dtype(model)
    device = torch.device(device) if device is not None else feat.device
    model.eval()
    total: Optional[Tensor] = None
    for view in range(num_views):
        out: Optional[Tensor] = None
        for part in cluster_partition(graph, k, method, seed + view):
            ids = part.node_ids.to(feat.device)
            pred = model(part.graph.to(device), features_on(feat[ids], device, dtype))
            if out is None:
                out = pred.new_empty((graph.num_nodes(),) + pred.shape[1:])
            out[ids.to(device)] = pred
        assert out is not None
        out = transform(out) if transform is not None else out
        total = out if total is None else total + out
    assert total is not None
    return total / num_views
