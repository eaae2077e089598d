"""Block-based GNN models and the factory that builds them from a config."""

from __future__ import annotations

from betty.models.base import DROPOUT_MODES, BlockGNN
from betty.models.gat import GAT
from betty.models.sage import SAGE_AGGREGATORS, GraphSAGE

__all__ = ["BlockGNN", "GraphSAGE", "GAT", "build_model", "ARCHS", "SAGE_AGGREGATORS", "DROPOUT_MODES"]

ARCHS = ("sage", "gat")


def build_model(arch: str, in_feats: int, out_feats: int, *, hidden: int = 256,
                layers: int = 2, aggregator: str = "mean", heads: int = 4,
                dropout: float = 0.0, attn_dropout: float = 0.0,
                dropout_mode: str = "deterministic") -> BlockGNN:
    """Build a block model by name (``"sage"`` or ``"gat"``)."""
    if arch == "sage":
        return GraphSAGE(in_feats, hidden, out_feats, layers, aggregator, dropout, dropout_mode)
    if arch == "gat":
        return GAT(in_feats, hidden, out_feats, layers, heads, dropout, attn_dropout, dropout_mode)
    raise ValueError(f"model arch must be one of {ARCHS}, got {arch!r}")
