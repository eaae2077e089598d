"""The interface every block-based model in betty implements.

A model maps the L blocks of a (micro-)batch and the input features of their layer-0
source nodes to one output row per destination node of the last block. Layers run one
at a time through :meth:`BlockGNN.forward_layer`, so the same model also serves
layer-wise full-neighbour inference (:mod:`betty.inference`).

Dropout is applied to every layer's input. In ``"deterministic"`` mode (the default)
the mask of row ``r`` of layer ``l`` is a hash of (step key, l, global ID of that row's
node), see :mod:`betty.models.dropout`, so a node gets the same mask in every
micro-batch and K-way training equals full-batch training exactly, dropout included.
``"standard"`` uses ``torch.nn.functional.dropout`` (a fresh mask per call).

The non-linearity after every layer but the last is one of :data:`ACTIVATIONS`
(``relu``, ``elu``, ``leaky_relu`` with slope 0.01, ``gelu`` exact), chosen per model
(default: the arch's own, ReLU for GraphSAGE, ELU for GAT). The memory replay
(:mod:`betty.memory.replay`) follows what each saves for its backward:
:data:`SAVES_RESULT` keep their output, the others their input.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from betty import catalog
from betty.models.dropout import check_dropout, hash_dropout

__all__ = ["BlockGNN", "DROPOUT_MODES", "ACTIVATIONS", "SAVES_RESULT", "activation_fn", "check_sizes"]

DROPOUT_MODES = ("deterministic", "standard")

_ACTIVATION_FNS = {"relu": F.relu, "elu": F.elu, "leaky_relu": F.leaky_relu, "gelu": F.gelu}
ACTIVATIONS = catalog.ACTIVATIONS
assert tuple(_ACTIVATION_FNS) == ACTIVATIONS, "betty.catalog.ACTIVATIONS lists them"
"""Non-linearities a block model may use between layers."""

SAVES_RESULT = ("relu",)
"""Activations whose autograd node saves their output (the others save their input)."""


def activation_fn(name: str):
    """The function of activation ``name`` (one of :data:`ACTIVATIONS`)."""
    if name not in _ACTIVATION_FNS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {name!r}")
    return _ACTIVATION_FNS[name]


def check_sizes(**sizes) -> None:
    """Refuse any ``name=value`` that is not an integer >= 1 (a width, a layer or head
    count): a zero width builds a model that ignores its input, a float is truncated."""
    from betty.checks import is_integer

    for name, value in sizes.items():
        if not (is_integer(value) and value >= 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class BlockGNN(nn.Module):
    """Base class: dropout handling and the layer loop.

    Subclasses create ``self.layers`` (one module per block) and implement
    :meth:`conv` (one layer's graph convolution, without input dropout); ``activation``
    names the non-linearity (one of :data:`ACTIVATIONS`, stored as ``activation_name``).
    """

    def __init__(self, num_layers: int, dropout: float, dropout_mode: str,
                 backend: str = "auto", activation: str = "relu") -> None:
        super().__init__()
        from betty.backends import resolve_backend

        self.backend_name = resolve_backend(backend)
        check_sizes(num_layers=num_layers)
        check_dropout(dropout)
        if dropout_mode not in DROPOUT_MODES:
            raise ValueError(f"dropout_mode must be one of {DROPOUT_MODES}, got {dropout_mode!r}")
        self._activation = activation_fn(activation)
        self.activation_name = activation
        self.num_layers = num_layers
        self.dropout = float(dropout)
        self.dropout_mode = dropout_mode

    @property
    def backend(self):
        """The :class:`betty.backends.Backend` this model's blocks and layers belong to."""
        from betty.backends import get_backend

        return get_backend(self.backend_name)

    def make_blocks(self, layers, device="cpu", *, copy: bool = False) -> list:
        """This backend's blocks for ``layers`` (:class:`betty.batch.LayerEdges`), with
        the sources' degrees where the model reads them (:attr:`needs_degrees`)."""
        return self.backend.make_blocks(layers, device, copy=copy, degrees=self.needs_degrees)

    @property
    def needs_degrees(self) -> bool:
        """Whether the blocks must carry the sources' whole-graph out-degrees
        (:attr:`betty.batch.LayerEdges.src_out_degree`): the symmetric GCN's."""
        return False

    @property
    def needs_node_ids(self) -> bool:
        """Whether training forward passes need ``src_nids`` (deterministic dropout)."""
        return self.dropout > 0 and self.dropout_mode == "deterministic"

    @property
    def needs_edge_ids(self) -> bool:
        """Whether training forward passes need ``edge_ids`` (per-edge dropout)."""
        return False

    # -- to implement -------------------------------------------------------------
    def conv(self, layer: int, block, h: torch.Tensor, *, edge_id: torch.Tensor | None,
             dropout_key: int | None) -> torch.Tensor:
        """Layer ``layer``'s convolution: ``(n_src, d_in)`` -> ``(n_dst, d_out)``."""
        raise NotImplementedError

    def activation(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Non-linearity after every layer but the last (``activation_name``)."""
        return self._activation(h)

    # -- shared ---------------------------------------------------------------------
    def drop(self, h: torch.Tensor, layer: int, ids: torch.Tensor | None,
             dropout_key: int | None, p: float | None = None, salt: int = 0) -> torch.Tensor:
        """Dropout on ``h`` (rows keyed by ``ids``) according to the dropout mode."""
        p = self.dropout if p is None else p
        if not self.training or p == 0.0:
            return h
        if self.dropout_mode == "standard":
            return F.dropout(h, p, training=True)
        if ids is None or dropout_key is None:
            raise ValueError(
                "deterministic dropout needs the global IDs of each layer's source nodes "
                "(src_nids) and a dropout_key; pass them or set dropout_mode='standard'"
            )
        return hash_dropout(h, ids, p, dropout_key, 2 * layer + salt)

    def forward_layer(self, layer: int, block, h: torch.Tensor, *,
                      src_nid: torch.Tensor | None = None,
                      edge_id: torch.Tensor | None = None,
                      dropout_key: int | None = None) -> torch.Tensor:
        """Dropout -> convolution -> activation (none after the last layer)."""
        h = self.drop(h, layer, src_nid, dropout_key)
        h = self.conv(layer, block, h, edge_id=edge_id, dropout_key=dropout_key)
        if layer != self.num_layers - 1:
            h = self.activation(layer, h)
        return h

    def forward(self, blocks: Sequence, x: torch.Tensor, *,
                src_nids: Sequence[torch.Tensor] | None = None,
                edge_ids: Sequence[torch.Tensor] | None = None,
                dropout_key: int | None = None) -> torch.Tensor:
        """Run all layers.

        Args:
            blocks: L blocks of this model's backend (:meth:`make_blocks`), ``blocks[0]``
                reads ``x``.
            x: ``(n_src of blocks[0], in_feats)`` input features.
            src_nids: per layer, ``(n_src,)`` global IDs of the block's source nodes
                (needed for deterministic dropout).
            edge_ids: per layer, ``(E,)`` global edge IDs (deterministic attention
                dropout in GAT).
            dropout_key: the training step's key, e.g. ``dropout_key(seed, epoch)``.

        Returns:
            ``(n_dst of blocks[-1], out_feats)`` logits.
        """
        if len(blocks) != self.num_layers:
            raise ValueError(f"model has {self.num_layers} layers but got {len(blocks)} blocks")
        h = x
        for l, block in enumerate(blocks):
            h = self.forward_layer(
                l, block, h,
                src_nid=None if src_nids is None else src_nids[l],
                edge_id=None if edge_ids is None else edge_ids[l],
                dropout_key=dropout_key,
            )
        return h
