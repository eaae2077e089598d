"""The PyTorch Geometric backend.

A block is a :class:`PygBlock`: PyG's bipartite message-passing input
``edge_index`` ``(2, E)`` (row 0 local source, row 1 local destination) with the sizes
``(n_src, n_dst)``. Aggregations use ``torch_geometric.utils.scatter`` and ``softmax``.

PyG's ``SAGEConv`` names its weights ``lin_l``/``lin_r`` and its stock
``LSTMAggregation`` zero-pads every destination to the largest in-degree of the call and
reads the last padded step, so a node's aggregate depends on the other nodes of its
micro-batch. :class:`PygSAGEConv` instead has DGL ``SAGEConv``'s parameters and math;
its LSTM runs exactly ``d`` steps for a node of in-degree ``d`` (nodes bucketed by
degree, as DGL's degree bucketing does), over the neighbours in edge order (betty's
canonical order: ascending source global ID).

Whole graphs (reversible GNNs) are :class:`PygGraph` (a block with ``n_src = n_dst = N``
plus the global node IDs of an induced subgraph); :class:`PygGraphConv` and
:class:`PygGATConv` have DGL ``GraphConv`` / ``GATConv``'s parameters, initialisation
and math, so a state_dict loads in either backend.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F
from torch_geometric.utils import scatter, softmax

from betty.backends.base import Backend, _required_degrees, check_node_ids, plain_to
from betty.backends.lstm import AutocastLSTM
from betty.backends.graph_conv import GraphConvParameters

__all__ = ["PygBlock", "PygGraph", "PygSAGEConv", "PygGraphConv", "PygGATConv", "lstm_aggregate",
           "PygBackend", "BACKEND"]


@dataclass
class PygBlock:
    """One bipartite block: ``edge_index`` ``(2, E)`` int64, ``n_src`` sources of which
    the first ``n_dst`` are the destinations; ``src_out_degree`` ``(n_src,)``: the
    sources' whole-graph out-degrees, where carried (the symmetric GCN reads them)."""

    edge_index: torch.Tensor
    n_src: int
    n_dst: int
    src_out_degree: Optional[torch.Tensor] = None

    @property
    def src(self) -> torch.Tensor:
        return self.edge_index[0]

    @property
    def dst(self) -> torch.Tensor:
        return self.edge_index[1]

    @property
    def size(self) -> tuple[int, int]:
        """PyG's ``size=(n_src, n_dst)`` argument."""
        return self.n_src, self.n_dst

    def num_src_nodes(self) -> int:
        return self.n_src

    def num_dst_nodes(self) -> int:
        return self.n_dst

    def num_edges(self) -> int:
        return int(self.edge_index.shape[1])

    def in_degrees(self) -> torch.Tensor:
        """``(n_dst,)`` int64 in-degree of every destination."""
        return torch.bincount(self.dst, minlength=self.n_dst)


@dataclass
class PygGraph(PygBlock):
    """A whole graph of ``N = n_src = n_dst`` nodes, edges ``edge_index`` ``(2, E)``;
    ``node_ids`` ``(N,)`` are the global IDs of an induced subgraph (else ``None``).
    Answers DGL's small read API (``num_nodes``, ``num_edges``, ``edges``, ``to``)."""

    node_ids: Optional[torch.Tensor] = None

    def num_nodes(self) -> int:
        return self.n_src

    def edges(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.src, self.dst

    def out_degrees(self) -> torch.Tensor:
        """``(N,)`` int64 out-degree of every node."""
        return torch.bincount(self.src, minlength=self.n_src)

    @property
    def device(self) -> torch.device:
        return self.edge_index.device

    def to(self, device) -> "PygGraph":
        ids = None if self.node_ids is None else self.node_ids.to(device)
        return replace(self, edge_index=self.edge_index.to(device), node_ids=ids)


def lstm_aggregate(lstm: nn.LSTM, h_src: torch.Tensor, block: PygBlock) -> torch.Tensor:
    """DGL's LSTM reducer: ``(n_dst, F)`` last hidden state of ``lstm`` run over each
    destination's neighbours in edge order, from zero state; 0 without in-edges.

    Destinations of equal in-degree ``d`` form one batch ``(B, d, F)``, so every node
    runs exactly ``d`` steps and its result does not depend on the other nodes.
    """
    n_dst, width = block.n_dst, lstm.hidden_size
    order = torch.argsort(block.dst, stable=True)  # edges grouped by dst, edge order kept
    src_sorted = block.src[order]
    deg = block.in_degrees()
    start = torch.cumsum(deg, 0) - deg  # (n_dst,) first sorted edge of each destination
    nodes_all, last_all = [], []
    for d in torch.unique(deg[deg > 0]).tolist():
        nodes = torch.nonzero(deg == d).squeeze(1)
        steps = start[nodes, None] + torch.arange(d, device=deg.device)  # (B, d)
        mailbox = h_src[src_sorted[steps]]  # (B, d, F_in)
        zeros = h_src.new_zeros(1, nodes.numel(), width)
        _, (last, _) = lstm(mailbox, (zeros, zeros))  # last: (1, B, F)
        nodes_all.append(nodes)
        last_all.append(last.squeeze(0))
    if not nodes_all:
        return h_src.new_zeros(n_dst, width)
    last = torch.cat(last_all)  # float32 where the LSTM ran outside autocast (AutocastLSTM)
    return last.new_zeros(n_dst, width).index_put((torch.cat(nodes_all),), last)


class PygSAGEConv(nn.Module):
    """GraphSAGE layer with DGL ``SAGEConv``'s parameters, initialisation and math
    (see :mod:`betty.models.sage`): ``(n_src, in)`` -> ``(n_dst, out)``."""

    def __init__(self, in_feats: int, out_feats: int, aggregator: str) -> None:
        super().__init__()
        if aggregator not in ("mean", "gcn", "pool", "lstm"):
            raise ValueError(f"aggregator must be one of ('mean', 'gcn', 'pool', 'lstm'), got {aggregator!r}")
        self._in_src_feats, self._out_feats, self._aggre_type = in_feats, out_feats, aggregator
        # construction order as in DGL, so one seed gives the same weights in both backends
        if aggregator == "pool":
            self.fc_pool = nn.Linear(in_feats, in_feats)
        if aggregator == "lstm":
            self.lstm = AutocastLSTM(in_feats, in_feats, batch_first=True)
        self.fc_neigh = nn.Linear(in_feats, out_feats, bias=False)
        if aggregator != "gcn":
            self.fc_self = nn.Linear(in_feats, out_feats, bias=True)
        else:
            self.bias = nn.Parameter(torch.zeros(out_feats))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        gain = nn.init.calculate_gain("relu")
        if self._aggre_type == "pool":
            nn.init.xavier_uniform_(self.fc_pool.weight, gain=gain)
        if self._aggre_type == "lstm":
            self.lstm.reset_parameters()
        if self._aggre_type != "gcn":
            nn.init.xavier_uniform_(self.fc_self.weight, gain=gain)
        nn.init.xavier_uniform_(self.fc_neigh.weight, gain=gain)

    def forward(self, block: PygBlock, h: torch.Tensor) -> torch.Tensor:
        src, dst, n_dst = block.src, block.dst, block.n_dst
        h_self = h[:n_dst]
        agg = self._aggre_type
        lin_before_mp = self._in_src_feats > self._out_feats  # DGL's choice of op order
        if agg in ("mean", "gcn"):
            h_src = self.fc_neigh(h) if lin_before_mp else h
            if agg == "mean":
                neigh = scatter(h_src[src], dst, 0, n_dst, reduce="mean")
            else:
                deg = block.in_degrees().to(h.dtype)
                neigh = (scatter(h_src[src], dst, 0, n_dst, reduce="sum") + h_src[:n_dst]) / (deg[:, None] + 1)
            if not lin_before_mp:
                neigh = self.fc_neigh(neigh)
        elif agg == "pool":
            h_src = F.relu(self.fc_pool(h))
            neigh = self.fc_neigh(scatter(h_src[src], dst, 0, n_dst, reduce="max"))
        else:
            neigh = self.fc_neigh(lstm_aggregate(self.lstm, h, block))
        if agg == "gcn":
            return neigh + self.bias
        return self.fc_self(h_self) + neigh


class PygGraphConv(GraphConvParameters):
    """DGL ``GraphConv(norm='both')`` on a :class:`PygGraph`: ``(N, in)`` -> ``(N, out)``,

        out = D_in^{-1/2} A D_out^{-1/2} H W + b       (degrees clamped to >= 1),

    ``W`` applied before the aggregation when ``in > out``, after it otherwise (DGL's
    order); a node without in-edges gets ``b``. Parameters and initialisation: DGL
    ``GraphConv``'s (:class:`betty.backends.graph_conv.GraphConvParameters`)."""

    def __init__(self, in_feats: int, out_feats: int) -> None:
        super().__init__(in_feats, out_feats)
        self._in_feats, self._out_feats = in_feats, out_feats

    def forward(self, graph: PygGraph, h: torch.Tensor) -> torch.Tensor:
        src, dst, n = graph.src, graph.dst, graph.n_dst
        h = h * graph.out_degrees().to(h).clamp(min=1).pow(-0.5)[:, None]
        if self._in_feats > self._out_feats:
            out = scatter((h @ self.weight)[src], dst, 0, n, reduce="sum")
        else:
            out = scatter(h[src], dst, 0, n, reduce="sum") @ self.weight
        return out * graph.in_degrees().to(h).clamp(min=1).pow(-0.5)[:, None] + self.bias


class PygGATConv(nn.Module):
    """DGL ``GATConv`` (no dropout, no residual) on a :class:`PygGraph`, via the PyG
    backend's primitives: ``(N, in)`` -> ``(N, H, out)``, the same forward
    (:func:`betty.models.gat.gat_forward`) as the sampled-batch GAT; the bias is flat
    ``(H out,)`` as in DGL. A node without in-edges gets the bias."""

    def __init__(self, in_feats: int, out_feats: int, heads: int, negative_slope: float = 0.2) -> None:
        super().__init__()
        self._num_heads, self._out_feats = heads, out_feats
        # construction order as in DGL (the Linear draws its default init first)
        self.fc = nn.Linear(in_feats, out_feats * heads, bias=False)
        self.attn_l = nn.Parameter(torch.empty(1, heads, out_feats))
        self.attn_r = nn.Parameter(torch.empty(1, heads, out_feats))
        self.bias = nn.Parameter(torch.empty(heads * out_feats))
        self.negative_slope = negative_slope
        self.reset_parameters()

    def reset_parameters(self) -> None:
        from betty.models.gat import reset_gat_parameters

        reset_gat_parameters(self)

    def forward(self, graph: PygGraph, h: torch.Tensor) -> torch.Tensor:
        from betty.models.gat import gat_forward

        return gat_forward(BACKEND, graph, h, self, self.bias.view(self._num_heads, self._out_feats))


class PygBackend(Backend):
    name = "pyg"

    def make_block(self, layer, device="cpu", *, copy=False, degrees=False, to=None):
        to = to or plain_to(device)
        edge_index = to(torch.stack([layer.edge_src, layer.edge_dst]).long(), False)  # stack copies; scatter wants int64
        deg = to(_required_degrees(layer), copy) if degrees else None
        return PygBlock(edge_index, layer.num_src, layer.num_dst, deg)

    def src_out_degree(self, block):
        return block.src_out_degree

    def copy_u_sum(self, block, z):
        return scatter(z[block.src], block.dst, 0, block.n_dst, reduce="sum")

    def num_dst(self, block) -> int:
        return block.n_dst

    def u_add_v(self, block, el, er):
        return el[block.src] + er[block.dst]

    def edge_softmax(self, block, e):
        return softmax(e, block.dst, num_nodes=block.n_dst)

    def u_mul_e_sum(self, block, z, a):
        return scatter(z[block.src] * a, block.dst, 0, block.n_dst, reduce="sum")

    def full_graph(self, graph, device="cpu"):
        if isinstance(graph, PygGraph):
            return graph.to(device)
        src, dst = graph.edges()
        edge_index = torch.stack([torch.as_tensor(src), torch.as_tensor(dst)]).to(device, torch.int64)
        n = graph.num_nodes()
        return PygGraph(edge_index, n, n)

    def node_subgraph(self, graph, node_ids):
        check_node_ids(node_ids, graph.num_nodes())
        node_ids = node_ids.to(graph.device, torch.int64)
        local = torch.full((graph.num_nodes(),), -1, dtype=torch.int64, device=graph.device)
        local[node_ids] = torch.arange(node_ids.numel(), device=graph.device)
        mapped = local[graph.edge_index]  # (2, E), -1 outside the part
        keep = (mapped >= 0).all(dim=0)
        n = int(node_ids.numel())
        return PygGraph(mapped[:, keep], n, n, node_ids=node_ids)

    def graph_node_ids(self, graph):
        return getattr(graph, "node_ids", None)

    def is_block(self, graph):
        return not isinstance(graph, PygGraph)

    def graph_conv(self, in_feats, out_feats):
        return PygGraphConv(in_feats, out_feats)

    def gat_conv(self, in_feats, out_feats, heads):
        return PygGATConv(in_feats, out_feats, heads)

    def sage_conv(self, in_feats, out_feats, aggregator):
        return PygSAGEConv(in_feats, out_feats, aggregator)


BACKEND = PygBackend()
