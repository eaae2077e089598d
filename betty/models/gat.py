"""Graph attention network (Veličković et al., ICLR 2018, "Graph Attention Networks")
on the blocks of either backend (:mod:`betty.backends` supplies u_add_v, edge_softmax
and u_mul_e_sum), with attention dropout keyed by global edge ID.

For destination v with sampled in-neighbours N(v), head k:

    z_u      = W_k h_u                                   (n_src, H, F)
    e_uv     = LeakyReLU(a_l,k · z_u + a_r,k · z_v)       (E, H)
    α_uv     = softmax_{u in N(v)} e_uv                   (edge softmax)
    h_v'[k]  = Σ_u dropout(α_uv) z_u + b_k                (n_dst, H, F)

Hidden layers concatenate the H heads (width H·F) and apply ELU; the last layer averages
them. A destination without in-edges gets the bias only. DGL's ``GATConv`` draws its
attention-dropout mask per call, which breaks K-way exactness; here the mask of edge
(u, v) is a hash of its global edge ID (:mod:`betty.models.dropout`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from betty.models.base import BlockGNN

__all__ = ["GAT", "GATLayer", "reset_gat_parameters"]


def reset_gat_parameters(layer: nn.Module) -> None:
    """DGL's ``GATConv`` initialisation of ``layer.fc``, ``attn_l``, ``attn_r`` (Xavier
    normal, ReLU gain) and ``bias`` (zeros); shared by every GAT layer betty builds."""
    gain = nn.init.calculate_gain("relu")
    nn.init.xavier_normal_(layer.fc.weight, gain=gain)
    nn.init.xavier_normal_(layer.attn_l, gain=gain)
    nn.init.xavier_normal_(layer.attn_r, gain=gain)
    nn.init.zeros_(layer.bias)


class GATLayer(nn.Module):
    """One multi-head attention layer: ``(n_src, d_in)`` -> ``(n_dst, H, F)``."""

    def __init__(self, in_feats: int, out_feats: int, heads: int, negative_slope: float = 0.2,
                 backend: str = "auto") -> None:
        super().__init__()
        from betty.backends import resolve_backend

        self.backend_name = resolve_backend(backend)
        self.in_feats, self.out_feats, self.heads = in_feats, out_feats, heads
        self.fc = nn.Linear(in_feats, heads * out_feats, bias=False)
        self.attn_l = nn.Parameter(torch.empty(1, heads, out_feats))
        self.attn_r = nn.Parameter(torch.empty(1, heads, out_feats))
        self.bias = nn.Parameter(torch.empty(heads, out_feats))
        self.negative_slope = negative_slope
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_gat_parameters(self)

    def forward(self, block, h: torch.Tensor, attn_drop=None) -> torch.Tensor:
        """``attn_drop``: optional callable applied to the ``(E, H)`` attention weights."""
        from betty.backends import get_backend

        ops = get_backend(self.backend_name)
        n_dst = ops.num_dst(block)
        z = self.fc(h).view(-1, self.heads, self.out_feats)  # (n_src, H, F)
        el = (z * self.attn_l).sum(-1)  # (n_src, H)
        er = (z[:n_dst] * self.attn_r).sum(-1)  # (n_dst, H)
        e = F.leaky_relu(ops.u_add_v(block, el, er), self.negative_slope)  # (E, H)
        a = ops.edge_softmax(block, e)  # (E, H)
        if attn_drop is not None:
            a = attn_drop(a)
        out = ops.u_mul_e_sum(block, z, a.unsqueeze(-1))  # (n_dst, H, F)
        return out + self.bias


class GAT(BlockGNN):
    """An L-layer multi-head GAT.

    Args:
        in_feats, hidden, out_feats, num_layers: widths; hidden is per head.
        heads: attention heads of every layer.
        dropout: drop probability on every layer's input features.
        attn_dropout: drop probability on attention weights.
        dropout_mode: ``"deterministic"`` or ``"standard"``.
        backend: ``"auto"``, ``"dgl"`` or ``"pyg"`` (:mod:`betty.backends`).
    """

    def __init__(self, in_feats: int, hidden: int, out_feats: int, num_layers: int = 2,
                 heads: int = 4, dropout: float = 0.0, attn_dropout: float = 0.0,
                 dropout_mode: str = "deterministic", backend: str = "auto") -> None:
        super().__init__(num_layers, dropout, dropout_mode, backend)
        if heads < 1:
            raise ValueError(f"heads must be >= 1, got {heads}")
        if not 0.0 <= attn_dropout < 1.0:
            raise ValueError(f"attn_dropout must be in [0, 1), got {attn_dropout}")
        self.heads = heads
        self.attn_dropout = float(attn_dropout)
        ins = [in_feats] + [hidden * heads] * (num_layers - 1)
        outs = [hidden] * (num_layers - 1) + [out_feats]
        self.widths = [in_feats] + [hidden * heads] * (num_layers - 1) + [out_feats]
        self.layers = nn.ModuleList(GATLayer(ins[l], outs[l], heads, backend=self.backend_name) for l in range(num_layers))

    def reset_parameters(self) -> None:
        for layer in self.layers:
            layer.reset_parameters()

    @property
    def needs_edge_ids(self) -> bool:
        return self.attn_dropout > 0 and self.dropout_mode == "deterministic"

    def conv(self, layer: int, block, h: torch.Tensor, *, edge_id=None, dropout_key=None) -> torch.Tensor:
        attn_drop = None
        if self.training and self.attn_dropout > 0:
            def attn_drop(a):
                return self.drop(a, layer, edge_id, dropout_key, p=self.attn_dropout, salt=1)
        out = self.layers[layer](block, h, attn_drop)  # (n_dst, H, F)
        if layer == self.num_layers - 1:
            return out.mean(1)
        return out.flatten(1)

    def activation(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return F.elu(h)
