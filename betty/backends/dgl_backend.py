"""The DGL backend: ``dgl.create_block``, ``dgl.ops`` and DGL's ``SAGEConv``."""

from __future__ import annotations

import dgl
import dgl.ops as ops
import torch
from dgl.nn import GATConv, GraphConv, SAGEConv

from betty.backends.lstm import autocast_safe

from betty.backends.base import Backend, _required_degrees, check_node_ids, plain_to

__all__ = ["DGLBackend", "BACKEND", "SRC_OUT_DEGREE"]

#: the ``srcdata`` key of the sources' whole-graph out-degrees
SRC_OUT_DEGREE = "betty_src_out_degree"


class EdgelessPoolSAGEConv(SAGEConv):
    """DGL's ``SAGEConv``, except the pool aggregator on a block without edges: there the
    neighbour term is ``fc_neigh`` of zeros, as DGL computes it, with no path back to
    ``fc_pool``. DGL 2.1's max reduction over no edges still sends every destination's
    gradient to source row 0, through ``fc_pool``, so a micro-batch whose outputs have
    no in-edges got a gradient the full batch does not give (a 0-degree destination in a
    block with edges gets none)."""

    def forward(self, graph, feat, edge_weight=None):  # noqa: D102 (SAGEConv's signature)
        if self._aggre_type != "pool" or graph.num_edges() > 0:
            return super().forward(graph, feat, edge_weight)
        if isinstance(feat, tuple):
            h_self = self.feat_drop(feat[1])
        else:
            h_self = self.feat_drop(feat)
            if graph.is_block:
                h_self = h_self[: graph.number_of_dst_nodes()]
        zeros = torch.zeros(h_self.shape[0], self._in_src_feats).to(h_self)
        rst = self.fc_self(h_self) + self.fc_neigh(zeros)
        if self.activation is not None:
            rst = self.activation(rst)
        if self.norm is not None:
            rst = self.norm(rst)
        return rst


class DGLBackend(Backend):
    name = "dgl"

    def make_block(self, layer, device="cpu", *, copy=False, degrees=False, to=None):
        """``dgl.create_block`` with explicit node counts: destinations without in-edges
        are kept and the source order is exactly ``layer.src_nid``; with ``degrees`` the
        sources' whole-graph out-degrees go to ``srcdata[SRC_OUT_DEGREE]``."""
        to = to or plain_to(device)
        block = dgl.create_block(
            (to(layer.edge_src, copy), to(layer.edge_dst, copy)),
            num_src_nodes=layer.num_src, num_dst_nodes=layer.num_dst,
            idtype=torch.int64, device=device)
        if degrees:
            block.srcdata[SRC_OUT_DEGREE] = to(_required_degrees(layer), copy)
        return block

    def src_out_degree(self, block):
        return block.srcdata.get(SRC_OUT_DEGREE)

    def copy_u_sum(self, block, z):
        return ops.copy_u_sum(block, z)

    def num_dst(self, block) -> int:
        return block.num_dst_nodes()

    def u_add_v(self, block, el, er):
        return ops.u_add_v(block, el, er)

    def edge_softmax(self, block, e):
        return ops.edge_softmax(block, e)

    def u_mul_e_sum(self, block, z, a):
        if z.dtype != a.dtype:  # autocast: bf16 features, float32 softmax weights
            wide = torch.promote_types(z.dtype, a.dtype)
            z, a = z.to(wide), a.to(wide)
        return ops.u_mul_e_sum(block, z, a)

    def full_graph(self, graph, device="cpu"):
        if isinstance(graph, dgl.DGLGraph):
            return graph.to(device)
        if hasattr(graph, "to_dgl"):  # betty.graph.Graph caches its DGL graph
            return graph.to_dgl().to(device)
        src, dst = graph.edges()
        return dgl.graph((src, dst), num_nodes=graph.num_nodes(), idtype=torch.int64, device=device)

    def node_subgraph(self, graph, node_ids):
        check_node_ids(node_ids, graph.num_nodes())
        return dgl.node_subgraph(graph, node_ids.to(graph.device))

    def graph_node_ids(self, graph):
        return graph.ndata.get(dgl.NID)

    def is_block(self, graph):
        return bool(graph.is_block)

    def graph_conv(self, in_feats, out_feats):
        return GraphConv(in_feats, out_feats, norm="both", allow_zero_in_degree=True)

    def gat_conv(self, in_feats, out_feats, heads):
        return GATConv(in_feats, out_feats, num_heads=heads, allow_zero_in_degree=True)

    def sage_conv(self, in_feats, out_feats, aggregator):
        return autocast_safe(EdgelessPoolSAGEConv(in_feats, out_feats, aggregator))


BACKEND = DGLBackend()
