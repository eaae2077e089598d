"""The parameters of a graph convolution as DGL's ``GraphConv`` holds them, shared by the
sampled-block :class:`betty.models.gcn.GCNLayer` and the PyG backend's whole-graph
:class:`betty.backends.pyg_backend.PygGraphConv` (the same draws from one seed)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["GraphConvParameters"]


class GraphConvParameters(nn.Module):
    """DGL ``GraphConv``'s parameters and initialisation: ``weight`` ``(in, out)``
    (Xavier uniform) and ``bias`` ``(out,)`` (zeros)."""

    def __init__(self, in_feats: int, out_feats: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_feats, out_feats))
        self.bias = nn.Parameter(torch.empty(out_feats))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.weight)
        nn.init.zeros_(self.bias)
