"""Block-based GNN models, reversible deep GNNs, and the factory that builds them from a config."""

from __future__ import annotations

from torch import nn

from betty import catalog

from betty.models.base import ACTIVATIONS, DROPOUT_MODES, BlockGNN
from betty.models.gat import GAT
from betty.models.gcn import GCN
from betty.models.sage import SAGE_AGGREGATORS, GraphSAGE

__all__ = ["BlockGNN", "GraphSAGE", "GAT", "GCN", "build_model", "ARCHS", "SAGE_AGGREGATORS", "DROPOUT_MODES",
           "ACTIVATIONS", "DEFAULT_ACTIVATION"]

DEFAULT_ACTIVATION = {"sage": "relu", "gat": "elu", "gcn": "relu"}
"""The non-linearity between layers when none is given (GAT's paper uses ELU)."""

ARCHS = catalog.ARCHS


def build_model(arch: str, in_feats: int, out_feats: int, *, hidden: int = 256,
                layers: int = 2, aggregator: str = "mean", heads: int = 4,
                output_heads: int | None = None, dropout: float = 0.0, attn_dropout: float = 0.0,
                dropout_mode: str = "deterministic", groups: int = 2, conv: str = "gcn",
                norm: str = "layer", reversible: bool = True, checkpoint: bool = False,
                weight_tied: bool = False, deq: bool = False, deq_max_iter: int = 50,
                deq_tol: float = 1e-5, backend: str = "auto",
                activation: str | None = None) -> nn.Module:
    """Build a model by name.

    ``"sage"`` / ``"gat"`` / ``"gcn"``: a :class:`BlockGNN` on sampled blocks
    (``aggregator``, ``heads``, ``output_heads`` (GAT's last layer, default ``heads``),
    ``attn_dropout``, ``dropout_mode`` apply; ``gcn`` is Kipf & Welling's symmetric
    GCN, :mod:`betty.models.gcn`). ``"revgnn"``: a
    :class:`betty.rev.model.RevGNN` on whole graphs or induced subgraphs, ``layers``
    blocks of ``groups`` channel groups (``conv``, ``norm``, ``reversible``,
    ``checkpoint``, ``weight_tied``, ``heads`` for ``conv="gat"``), or with ``deq`` a
    :class:`betty.rev.deq.RevGNNDEQ` (one weight-tied cell solved to a fixed
    point, forward and backward, in at most ``deq_max_iter`` iterations to a relative
    residual of ``deq_tol``; ``layers``, ``groups``, ``reversible``, ``checkpoint``,
    ``weight_tied`` do not apply). ``backend`` (``auto``/``dgl``/``pyg``, :mod:`betty.backends`) applies to
    every arch. RevGNN's dropout masks come from its trainer (:mod:`betty.rev.engine`), so
    ``dropout_mode`` is the trainer's argument there. ``activation`` (``sage``/``gat``/``gcn``;
    one of :data:`ACTIVATIONS`, ``None``: :data:`DEFAULT_ACTIVATION`): the non-linearity
    between layers; RevGNN keeps its ReLU and refuses another.
    """
    if arch in DEFAULT_ACTIVATION:
        activation = activation or DEFAULT_ACTIVATION[arch]
    elif activation not in (None, "relu"):
        raise ValueError(f"activation applies to arch sage, gat or gcn only (arch {arch!r} uses relu), "
                         f"got {activation!r}")
    if arch == "sage":
        return GraphSAGE(in_feats, hidden, out_feats, layers, aggregator, dropout, dropout_mode, backend,
                         activation)
    if arch == "gat":
        return GAT(in_feats, hidden, out_feats, layers, heads, dropout, attn_dropout, dropout_mode,
                   backend, activation, output_heads=output_heads)
    if arch == "gcn":
        return GCN(in_feats, hidden, out_feats, layers, dropout, dropout_mode, backend, activation)
    if arch == "revgnn":
        if deq:
            from betty.rev.deq import RevGNNDEQ

            return RevGNNDEQ(in_feats, hidden, out_feats, conv=conv, dropout=dropout, norm=norm,
                             heads=heads, backend=backend, max_iter=deq_max_iter, tol=deq_tol,
                             backward_max_iter=deq_max_iter, backward_tol=deq_tol)
        from betty.rev.model import RevGNN

        return RevGNN(in_feats, hidden, out_feats, layers, num_groups=groups, conv=conv,
                      dropout=dropout, norm=norm, reversible=reversible, checkpoint=checkpoint,
                      weight_tied=weight_tied, heads=heads, backend=backend)
    raise ValueError(f"model arch must be one of {ARCHS}, got {arch!r}")
