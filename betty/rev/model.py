"""Reversible deep GNNs (RevGNN: Li, Müller, Ghanem, Koltun, "Training Graph Neural
Networks with 1000 Layers", ICML 2021), on whole graphs of either backend
(:mod:`betty.backends`: a ``dgl.DGLGraph`` or a ``PygGraph``; the convolutions have DGL's
math and parameter names on both, so one state_dict loads in either).

Layers, thinnest first:

* :class:`~betty.rev.coupling.ReversibleCoupling` - the grouped coupling math
  ``X'_i = f_i(X'_{i-1}) + X_i`` and its inverse;
* :func:`~betty.rev.autograd.apply_reversible` - the autograd Function that keeps
  no activations (forward under ``no_grad``, input storage freed, backward reconstructs);
* :class:`ReversibleBlock` - a module wrapping one coupling, switchable to a plain
  residual block (``disable``) with optional gradient checkpointing;
* :class:`GroupedReversibleStack` - ``L`` blocks (or one block applied ``L`` times when
  weight-tied);
* :class:`EncodeProcessDecode` - encoder ``Linear`` -> body -> ``Norm`` -> ``ReLU`` ->
  dropout -> decoder ``Linear``, with the dropout masks of one forward pass;
* :class:`RevGNN` - that frame with the stack as body (:class:`betty.rev.deq.RevGNNDEQ`:
  with a fixed-point solve of one cell).

Every block maps ``(N, D) -> (N, D)`` on the same node set: reversible networks cannot run
on shrinking sampled blocks. Train them on the full graph or on K induced subgraphs per
step (:mod:`betty.rev.training`).

Dropout: one multiplier mask per forward pass, shared by all blocks (as in RevGNN), or a
deterministic ``mask_fn(shape, node_ids, layer)`` evaluated again in the backward pass.
Never put ``nn.Dropout`` inside the blocks (refused).

Memory per training step, N nodes, D channels, L blocks (activations only): residual
O(L N D) (measured: ~4.5 (N, D) tensors per block with GCN); residual + checkpointing
O(L N D) with a smaller constant (each block's input, one (N, D) tensor per block) plus one
block's internals; reversible O(N D), independent of L. Parameters are O(L D^2 / C) in
all three (O(D^2 / C) weight-tied). See ``benchmarks/depth.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from betty.models.base import check_sizes
from betty.models.dropout import check_dropout
from betty.rev.autograd import MaskSource, apply_reversible
from betty.rev.coupling import (
    CONV_TYPES,
    NORM_TYPES,
    GroupFunction,
    ReversibleCoupling,
    make_norm,
    refuse_stochastic_modules,
    reset_modules,
)

__all__ = [
    "EncodeProcessDecode",
    "GroupedReversibleStack",
    "MaskFn",
    "RevArchitecture",
    "RevGNN",
    "ReversibleBlock",
    "as_mask_source",
    "make_coupling",
    "resolve_mask_source",
    "sample_dropout_mask",
]

MaskFn = Callable[[tuple[int, int], Tensor, int], Tensor]
"""``mask_fn((N, D), node_ids (N,), layer) -> (N, D)`` keep-mask (bool: scaled by
``1 / (1 - p)``) or multipliers (float). Must be deterministic: it is called again for
the same ``layer`` during the backward pass (twice per block), so a hash of
(seed, step, layer, global node ID) fits, e.g. with :mod:`betty.models.dropout`:
``lambda shape, ids, layer: hash_keep_mask(ids, shape[1], p, key, layer)`` (ignore
``layer`` to share one mask across blocks as RevGNN does). Blocks are layers
``0 .. L-1``; the dropout before the decoder is layer ``L``. Node IDs come from
``forward(node_ids=...)``, else the IDs the backend's ``node_subgraph`` recorded
(``graph.ndata[dgl.NID]`` / ``PygGraph.node_ids``), else ``arange(N)``."""


def make_coupling(
    hidden: int,
    num_groups: int = 2,
    conv: str = "gcn",
    norm: str = "layer",
    heads: int = 1,
    gat_merge: str = "mean",
    backend: str = "auto",
) -> ReversibleCoupling:
    """A coupling of ``num_groups`` :class:`GroupFunction` of width ``hidden // num_groups``
    with ``backend``'s convolutions."""
    if num_groups < 2:
        raise ValueError(f"num_groups must be >= 2, got {num_groups}")
    if hidden % num_groups:
        raise ValueError(
            f"hidden must be divisible by num_groups: hidden={hidden}, num_groups={num_groups}"
        )
    width = hidden // num_groups
    return ReversibleCoupling(
        [GroupFunction(width, conv, norm, heads, gat_merge, backend) for _ in range(num_groups)]
    )


def sample_dropout_mask(
    shape: tuple[int, int],
    p: float,
    *,
    device: torch.device,
    dtype: torch.dtype,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """Bernoulli dropout multipliers ``(N, D)``: 0 with probability ``p``, else ``1/(1-p)``."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    keep = torch.rand(shape, device=device, generator=generator) >= p
    return keep.to(dtype) * (1.0 / (1.0 - p))


def _as_multiplier(mask: Tensor, p: float, dtype: torch.dtype) -> Tensor:
    if mask.dtype == torch.bool:
        return mask.to(dtype) * (1.0 / (1.0 - p))
    return mask.to(dtype)


def as_mask_source(masks: Union[MaskSource, Tensor, None]) -> MaskSource:
    """A ``layer -> mask`` function from a shared mask tensor, a function, or ``None``."""
    if masks is None:
        return lambda layer: None
    if isinstance(masks, Tensor):
        return lambda layer: masks
    if callable(masks):
        return masks
    raise TypeError(f"masks must be a Tensor, a callable layer -> Tensor, or None; got {type(masks)}")


def resolve_mask_source(
    *,
    training: bool,
    p: float,
    shape: tuple[int, int],
    device: torch.device,
    dtype: torch.dtype,
    dropout_mask: Optional[Tensor] = None,
    mask_fn: Optional[MaskFn] = None,
    node_ids: Optional[Tensor] = None,
    num_layers: int,
) -> MaskSource:
    """The ``layer -> multiplier`` function of one forward pass.

    Eval mode: no dropout. Training: ``dropout_mask`` (shared by every layer, the
    decoder's dropout included) if given; else ``mask_fn(shape, node_ids, layer)``; else,
    if ``p > 0``, one Bernoulli mask shared by the blocks (layers ``< L``) and an
    independent one for the decoder dropout, layer ``num_layers`` (RevGNN's recipe).
    """
    if not training:
        return lambda layer: None
    if dropout_mask is not None:
        mask = _as_multiplier(dropout_mask.to(device), p, dtype)
        return lambda layer: mask
    if mask_fn is not None:
        if node_ids is None:
            raise ValueError("mask_fn needs node_ids (the global IDs of the graph's nodes)")
        return lambda layer: _as_multiplier(mask_fn(shape, node_ids, layer), p, dtype)
    if p == 0.0:
        return lambda layer: None
    shared = sample_dropout_mask(shape, p, device=device, dtype=dtype)
    head = sample_dropout_mask(shape, p, device=device, dtype=dtype)
    return lambda layer: head if layer >= num_layers else shared


def graph_node_ids(graph) -> Optional[Tensor]:
    """The ``(N,)`` global IDs the backend's ``node_subgraph`` recorded on ``graph``, or ``None``."""
    from betty.backends import backend_of_graph

    return backend_of_graph(graph).graph_node_ids(graph)


def check_graph_backend(graph, backend_name: str) -> None:
    """Raise ``ValueError`` unless ``graph`` is a graph object of backend ``backend_name``."""
    from betty.backends import backend_of_graph

    got = backend_of_graph(graph).name
    if got != backend_name:
        raise ValueError(
            f"the model was built for backend {backend_name!r} but got a {got} graph "
            f"({type(graph).__name__}); build its graphs with "
            f"betty.backends.get_backend({backend_name!r}).full_graph(...)"
        )


def _run_coupling(
    coupling: ReversibleCoupling, graph, x: Tensor, masks: MaskSource, layer: int
) -> Tensor:
    return coupling(graph, x, masks(layer))


def _check_same_node_set(graph, x: Tensor) -> None:
    from betty.backends import backend_of_graph

    ops = backend_of_graph(graph)
    if ops.is_block(graph):
        label = {"dgl": "DGL", "pyg": "PyG"}[ops.name]
        raise ValueError(
            f"graph is a {label} block (sampled bipartite layer): reversible blocks need the same "
            "node set at input and output; pass a whole graph or an induced subgraph "
            "(betty.rev.training.cluster_partition)"
        )
    if x.shape[0] != graph.num_nodes():
        raise ValueError(
            f"x has {x.shape[0]} rows but the graph has {graph.num_nodes()} nodes"
        )


class ReversibleBlock(nn.Module):
    """One coupling ``X' = F(X)`` run reversibly, or as a plain residual block.

    Args:
        coupling: the grouped coupling (deterministic given graph, input and mask).
        disable: run ``F`` with ordinary autograd (keeps all intermediates): the residual
            network ResGNN with the same weights.
        checkpoint: with ``disable``, recompute ``F``'s internals in backward
            (``torch.utils.checkpoint``, non-reentrant); keeps only the block input.
        check_consistency: in the reversible backward pass, verify that ``F`` applied to
            the reconstructed input reproduces the stored output (catches stochastic
            ``f``); raises ``RuntimeError`` on mismatch.
        consistency_tol: relative tolerance of that check (default by dtype).
    """

    def __init__(
        self,
        coupling: ReversibleCoupling,
        *,
        disable: bool = False,
        checkpoint: bool = False,
        check_consistency: bool = True,
        consistency_tol: Optional[float] = None,
    ) -> None:
        super().__init__()
        self.coupling = coupling
        self.disable = disable
        self.checkpoint = checkpoint
        self.check_consistency = check_consistency
        self.consistency_tol = consistency_tol

    def reset_parameters(self) -> None:
        self.coupling.reset_parameters()

    def forward(
        self,
        graph,
        x: Tensor,
        masks: Union[MaskSource, Tensor, None] = None,
        layer: int = 0,
    ) -> Tensor:
        """``(N, D) -> (N, D)``; ``masks`` is a mask ``(N, D)``/``(N, D/C)`` or ``layer -> mask``."""
        _check_same_node_set(graph, x)
        source = as_mask_source(masks)
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or any(p.requires_grad for p in self.coupling.parameters())
        )
        if self.disable or not needs_grad:
            if self.disable and self.checkpoint and needs_grad:
                return torch_checkpoint(
                    _run_coupling, self.coupling, graph, x, source, layer, use_reentrant=False
                )
            return _run_coupling(self.coupling, graph, x, source, layer)
        if self.training:
            refuse_stochastic_modules(self.coupling)
        return apply_reversible(
            self.coupling,
            graph,
            x,
            source,
            layer,
            check_consistency=self.check_consistency,
            consistency_tol=self.consistency_tol,
        )

    def inverse(
        self, graph, y: Tensor, masks: Union[MaskSource, Tensor, None] = None, layer: int = 0
    ) -> Tensor:
        """``X = F^{-1}(X')`` (no autograd)."""
        with torch.no_grad():
            return self.coupling.inverse(graph, y, as_mask_source(masks)(layer))


class GroupedReversibleStack(nn.Module):
    """``L`` reversible blocks applied in sequence on one graph: ``(N, D) -> (N, D)``.

    Args:
        couplings: ``L`` couplings, or one coupling with ``num_layers=L`` (weight-tied:
            the same weights at every depth).
        num_layers: depth when weight-tied; must be omitted or equal ``len(couplings)``
            otherwise.
        reversible: ``False`` gives the residual network with the same weights.
        checkpoint: gradient checkpointing per block (residual network only).
        check_consistency, consistency_tol: see :class:`ReversibleBlock`.
    """

    def __init__(
        self,
        couplings: Sequence[ReversibleCoupling],
        *,
        num_layers: Optional[int] = None,
        reversible: bool = True,
        checkpoint: bool = False,
        check_consistency: bool = True,
        consistency_tol: Optional[float] = None,
    ) -> None:
        super().__init__()
        if len(couplings) == 0:
            raise ValueError("couplings must not be empty")
        if num_layers is None:
            num_layers = len(couplings)
        if len(couplings) not in (1, num_layers):
            raise ValueError(
                f"num_layers={num_layers} needs {num_layers} couplings or 1 (weight-tied), "
                f"got {len(couplings)}"
            )
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.num_layers = num_layers
        self.blocks = nn.ModuleList(
            ReversibleBlock(c, check_consistency=check_consistency, consistency_tol=consistency_tol)
            for c in couplings
        )
        self.set_mode(reversible=reversible, checkpoint=checkpoint)

    @property
    def weight_tied(self) -> bool:
        return len(self.blocks) == 1 and self.num_layers > 1

    @property
    def reversible(self) -> bool:
        return not self.blocks[0].disable

    @reversible.setter
    def reversible(self, value: bool) -> None:
        self.set_mode(reversible=value, checkpoint=self.checkpoint if not value else False)

    @property
    def checkpoint(self) -> bool:
        return self.blocks[0].checkpoint

    @checkpoint.setter
    def checkpoint(self, value: bool) -> None:
        self.set_mode(reversible=self.reversible, checkpoint=value)

    def set_mode(self, *, reversible: bool, checkpoint: bool = False) -> None:
        """Switch between reversible, residual and residual + checkpointing (same weights)."""
        if reversible and checkpoint:
            raise ValueError(
                "checkpoint=True applies to the residual network (reversible=False); "
                "reversible blocks already keep no activations"
            )
        for block in self.blocks:
            block.disable = not reversible
            block.checkpoint = checkpoint

    def block(self, layer: int) -> ReversibleBlock:
        return self.blocks[0] if len(self.blocks) == 1 else self.blocks[layer]

    def reset_parameters(self) -> None:
        for block in self.blocks:
            block.reset_parameters()

    def forward(
        self, graph, x: Tensor, masks: Union[MaskSource, Tensor, None] = None
    ) -> Tensor:
        """Apply the ``L`` blocks. In reversible training mode ``x``'s storage is freed
        until the backward pass (so it must be e.g. an encoder output, not a leaf)."""
        source = as_mask_source(masks)
        for layer in range(self.num_layers):
            x = self.block(layer)(graph, x, source, layer)
        return x

    def inverse(
        self, graph, y: Tensor, masks: Union[MaskSource, Tensor, None] = None
    ) -> Tensor:
        """Reconstruct the stack's input from its output (no autograd), block ``L-1`` to ``0``."""
        source = as_mask_source(masks)
        for layer in range(self.num_layers - 1, -1, -1):
            y = self.block(layer).inverse(graph, y, source, layer)
        return y


class EncodeProcessDecode(nn.Module, ABC):
    """``Linear -> body -> Norm -> ReLU -> Dropout -> Linear`` on one node set: the frame
    :class:`RevGNN` (body: reversible stack) and :class:`betty.rev.deq.RevGNNDEQ` (body:
    equilibrium of one cell) share.

    ``H_0 = X W_enc + b_enc`` ``(N, hidden)``; ``H = body(G, H_0, masks)`` ``(N, hidden)``;
    output ``(M * ReLU(Norm(H))) W_dec + b_dec`` ``(N, out_feats)`` with the dropout
    multiplier ``M = masks(head_layer)`` (``None``: no dropout) of the ``layer -> mask``
    function :func:`resolve_mask_source` builds once per forward pass.

    Subclasses pass ``make_body(backend_name) -> nn.Module``, registered as ``body_name``;
    it is built between the encoder and the decoder, so parameters (and their
    initialisation draws) come in the order encoder, body, norm, decoder. They define
    :attr:`head_layer` and :meth:`run_body`.
    """

    def __init__(
        self,
        in_feats: int,
        hidden: int,
        out_feats: int,
        *,
        conv: str,
        norm: str,
        heads: int,
        gat_merge: str,
        dropout: float,
        mask_fn: Optional[MaskFn],
        backend: str,
        body_name: str,
        make_body: Callable[[str], nn.Module],
    ) -> None:
        super().__init__()
        from betty.backends import resolve_backend

        self.backend_name = resolve_backend(backend)
        if conv not in CONV_TYPES:
            raise ValueError(f"conv must be one of {CONV_TYPES}, got {conv!r}")
        check_sizes(in_feats=in_feats, hidden=hidden, out_feats=out_feats, heads=heads)
        check_dropout(dropout)
        self.in_feats, self.hidden, self.out_feats = in_feats, hidden, out_feats
        self.conv_type, self.norm_type, self.heads, self.gat_merge = conv, norm, heads, gat_merge
        self.dropout, self.mask_fn = dropout, mask_fn
        self._body_name = body_name
        self.encoder = nn.Linear(in_feats, hidden)
        setattr(self, body_name, make_body(self.backend_name))
        self.norm = make_norm(norm, hidden)
        self.decoder = nn.Linear(hidden, out_feats)

    @property
    def body(self) -> nn.Module:
        """The module between encoder and norm (``stack`` / ``cell``)."""
        return getattr(self, self._body_name)

    @property
    @abstractmethod
    def head_layer(self) -> int:
        """The ``layer`` of the decoder dropout in ``masks(layer)``."""

    @abstractmethod
    def run_body(self, graph, h: Tensor, masks: MaskSource) -> Tensor:
        """``(N, hidden) -> (N, hidden)``: the body on the encoder output."""

    def head_mask(self, mask: Tensor) -> Tensor:
        """The decoder dropout multiplier from ``masks(head_layer)`` (default: as is)."""
        return mask

    def reset_parameters(self) -> None:
        reset_modules(self.encoder, self.body, self.norm, self.decoder)

    def architecture_fields(self) -> dict:
        """The architecture fields both models report (their ``architecture()`` adds more)."""
        return dict(
            in_feats=self.in_feats,
            hidden=self.hidden,
            out_feats=self.out_feats,
            conv=self.conv_type,
            heads=self.heads,
            gat_merge=self.gat_merge,
            norm=self.norm_type,
            num_parameters=sum(p.numel() for p in self.parameters()),
            dtype=self.encoder.weight.dtype,
        )

    def forward(
        self,
        graph,
        x: Tensor,
        dropout_mask: Optional[Tensor] = None,
        node_ids: Optional[Tensor] = None,
        mask_fn: Optional[MaskFn] = None,
    ) -> Tensor:
        """Node outputs ``(N, out_feats)`` for input features ``x`` ``(N, in_feats)``.

        Args:
            graph: the (sub)graph of the model's backend, ``N`` nodes; the same node set
                flows through the body.
            x: input features ``(N, in_feats)``.
            dropout_mask: ``(N, hidden)`` multipliers (or bool keep-mask), shared by the
                body and the decoder dropout; training only.
            node_ids: ``(N,)`` global node IDs passed to ``mask_fn`` (default: the
                IDs recorded by the backend's ``node_subgraph`` or ``arange(N)``).
            mask_fn: overrides the model's ``mask_fn`` for this call.
        """
        check_graph_backend(graph, self.backend_name)
        if x.dim() != 2 or x.shape[1] != self.in_feats or x.shape[0] != graph.num_nodes():
            raise ValueError(
                f"x must be (num_nodes={graph.num_nodes()}, in_feats={self.in_feats}), "
                f"got {tuple(x.shape)}"
            )
        fn = mask_fn if mask_fn is not None else self.mask_fn
        if fn is not None and node_ids is None:
            node_ids = graph_node_ids(graph)
            if node_ids is None:
                node_ids = torch.arange(graph.num_nodes(), device=x.device)
        masks = resolve_mask_source(
            training=self.training,
            p=self.dropout,
            shape=(x.shape[0], self.hidden),
            device=x.device,
            dtype=self.encoder.weight.dtype,
            dropout_mask=dropout_mask,
            mask_fn=fn,
            node_ids=node_ids,
            num_layers=self.head_layer,
        )
        h = torch.relu(self.norm(self.run_body(graph, self.encoder(x), masks)))
        mask = masks(self.head_layer)
        if mask is not None:
            h = h * self.head_mask(mask)
        return self.decoder(h)


@dataclass(frozen=True)
class RevArchitecture:
    """What a memory estimator needs to know about a :class:`RevGNN`."""

    in_feats: int
    hidden: int
    out_feats: int
    num_layers: int  # blocks applied (depth)
    num_groups: int  # C
    group_width: int  # w = hidden / C
    conv: str
    heads: int
    gat_merge: str
    norm: str
    reversible: bool
    checkpoint: bool
    weight_tied: bool
    num_distinct_blocks: int  # 1 if weight-tied, else num_layers
    num_parameters: int
    dtype: torch.dtype
    graph_backend: str = "dgl"  # whose convolutions run (betty.backends): "dgl" | "pyg"


def _stack_switch(name: str, doc: str) -> property:
    """A read/write ``bool`` property forwarding ``name`` to ``self.stack``
    (:class:`GroupedReversibleStack`)."""
    return property(
        lambda self: getattr(self.stack, name),
        lambda self, value: setattr(self.stack, name, value),
        doc=doc,
    )


class RevGNN(EncodeProcessDecode):
    """RevGNN: ``Linear -> L grouped reversible blocks -> Norm -> ReLU -> Dropout -> Linear``.

    ``H_0 = X W_enc + b_enc`` ``(N, hidden)``; ``H_l = F_l(H_{l-1})`` for ``l = 1..L``
    (grouped couplings with ``C = num_groups`` groups of width ``hidden / C``, each group
    ``f = Conv(G, M * ReLU(Norm(.)))``); output ``Dropout(ReLU(Norm(H_L))) W_dec + b_dec``
    ``(N, out_feats)``. This is the architecture of the paper's ogbn-proteins models
    (there with GEN convolutions and edge features): RevGNN-Deep 1001 blocks x 80
    channels, dropout 0.1; RevGNN-Wide 448 x 224, dropout 0.2; both C = 2, LayerNorm.
    ``forward(graph, x, dropout_mask=None, node_ids=None, mask_fn=None)``: see
    :meth:`EncodeProcessDecode.forward`; blocks are mask layers ``0 .. L-1``, the decoder
    dropout layer ``L``; a ``dropout_mask`` may also be ``(N, hidden / C)`` (one mask per
    group, repeated for the decoder dropout).

    Args:
        in_feats, hidden, out_feats: feature sizes; ``num_groups`` must divide ``hidden``.
        num_layers: number of blocks ``L``.
        num_groups: ``C >= 2``.
        conv: ``"gcn"`` | ``"sage"`` | ``"gat"``.
        dropout: probability ``p`` for the shared block mask and the decoder dropout.
        norm: ``"layer"`` (default) | ``"batch"`` (warns: statistics updated 3x per
            step) | ``"none"``.
        reversible: ``False`` runs the same weights as a residual network (ResGNN).
        checkpoint: gradient checkpointing per block (residual network only).
        weight_tied: one block's weights shared across all ``L`` applications.
        heads, gat_merge: GAT heads, averaged (``"mean"``) or concatenated (``"concat"``).
        backend: ``"auto"``, ``"dgl"`` or ``"pyg"`` (:mod:`betty.backends`): which graph
            objects ``forward`` takes; parameter names and math are the same on both.
        mask_fn: default deterministic mask generator (see :data:`MaskFn`).
        check_consistency: reversible backward verifies each block is deterministic.
    """

    def __init__(
        self,
        in_feats: int,
        hidden: int,
        out_feats: int,
        num_layers: int,
        num_groups: int = 2,
        conv: str = "gcn",
        dropout: float = 0.0,
        norm: str = "layer",
        reversible: bool = True,
        checkpoint: bool = False,
        weight_tied: bool = False,
        heads: int = 1,
        gat_merge: str = "mean",
        mask_fn: Optional[MaskFn] = None,
        check_consistency: bool = True,
        backend: str = "auto",
    ) -> None:
        if norm not in NORM_TYPES:
            raise ValueError(f"norm must be one of {NORM_TYPES}, got {norm!r}")
        check_sizes(num_layers=num_layers, num_groups=num_groups)

        def make_stack(backend_name: str) -> GroupedReversibleStack:
            return GroupedReversibleStack(
                [make_coupling(hidden, num_groups, conv, norm, heads, gat_merge, backend_name)
                 for _ in range(1 if weight_tied else num_layers)],
                num_layers=num_layers,
                reversible=reversible,
                checkpoint=checkpoint,
                check_consistency=check_consistency,
            )

        super().__init__(
            in_feats, hidden, out_feats, conv=conv, norm=norm, heads=heads, gat_merge=gat_merge,
            dropout=dropout, mask_fn=mask_fn, backend=backend, body_name="stack",
            make_body=make_stack,
        )
        self.num_groups = num_groups

    @property
    def num_layers(self) -> int:
        return self.stack.num_layers

    @property
    def head_layer(self) -> int:
        return self.num_layers

    reversible = _stack_switch("reversible", "``False``: the residual network (same weights).")
    checkpoint = _stack_switch("checkpoint", "Gradient checkpointing per block (residual only).")

    def set_mode(self, *, reversible: bool, checkpoint: bool = False) -> None:
        """Reversible, residual, or residual + checkpointing, with the same weights."""
        self.stack.set_mode(reversible=reversible, checkpoint=checkpoint)

    def architecture(self) -> RevArchitecture:
        """Shapes and switches a memory estimator needs."""
        return RevArchitecture(
            **self.architecture_fields(),
            num_layers=self.num_layers,
            num_groups=self.num_groups,
            group_width=self.hidden // self.num_groups,
            reversible=self.reversible,
            checkpoint=self.checkpoint,
            weight_tied=self.stack.weight_tied,
            num_distinct_blocks=len(self.stack.blocks),
            graph_backend=self.backend_name,
        )

    def run_body(self, graph, h: Tensor, masks: MaskSource) -> Tensor:
        return self.stack(graph, h, masks)

    def head_mask(self, mask: Tensor) -> Tensor:
        """A per-group ``(N, hidden / C)`` mask is repeated over the ``C`` groups."""
        width = self.hidden // self.num_groups
        if mask.dim() == 2 and mask.shape[1] == width != self.hidden:
            return mask.repeat(1, self.num_groups)
        return mask
