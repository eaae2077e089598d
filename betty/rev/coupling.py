"""Grouped additive coupling for reversible GNNs (RevGNN, Li et al., ICML 2021).

Split the ``D = C * w`` channels of ``X`` ``(N, D)`` into ``C`` groups ``X_1 .. X_C`` of
width ``w`` each. One coupling computes

    X'_0 = sum_{i >= 2} X_i
    X'_i = f_i(X'_{i-1}, G) + X_i            for i = 1 .. C

and its exact inverse, from ``i = C`` down to ``1``:

    X_i = X'_i - f_i(X'_{i-1}, G)            (X'_0 = sum_{i >= 2} X_i, known once X_2..X_C are)

Each ``f_i`` is the pre-activation GNN function of DeeperGCN / RevGNN,

    f_i(H, G) = Conv_i(G, M_i * ReLU(Norm_i(H)))        H, M_i: (N, w) -> (N, w)

with ``M_i`` an explicit dropout multiplier (0 or 1 / (1 - p)) passed in by the caller.
``f_i`` must be a deterministic function of its arguments: the reversible backward pass
runs it two more times (reconstruction, recomputation) and needs the same result.
Modules that draw random numbers themselves (``nn.Dropout`` with ``p > 0``) are refused.
"""

from __future__ import annotations

import warnings
from typing import Literal, Optional, Sequence

import torch
from torch import Tensor, nn

__all__ = [
    "CONV_TYPES",
    "NORM_TYPES",
    "ConvLayer",
    "GroupFunction",
    "ReversibleCoupling",
    "find_stochastic_modules",
    "pre_activation_conv",
    "refuse_stochastic_modules",
    "reset_modules",
    "split_group_masks",
]

ConvType = Literal["gcn", "sage", "gat"]
NormType = Literal["layer", "batch", "none"]
CONV_TYPES: tuple[str, ...] = ("gcn", "sage", "gat")
NORM_TYPES: tuple[str, ...] = ("layer", "batch", "none")

BATCHNORM_WARNING = (
    "norm='batch' in a reversible block: BatchNorm's running statistics are updated three "
    "times per training step (forward, input reconstruction, recomputation with gradients), "
    "so they follow a different moving average than in a plain network; gradients and the "
    "reconstruction stay exact because training-mode BatchNorm uses batch statistics. "
    "Prefer norm='layer' (the RevGNN default)."
)


def make_norm(norm: str, width: int) -> nn.Module:
    """Normalisation over the ``width`` channels of one group (``(N, w) -> (N, w)``)."""
    if norm == "layer":
        return nn.LayerNorm(width)
    if norm == "batch":
        warnings.warn(BATCHNORM_WARNING, RuntimeWarning, stacklevel=3)
        return nn.BatchNorm1d(width)
    if norm == "none":
        return nn.Identity()
    raise ValueError(f"norm must be one of {NORM_TYPES}, got {norm!r}")


def reset_modules(*modules: nn.Module) -> None:
    """``reset_parameters()`` of each module that has one (``nn.Identity`` has none), in order."""
    for module in modules:
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def make_conv(
    conv: str, width: int, heads: int = 1, gat_merge: str = "mean", backend: str = "auto"
) -> nn.Module:
    """A whole-graph convolution of ``backend`` (:mod:`betty.backends`) mapping
    ``(N, width)`` to ``(N, width)`` (GAT: per head), with DGL's math and parameter names
    on both backends.

    ``gcn``: ``GraphConv(norm='both')``; ``sage``: ``SAGEConv('mean')``; ``gat``:
    ``GATConv`` with ``heads`` heads of width ``width`` (``gat_merge='mean'``, heads
    averaged) or ``width // heads`` (``gat_merge='concat'``). Zero in-degree nodes are
    allowed (they occur in K-partition subgraphs); they aggregate nothing.
    """
    if conv not in CONV_TYPES:
        raise ValueError(f"conv must be one of {CONV_TYPES}, got {conv!r}")
    if conv == "gat":
        if heads < 1:
            raise ValueError(f"heads must be >= 1, got {heads}")
        if gat_merge not in ("mean", "concat"):
            raise ValueError(f"gat_merge must be 'mean' or 'concat', got {gat_merge!r}")
        if gat_merge == "concat" and width % heads:
            raise ValueError(
                f"gat_merge='concat' needs heads to divide the group width: "
                f"width={width}, heads={heads}"
            )
    from betty.backends import get_backend

    ops = get_backend(backend)
    if conv == "gcn":
        return ops.graph_conv(width, width)
    if conv == "sage":
        return ops.sage_conv(width, width, "mean")
    return ops.gat_conv(width, width if gat_merge == "mean" else width // heads, heads)


class ConvLayer(nn.Module):
    """A whole-graph convolution ``(N, width) -> (N, width)`` (see :func:`make_conv`); GAT
    heads are averaged (``gat_merge='mean'``) or concatenated (``'concat'``) back to ``width``."""

    def __init__(self, width: int, conv: ConvType = "gcn", heads: int = 1, gat_merge: str = "mean",
                 backend: str = "auto") -> None:
        super().__init__()
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.width, self.conv_type, self.gat_merge = width, conv, gat_merge
        self.conv = make_conv(conv, width, heads, gat_merge, backend)

    def reset_parameters(self) -> None:
        self.conv.reset_parameters()

    def forward(self, graph, h: Tensor) -> Tensor:
        out = self.conv(graph, h)
        if self.conv_type == "gat":  # (N, heads, out) -> (N, width)
            out = out.mean(dim=1) if self.gat_merge == "mean" else out.flatten(1)
        return out


def pre_activation_conv(
    conv: nn.Module, norm: nn.Module, graph, h: Tensor, mask: Optional[Tensor] = None
) -> Tensor:
    """``Conv(G, M * ReLU(Norm(H)))``: ``H`` ``(N, w)`` -> ``(N, w)``; ``M`` a dropout
    multiplier broadcastable to ``(N, w)``, or ``None`` (no dropout)."""
    h = torch.relu(norm(h))
    if mask is not None:
        h = h * mask
    return conv(graph, h)


class GroupFunction(nn.Module):
    """``f(H, G) = Conv(G, M * ReLU(Norm(H)))`` on one channel group.

    Shapes: ``H`` ``(N, w)``, mask ``M`` ``(N, w)`` (or broadcastable, or ``None`` for no
    dropout), output ``(N, w)``. ``G`` is a whole graph of ``backend`` (a
    ``dgl.DGLGraph`` or a ``PygGraph``) with ``N`` nodes whose edges go from source to
    destination (messages flow along edges).
    """

    def __init__(
        self,
        width: int,
        conv: ConvType = "gcn",
        norm: NormType = "layer",
        heads: int = 1,
        gat_merge: str = "mean",
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.width = width
        self.norm = make_norm(norm, width)
        self.conv = ConvLayer(width, conv, heads, gat_merge, backend)

    def reset_parameters(self) -> None:
        reset_modules(self.norm, self.conv)

    def forward(self, graph, h: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        return pre_activation_conv(self.conv, self.norm, graph, h, mask)


def find_stochastic_modules(module: nn.Module) -> list[str]:
    """Names of submodules that draw their own random numbers (dropout with ``p > 0``)."""
    return [
        name or type(module).__name__
        for name, sub in module.named_modules()
        if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0
    ]


def refuse_stochastic_modules(module: nn.Module) -> None:
    """Raise ``ValueError`` if ``module`` contains dropout modules with ``p > 0``.

    The reversible backward pass evaluates each ``f_i`` again (reconstruction and
    recomputation); a module that samples a new mask on every call makes those
    evaluations differ from the forward one, so the reconstructed inputs and the
    gradients are wrong (measured: 0.5-0.7 relative gradient error). Pass dropout as an
    explicit mask instead.
    """
    bad = find_stochastic_modules(module)
    if bad:
        raise ValueError(
            f"reversible coupling functions must be deterministic, but {bad} sample their "
            "own dropout masks (nn.Dropout with p > 0); use the explicit dropout mask "
            "(model dropout=..., dropout_mask= or mask_fn=) instead"
        )


def split_group_masks(mask: Optional[Tensor], groups: int, width: int) -> list[Optional[Tensor]]:
    """Per-group dropout multipliers from one mask.

    ``mask`` is ``None`` (no dropout), ``(N, groups * width)`` (group ``i`` uses columns
    ``i*width : (i+1)*width``, as RevGNN chunks its mask) or ``(N, width)`` / anything
    broadcastable to ``(N, width)`` (shared by all groups).
    """
    if mask is None:
        return [None] * groups
    if mask.dim() == 2 and mask.shape[1] == groups * width and groups > 1:
        return list(mask.split(width, dim=1))
    if mask.dim() > 2 or (mask.dim() >= 1 and mask.shape[-1] not in (1, width)):
        raise ValueError(
            f"dropout mask of shape {tuple(mask.shape)} fits neither (N, {groups * width}) "
            f"(one column block per group) nor (N, {width}) (shared by the groups)"
        )
    return [mask] * groups


class ReversibleCoupling(nn.Module):
    """Grouped additive coupling ``X -> X'`` with ``C = len(functions) >= 2`` groups.

    Args:
        functions: ``C`` modules, each called as ``f_i(graph, H, mask) -> (N, w)`` with
            ``H`` ``(N, w)``. They must be deterministic given their arguments.

    Shapes: ``X``, ``X'`` ``(N, C * w)``; masks as in :func:`split_group_masks`.
    """

    def __init__(self, functions: Sequence[nn.Module]) -> None:
        super().__init__()
        if len(functions) < 2:
            raise ValueError(
                f"a grouped coupling needs at least 2 groups, got {len(functions)} functions"
            )
        self.functions = nn.ModuleList(functions)
        refuse_stochastic_modules(self)

    @property
    def num_groups(self) -> int:
        return len(self.functions)

    def group_width(self, x: Tensor) -> int:
        """``w = D / C`` for an input ``(N, D)``; raises if ``C`` does not divide ``D``."""
        if x.dim() != 2 or x.shape[1] % self.num_groups:
            raise ValueError(
                f"coupling input must be (N, C * w) with C={self.num_groups}, "
                f"got shape {tuple(x.shape)}"
            )
        return x.shape[1] // self.num_groups

    def reset_parameters(self) -> None:
        reset_modules(*self.functions)

    def forward(self, graph, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """``X' = coupling(X)``: ``(N, C*w) -> (N, C*w)``."""
        width = self.group_width(x)
        xs = x.split(width, dim=1)
        masks = split_group_masks(mask, self.num_groups, width)
        prev = _sum(xs[1:])  # X'_0
        outs = []
        for f, x_i, m_i in zip(self.functions, xs, masks):
            prev = f(graph, prev, m_i) + x_i  # X'_i
            outs.append(prev)
        return torch.cat(outs, dim=1)

    def inverse(self, graph, y: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """``X = coupling^{-1}(X')``: recovers the input from the output, ``i = C .. 1``."""
        width = self.group_width(y)
        ys = y.split(width, dim=1)
        masks = split_group_masks(mask, self.num_groups, width)
        xs: list[Optional[Tensor]] = [None] * self.num_groups
        for i in range(self.num_groups - 1, -1, -1):
            prev = ys[i - 1] if i > 0 else _sum(xs[1:])
            xs[i] = ys[i] - self.functions[i](graph, prev, masks[i])
        return torch.cat(xs, dim=1)


def _sum(tensors: Sequence[Tensor]) -> Tensor:
    """Left-to-right sum (same order in forward and inverse)."""
    total = tensors[0]
    for t in tensors[1:]:
        total = total + t
    return total
