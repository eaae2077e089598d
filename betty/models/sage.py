"""GraphSAGE (Hamilton et al., NeurIPS 2017, "Inductive Representation Learning on
Large Graphs") on DGL blocks.

Layer l maps source features ``h_u`` to destination features

    h_v' = W_self h_v + W_neigh AGG({h_u : u in N(v)}) + b           (mean, pool, lstm)
    h_v' = W_neigh (h_v + sum_{u in N(v)} h_u) / (|N(v)| + 1) + b    (gcn)

with AGG = mean; max over ReLU(W_pool h_u + b_pool) (pool); or the last hidden state of
an LSTM run over the neighbours (lstm). The convolution comes from the backend
(:mod:`betty.backends`): DGL's ``SAGEConv``, or on PyG a layer with the same parameters
and math. For the LSTM the neighbour order matters: betty feeds every block with its
edges sorted by (destination, source global ID), and both backends order a node's
neighbours by edge order, so each node sees its neighbours by ascending global ID in
every micro-batch.
"""

from __future__ import annotations

import torch
from torch import nn

from betty import catalog
from betty.models.base import BlockGNN, check_sizes

__all__ = ["GraphSAGE", "SAGE_AGGREGATORS"]

SAGE_AGGREGATORS = catalog.SAGE_AGGREGATORS


class GraphSAGE(BlockGNN):
    """An L-layer GraphSAGE.

    Args:
        in_feats: input feature width.
        hidden: hidden width of layers 0..L-2.
        out_feats: output width (classes).
        num_layers: L.
        aggregator: one of :data:`SAGE_AGGREGATORS`.
        dropout: drop probability on every layer's input.
        dropout_mode: ``"deterministic"`` or ``"standard"``.
        backend: ``"auto"``, ``"dgl"`` or ``"pyg"`` (:mod:`betty.backends`); the
            parameters have the same names and shapes in both.
        activation: between layers, one of :data:`betty.models.base.ACTIVATIONS`.
    """

    def __init__(self, in_feats: int, hidden: int, out_feats: int, num_layers: int = 2,
                 aggregator: str = "mean", dropout: float = 0.0,
                 dropout_mode: str = "deterministic", backend: str = "auto",
                 activation: str = "relu") -> None:
        check_sizes(in_feats=in_feats, hidden=hidden, out_feats=out_feats)
        super().__init__(num_layers, dropout, dropout_mode, backend, activation)
        if aggregator not in SAGE_AGGREGATORS:
            raise ValueError(f"aggregator must be one of {SAGE_AGGREGATORS}, got {aggregator!r}")
        self.aggregator = aggregator
        widths = [in_feats] + [hidden] * (num_layers - 1) + [out_feats]
        self.widths = widths
        self.layers = nn.ModuleList(
            self.backend.sage_conv(widths[l], widths[l + 1], aggregator) for l in range(num_layers)
        )

    def reset_parameters(self) -> None:
        for layer in self.layers:
            layer.reset_parameters()

    def conv(self, layer: int, block, h: torch.Tensor, *, edge_id=None, dropout_key=None) -> torch.Tensor:
        return self.layers[layer](block, h)
