"""Graph convolutional network (Kipf & Welling, ICLR 2017, "Semi-Supervised
Classification with Graph Convolutional Networks") on the sampled blocks of either
backend, with DGL ``GraphConv(norm='both')``'s parameters, initialisation and math.

Layer l maps source features ``h_u`` to destination features

    h_v' = Σ_{u ∈ N(v) ∪ {v}} 1 / sqrt(d̃_u^out · d̃_v^in) · W h_u + b

with N(v) the sampled in-neighbours of v and the self term v itself added by the layer
(Kipf & Welling's Ã = A + I: the graph needs no self-loop edges, and a graph that has
them counts the node twice). The degrees include that self-loop:

* ``d̃_v^in = |N(v)| + 1``: v's sampled in-degree in the block, plus one. A destination
  keeps all its sampled in-edges in every micro-batch, so this is the same in every
  micro-batch as in the full batch.
* ``d̃_u^out = deg_out(u) + 1``: u's out-degree **in the whole graph**, plus one,
  recorded by the sampler (:attr:`betty.batch.LayerEdges.src_out_degree`) and carried
  with the block. A source's out-degree *inside* a block depends on which destinations
  the block holds (a carved micro-batch holds fewer), so DGL's per-block ``GraphConv`` would
  normalise a node differently in each micro-batch; the graph's degree does not.

With every neighbour sampled (fanout ``-1``) ``|N(v)| = deg_in(v)``, so a layer is
exactly DGL's ``GraphConv(norm='both')`` on the whole graph with a self-loop added to
every node (Kipf & Welling's propagation rule), for every output node.

``W`` is applied before the aggregation when ``in > out`` and after it otherwise
(DGL's order); ReLU between layers, none after the last.
"""

from __future__ import annotations

import torch
from torch import nn

from betty.backends.graph_conv import GraphConvParameters
from betty.models.base import BlockGNN, check_sizes

__all__ = ["GCN", "GCNLayer", "gcn_forward"]


def gcn_forward(ops, block, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """One GCN layer (module docstring) with one backend's primitives ``ops``
    (:class:`betty.backends.base.Backend`): ``h`` ``(n_src, in)`` -> ``(n_dst, out)``.

    The op sequence::

        hs  = h * (deg_out + 1)^-1/2                       (n_src, in)
        hs  = hs @ W                                        (when in > out)
        agg = copy_u_sum(hs) + hs[:n_dst]                   (n_dst, *)
        agg = agg @ W                                       (when in <= out)
        out = agg * (in_deg + 1)^-1/2 + b                   (n_dst, out)
    """
    deg_out = ops.src_out_degree(block)
    if deg_out is None:
        raise ValueError("the GCN needs blocks built with degrees=True (the sources' "
                         "whole-graph out-degrees); build them with model.make_blocks")
    n_dst = ops.num_dst(block)
    src_norm = (deg_out.to(h.dtype) + 1).rsqrt()
    dst_norm = (ops.in_degrees(block).to(h.dtype) + 1).rsqrt()
    hs = h * src_norm[:, None]
    project_first = weight.shape[0] > weight.shape[1]
    if project_first:
        hs = hs @ weight
    agg = ops.copy_u_sum(block, hs) + hs[:n_dst]
    if not project_first:
        agg = agg @ weight
    return agg * dst_norm[:, None] + bias


class GCNLayer(GraphConvParameters):
    """One GCN layer with DGL ``GraphConv``'s parameters (:class:`GraphConvParameters`)."""

    def __init__(self, in_feats: int, out_feats: int, backend: str = "auto") -> None:
        from betty.backends import resolve_backend

        backend_name = resolve_backend(backend)  # before the parameters draw their values
        super().__init__(in_feats, out_feats)
        self.backend_name = backend_name

    def forward(self, block, h: torch.Tensor) -> torch.Tensor:
        from betty.backends import get_backend

        return gcn_forward(get_backend(self.backend_name), block, h, self.weight, self.bias)


class GCN(BlockGNN):
    """An L-layer GCN.

    Args:
        in_feats, hidden, out_feats, num_layers: widths (hidden for layers 0..L-2).
        dropout: drop probability on every layer's input.
        dropout_mode: ``"deterministic"`` or ``"standard"``.
        backend: ``"auto"``, ``"dgl"`` or ``"pyg"`` (:mod:`betty.backends`); the
            parameters have the same names and shapes in both.
        activation: the non-linearity between layers (:data:`betty.models.base.ACTIVATIONS`).
    """

    def __init__(self, in_feats: int, hidden: int, out_feats: int, num_layers: int = 2,
                 dropout: float = 0.0, dropout_mode: str = "deterministic",
                 backend: str = "auto", activation: str = "relu") -> None:
        check_sizes(in_feats=in_feats, hidden=hidden, out_feats=out_feats)
        super().__init__(num_layers, dropout, dropout_mode, backend, activation)
        self.widths = [in_feats] + [hidden] * (num_layers - 1) + [out_feats]
        self.layers = nn.ModuleList(
            GCNLayer(self.widths[l], self.widths[l + 1], backend=self.backend_name)
            for l in range(num_layers))

    @property
    def needs_degrees(self) -> bool:
        return True

    def reset_parameters(self) -> None:
        for layer in self.layers:
            layer.reset_parameters()

    def conv(self, layer: int, block, h: torch.Tensor, *, edge_id=None, dropout_key=None) -> torch.Tensor:
        return self.layers[layer](block, h)
