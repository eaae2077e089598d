"""Graph attention network (Veličković et al., ICLR 2018, "Graph Attention Networks")
on the blocks of either backend (:mod:`betty.backends` supplies u_add_v, edge_softmax
and u_mul_e_sum), with attention dropout keyed by global edge ID.

For destination v with sampled in-neighbours N(v), head k:

    z_u      = W_k h_u                                   (n_src, H, F)
    e_uv     = LeakyReLU(a_l,k · z_u + a_r,k · z_v)       (E, H)
    α_uv     = softmax_{u in N(v)} e_uv                   (edge softmax)
    h_v'[k]  = Σ_u dropout(α_uv) z_u + b_k                (n_dst, H, F)

Hidden layers concatenate the H heads (width H·F) and apply ELU (the paper's choice;
``activation`` picks another); the last layer averages its own ``output_heads`` heads
(default H; the GAT paper uses one on Cora). A destination without in-edges gets the bias only. DGL's ``GATConv`` draws its
attention-dropout mask per call, which breaks K-way exactness; here the mask of edge
(u, v) is a hash of its global edge ID (:mod:`betty.models.dropout`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from betty.models.base import BlockGNN, check_sizes
from betty.models.dropout import check_dropout

__all__ = ["GAT", "GATLayer", "gat_forward", "reset_gat_parameters"]


def reset_gat_parameters(layer: nn.Module) -> None:
    """DGL's ``GATConv`` initialisation of ``layer.fc``, ``attn_l``, ``attn_r`` (Xavier
    normal, ReLU gain) and ``bias`` (zeros); shared by every GAT layer betty builds."""
    gain = nn.init.calculate_gain("relu")
    nn.init.xavier_normal_(layer.fc.weight, gain=gain)
    nn.init.xavier_normal_(layer.attn_l, gain=gain)
    nn.init.xavier_normal_(layer.attn_r, gain=gain)
    nn.init.zeros_(layer.bias)


def gat_forward(ops, block, h: torch.Tensor, layer: nn.Module, bias: torch.Tensor,
                attn_drop=None) -> torch.Tensor:
    """The GAT forward of the module docstring, with one backend's primitives ``ops``
    (:class:`betty.backends.base.Backend`), on a block or a whole graph (``n_src = n_dst``):
    ``h`` ``(n_src, d_in)`` -> ``(n_dst, H, F)``.

    ``layer`` holds ``fc`` (``d_in -> H F``, no bias), ``attn_l`` and ``attn_r``
    ``(1, H, F)`` and ``negative_slope``; ``bias`` is ``(H, F)`` (a view of a flat
    ``(H F,)`` bias is fine). The op sequence, which :mod:`betty.memory.replay` and
    :mod:`betty.rev.replay` model op by op::

        z   = fc(h).view(n_src, H, F)
        el  = (z * attn_l).sum(-1)                       (n_src, H)
        er  = (z[:n_dst] * attn_r).sum(-1)               (n_dst, H)
        e   = leaky_relu(u_add_v(el, er))                (E, H)
        a   = attn_drop(edge_softmax(e))                 (E, H)
        out = u_mul_e_sum(z, a.unsqueeze(-1)) + bias     (n_dst, H, F)

    ``attn_drop``: optional callable applied to the ``(E, H)`` attention weights.
    """
    heads, out_feats = layer.attn_l.shape[1:]
    n_dst = ops.num_dst(block)
    z = layer.fc(h).view(-1, heads, out_feats)  # (n_src, H, F)
    el = (z * layer.attn_l).sum(-1)  # (n_src, H)
    er = (z[:n_dst] * layer.attn_r).sum(-1)  # (n_dst, H)
    e = F.leaky_relu(ops.u_add_v(block, el, er), layer.negative_slope)  # (E, H)
    a = ops.edge_softmax(block, e)  # (E, H)
    if attn_drop is not None:
        a = attn_drop(a)
    out = ops.u_mul_e_sum(block, z, a.unsqueeze(-1))  # (n_dst, H, F)
    return out + bias


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

        return gat_forward(get_backend(self.backend_name), block, h, self, self.bias, attn_drop)


class GAT(BlockGNN):
    """An L-layer multi-head GAT.

    Args:
        in_feats, hidden, out_feats, num_layers: widths; hidden is per head.
        heads: attention heads of every hidden layer (and of the last by default).
        output_heads: attention heads of the last layer, averaged (``None``: ``heads``;
            ``1``: a single output head, as in the GAT paper's Cora model).
        dropout: drop probability on every layer's input features.
        attn_dropout: drop probability on attention weights.
        dropout_mode: ``"deterministic"`` or ``"standard"``.
        backend: ``"auto"``, ``"dgl"`` or ``"pyg"`` (:mod:`betty.backends`).
        activation: between layers, one of :data:`betty.models.base.ACTIVATIONS`.
    """

    def __init__(self, in_feats: int, hidden: int, out_feats: int, num_layers: int = 2,
                 heads: int = 4, dropout: float = 0.0, attn_dropout: float = 0.0,
                 dropout_mode: str = "deterministic", backend: str = "auto",
                 activation: str = "elu", *, output_heads: int | None = None) -> None:
        output_heads = heads if output_heads is None else output_heads
        check_sizes(in_feats=in_feats, hidden=hidden, out_feats=out_feats, heads=heads, output_heads=output_heads)
        super().__init__(num_layers, dropout, dropout_mode, backend, activation)
        check_dropout(attn_dropout, "attn_dropout")
        self.heads, self.output_heads = heads, output_heads
        self.attn_dropout = float(attn_dropout)
        ins = [in_feats] + [hidden * heads] * (num_layers - 1)
        outs = [hidden] * (num_layers - 1) + [out_feats]
        layer_heads = [heads] * (num_layers - 1) + [output_heads]
        self.widths = [in_feats] + [hidden * heads] * (num_layers - 1) + [out_feats]
        self.layers = nn.ModuleList(GATLayer(ins[l], outs[l], layer_heads[l], backend=self.backend_name)
                                    for l in range(num_layers))

    def reset_parameters(self) -> None:
        for layer in self.layers:
            layer.reset_parameters()

    @property
    def needs_edge_ids(self) -> bool:
        return self.attn_dropout > 0 and self.dropout_mode == "deterministic"

    def conv(self, layer: int, block, h: torch.Tensor, *, edge_id=None, dropout_key=None) -> torch.Tensor:
        def attn_drop(a):
            return self.drop(a, layer, edge_id, dropout_key, p=self.attn_dropout, salt=1)

        dropping = self.training and self.attn_dropout > 0
        out = self.layers[layer](block, h, attn_drop if dropping else None)  # (n_dst, H, F)
        if layer == self.num_layers - 1:
            return out.mean(1)
        return out.flatten(1)
