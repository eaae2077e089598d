"""The interface one backend implements.

Shapes: a block has ``n_src`` source and ``n_dst`` destination nodes (destinations are
the first ``n_dst`` sources) and ``E`` edges ``edge_src[e] -> edge_dst[e]`` in the
order of :class:`betty.batch.LayerEdges` (the canonical neighbour order).

A *whole graph* (what reversible GNNs run on: the same ``N`` nodes at every layer's
input and output) is the backend's graph object for a :class:`betty.graph.Graph` or an
induced subgraph of one; it answers ``num_nodes()``, ``num_edges()``, ``edges()``,
``to(device)`` and ``device`` (DGL's read API). Its convolutions map ``(N, in)`` to
``(N, out)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the backend names and checks import no framework
    import torch
    from torch import nn

__all__ = ["Backend", "ToDevice", "plain_to", "check_node_ids"]

ToDevice = Callable[["torch.Tensor", bool], "torch.Tensor"]
"""``to(tensor, copy)``: ``tensor`` on the block's device (a fresh copy with ``copy``)."""


def check_node_ids(node_ids: "torch.Tensor", num_nodes: int) -> None:
    """Refuse ``node_ids`` that are not a 1-D integer tensor of strictly increasing IDs
    below ``num_nodes`` (:meth:`Backend.node_subgraph`'s contract): a boolean mask read as
    IDs 0 and 1, or a repeated ID, gave each backend another subgraph."""
    from betty.checks import integer_ids

    node_ids = integer_ids(node_ids, "node_ids", "node IDs", upper=num_nodes)
    if node_ids.numel() > 1 and not bool((node_ids[1:] > node_ids[:-1]).all()):
        raise ValueError("node_ids must be strictly increasing (each node once, in ID order)")


def plain_to(device) -> ToDevice:
    """The default :data:`ToDevice`: ``tensor.to(device, copy=copy)``."""
    return lambda tensor, copy=False: tensor.to(device, copy=copy)


def _required_degrees(layer) -> torch.Tensor:
    """``layer.src_out_degree``, or a ``ValueError`` saying where it comes from."""
    if layer.src_out_degree is None:
        raise ValueError("this block has no src_out_degree (the sources' whole-graph "
                         "out-degrees, which the symmetric GCN normalises by); sample it "
                         "with betty.sampling.sample_full_batch, which records them")
    return layer.src_out_degree


class Backend:
    """Block construction, message-passing primitives and layers of one framework."""

    name: str = ""

    # -- blocks ---------------------------------------------------------------------
    def make_block(self, layer, device: torch.device | str = "cpu", *, copy: bool = False,
                   degrees: bool = False, to: ToDevice | None = None):
        """The backend's block object for one :class:`betty.batch.LayerEdges`, on
        ``device``, edge order preserved. ``copy`` forces fresh index tensors on the
        device (so a micro-batch's transfer is counted even when already there).
        ``degrees`` also carries ``layer.src_out_degree`` to the device (read back by
        :meth:`src_out_degree`; the symmetric GCN needs it). ``to``: how each index
        tensor reaches ``device`` (``to(tensor, copy)``, e.g.
        :meth:`betty.streams.Staged.to`, which also records it); default
        ``tensor.to(device, copy=copy)``."""
        raise NotImplementedError

    def make_blocks(self, layers: Sequence, device: torch.device | str = "cpu", *,
                    copy: bool = False, degrees: bool = False, to: ToDevice | None = None) -> list:
        return [self.make_block(layer, device, copy=copy, degrees=degrees, to=to) for layer in layers]

    def src_out_degree(self, block) -> torch.Tensor | None:
        """``(n_src,)`` whole-graph out-degrees of the block's sources, as carried by
        :meth:`make_block` with ``degrees=True`` (else ``None``)."""
        raise NotImplementedError

    def in_degrees(self, block) -> torch.Tensor:
        """``(n_dst,)`` int64 number of in-edges of every destination."""
        return block.in_degrees()

    def copy_u_sum(self, block, z: torch.Tensor) -> torch.Tensor:
        """``(n_dst, *)``: ``sum_{e: dst(e)=v} z[src(e)]`` (0 without in-edges)."""
        raise NotImplementedError

    # -- primitives (GAT) -------------------------------------------------------------
    def num_dst(self, block) -> int:
        raise NotImplementedError

    def u_add_v(self, block, el: torch.Tensor, er: torch.Tensor) -> torch.Tensor:
        """``(E, *)``: ``el[src(e)] + er[dst(e)]``; ``el`` is ``(n_src, *)``, ``er`` ``(n_dst, *)``."""
        raise NotImplementedError

    def edge_softmax(self, block, e: torch.Tensor) -> torch.Tensor:
        """``(E, *)``: softmax of ``e`` over the in-edges of each destination."""
        raise NotImplementedError

    def u_mul_e_sum(self, block, z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """``(n_dst, *)``: ``sum_{e: dst(e)=v} z[src(e)] * a[e]`` (0 without in-edges)."""
        raise NotImplementedError

    # -- whole graphs (reversible GNNs) ------------------------------------------------
    def full_graph(self, graph, device: torch.device | str = "cpu"):
        """The backend's whole-graph object for ``graph`` (a :class:`betty.graph.Graph`
        or anything with ``edges()`` and ``num_nodes()``), edge order kept, on ``device``."""
        raise NotImplementedError

    def node_subgraph(self, graph, node_ids: torch.Tensor):
        """The subgraph induced by ``node_ids`` ``(n,)`` (increasing global IDs): local
        node ``i`` is ``node_ids[i]``; the edges with both ends inside (PyG: in edge-ID
        order; DGL: in ``dgl.node_subgraph``'s order).
        :meth:`graph_node_ids` of the result returns ``node_ids``."""
        raise NotImplementedError

    def graph_node_ids(self, graph) -> torch.Tensor | None:
        """``(N,)`` global IDs recorded by :meth:`node_subgraph`, else ``None``."""
        raise NotImplementedError

    def is_block(self, graph) -> bool:
        """Whether ``graph`` is a sampled bipartite block rather than a whole graph."""
        raise NotImplementedError

    def graph_conv(self, in_feats: int, out_feats: int) -> nn.Module:
        """DGL ``GraphConv(norm='both', allow_zero_in_degree=True)`` (parameters
        ``weight`` ``(in, out)``, ``bias`` ``(out,)``) on a whole graph:
        ``D_in^{-1/2} A D_out^{-1/2} H W + b``, degrees clamped to at least 1."""
        raise NotImplementedError

    def gat_conv(self, in_feats: int, out_feats: int, heads: int) -> nn.Module:
        """DGL ``GATConv(in, out, heads, allow_zero_in_degree=True)`` (parameters
        ``fc.weight``, ``attn_l``, ``attn_r`` ``(1, H, out)``, ``bias`` ``(H * out,)``)
        on a whole graph: ``(N, in)`` -> ``(N, H, out)``."""
        raise NotImplementedError

    # -- layers -----------------------------------------------------------------------
    def sage_conv(self, in_feats: int, out_feats: int, aggregator: str) -> nn.Module:
        """A GraphSAGE layer with DGL ``SAGEConv``'s math and parameter names:
        ``fc_self``/``fc_neigh`` (+ ``fc_pool`` for pool, ``lstm`` for lstm, ``bias``
        for gcn); ``forward(block, h)`` maps ``(n_src, in)`` to ``(n_dst, out)``."""
        raise NotImplementedError
