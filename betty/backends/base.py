"""The interface one backend implements.

Shapes: a block has ``n_src`` source and ``n_dst`` destination nodes (destinations are
the first ``n_dst`` sources) and ``E`` edges ``edge_src[e] -> edge_dst[e]`` in the
order of :class:`betty.batch.LayerEdges` (the canonical neighbour order).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["Backend"]


class Backend:
    """Block construction, message-passing primitives and layers of one framework."""

    name: str = ""

    # -- blocks ---------------------------------------------------------------------
    def make_block(self, layer, device: torch.device | str = "cpu", *, copy: bool = False):
        """The backend's block object for one :class:`betty.batch.LayerEdges`, on
        ``device``, edge order preserved. ``copy`` forces fresh index tensors on the
        device (so a micro-batch's transfer is counted even when already there)."""
        raise NotImplementedError

    def make_blocks(self, layers: Sequence, device: torch.device | str = "cpu", *,
                    copy: bool = False) -> list:
        return [self.make_block(layer, device, copy=copy) for layer in layers]

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

    # -- layers -----------------------------------------------------------------------
    def sage_conv(self, in_feats: int, out_feats: int, aggregator: str) -> nn.Module:
        """A GraphSAGE layer with DGL ``SAGEConv``'s math and parameter names:
        ``fc_self``/``fc_neigh`` (+ ``fc_pool`` for pool, ``lstm`` for lstm, ``bias``
        for gcn); ``forward(block, h)`` maps ``(n_src, in)`` to ``(n_dst, out)``."""
        raise NotImplementedError
