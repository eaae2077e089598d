"""Analytic training memory of reversible deep GNNs (:class:`betty.rev.model.RevGNN`).

What is estimated is the peak :class:`~betty.memory.meter.MemoryMeter` reads around one
:func:`betty.rev.engine.train_step_parts` step with the model and the
optimizer tracked (optimizer state assumed to exist: the steady state after the first
step; ``first_step=True`` estimates that first step, whose last part's region creates the
state): the maximum over the step of

    parameters + optimizer state + gradients + everything one part allocates
    (+ the optimizer's temporaries during its step),

computed by replaying the step op by op (:mod:`betty.rev.replay`), not by adding
up parts. For ``N`` nodes and ``E`` edges in a part, hidden width ``D`` in ``C``
groups of width ``w = D / C``, depth ``L`` and ``e`` bytes per element, the terms are:

* parameters ``P = O(L D^2 / C)`` (weight-tied: ``O(D^2 / C)``), their gradients
  ``P`` and the optimizer state (Adam ``2 P``): the part that grows with depth in a
  reversible network;
* the part's features ``N F`` and, with dropout, two ``(N, D)`` multiplier masks;
* *reversible*: about one block's worth of ``(N, D)`` activations, independent of
  ``L`` (the current block's input and output, the hand-off between blocks), plus, in
  backward, one block's recomputation with autograd (per group ``O(N w)``: norm
  statistics, ReLU, masked input, conv outputs and degree vectors; GAT adds
  ``O(N H w)`` projections and ``O(E H)`` logits/softmax per group; on the PyG backend
  also the gathered ``O(E w)`` messages, or for GAT ``O(E H w)`` products);
* *residual* (``reversible=False``): what autograd saves per block, times ``L``;
* *residual + checkpointing*: one ``(N, D)`` input per block, times ``L``, plus one
  block's recomputation;
* head (norm, ReLU, dropout, decoder) and loss.

:func:`estimate_rev` estimates one part (or the whole graph); :func:`estimate_rev_parts`
every part of a K-way split (:func:`~betty.rev.training.cluster_partition`), the
largest of which is the step's peak; :func:`search_k_rev` picks the smallest K whose
largest part fits a budget (``k: auto`` for reversible models).

Not modelled: a user ``mask_fn``/``dropout_mask`` (hash masks are drawn per block;
RevGNN's default Bernoulli masks are), memory outside PyTorch tensors (DGL's graph
formats on the host; on CUDA they are device memory: the estimate then misses them),
gradient clipping temporaries. Accuracy on the host: within 0.2% of the meter on the
configurations of ``tests/test_memory_rev.py`` (largest error measured: 0.15%).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional, Union

import numpy as np
import torch

from betty.memory.constants import BackendConstants, load_constants
from betty.memory.ops import itemsize
from betty.memory.estimator import MemoryEstimate
from betty.memory.ksearch import DEFAULT_SAFETY_MARGIN, KSearchError
from betty.backends import BACKENDS
from betty.rev.coupling import CONV_TYPES, NORM_TYPES
from betty.rev.replay import RevReplayConfig, replay_rev, rev_parameter_shapes
from betty.memory.spec import OptimizerSpec, as_optimizer_spec
from betty.models.dropout import check_dropout

__all__ = [
    "RevKSearchError",
    "RevKSearchResult",
    "RevModelShape",
    "estimate_rev",
    "estimate_rev_parts",
    "estimate_rev_sizes",
    "rev_persistent_bytes",
    "rev_replay_config",
    "search_k_rev",
]

_CONVS, _NORMS, _GRAPH_BACKENDS = CONV_TYPES, NORM_TYPES, BACKENDS


@dataclass(frozen=True)
class RevModelShape:
    """What the estimator needs to know about a RevGNN (see :meth:`of`).

    Attributes mirror :class:`~betty.rev.model.RevArchitecture`, plus ``dropout`` (the
    probability of RevGNN's Bernoulli masks; 0: no masks) and ``check_consistency``
    (the reversible backward's recomputation check, two ``(N, D)`` transients), and
    ``graph_backend`` (``"dgl"`` or ``"pyg"``: whose convolution op sequence is replayed)
    and ``masks_held`` (the two dropout masks live until the part's backward ends, as
    RevTrainer's per-part ``SharedHashMasks`` cache keeps them; ``False``: RevGNN's own
    masks, which the residual network's autograd graph lets go of as it goes).
    ``num_parameters``, when known, is checked against the parameter shapes the
    estimator derives.
    """

    in_feats: int
    hidden: int
    out_feats: int
    num_layers: int
    num_groups: int = 2
    conv: str = "gcn"
    heads: int = 1
    gat_merge: str = "mean"
    norm: str = "layer"
    reversible: bool = True
    checkpoint: bool = False
    weight_tied: bool = False
    dropout: float = 0.0
    check_consistency: bool = True
    dtype: torch.dtype = torch.float32
    num_parameters: Optional[int] = None
    uses_mask_fn: bool = False
    graph_backend: str = "dgl"
    masks_held: bool = False

    def __post_init__(self) -> None:
        for name in ("in_feats", "hidden", "out_feats", "num_layers", "heads"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_groups < 2:
            raise ValueError(f"num_groups must be >= 2, got {self.num_groups}")
        if self.hidden % self.num_groups:
            raise ValueError(f"hidden must be divisible by num_groups: hidden={self.hidden}, "
                             f"num_groups={self.num_groups}")
        if self.conv not in _CONVS:
            raise ValueError(f"conv must be one of {_CONVS}, got {self.conv!r}")
        if self.norm not in _NORMS:
            raise ValueError(f"norm must be one of {_NORMS}, got {self.norm!r}")
        if self.graph_backend not in _GRAPH_BACKENDS:
            raise ValueError(f"graph_backend must be one of {_GRAPH_BACKENDS}, got {self.graph_backend!r}")
        if self.gat_merge not in ("mean", "concat"):
            raise ValueError(f"gat_merge must be 'mean' or 'concat', got {self.gat_merge!r}")
        if self.conv == "gat" and self.gat_merge == "concat" and self.group_width % self.heads:
            raise ValueError(f"gat_merge='concat' needs heads to divide the group width: "
                             f"width={self.group_width}, heads={self.heads}")
        check_dropout(self.dropout)
        if self.reversible and self.checkpoint:
            raise ValueError("checkpoint=True applies to the residual network (reversible=False)")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch.dtype, got {self.dtype!r}")
        if self.num_parameters is not None and self.num_parameters != self.parameter_count:
            raise ValueError(
                f"the architecture reports {self.num_parameters} parameters but the estimator "
                f"derives {self.parameter_count} from its shapes (conv={self.conv!r}, "
                f"norm={self.norm!r}, hidden={self.hidden}, groups={self.num_groups}): the "
                "model is not the RevGNN the estimator knows")

    # ------------------------------------------------------------------ derived
    @property
    def group_width(self) -> int:
        return self.hidden // self.num_groups

    @property
    def mode(self) -> str:
        """``"reversible"``, ``"residual"`` or ``"checkpoint"``."""
        if self.reversible:
            return "reversible"
        return "checkpoint" if self.checkpoint else "residual"

    @property
    def num_distinct_blocks(self) -> int:
        return 1 if self.weight_tied else self.num_layers

    def parameter_shapes(self) -> list[list[tuple[int, ...]]]:
        """``[encoder, block_0, ..., head]`` parameter shapes (``RevGNN.parameters()`` order)."""
        return rev_parameter_shapes(self.in_feats, self.hidden, self.out_feats, self.num_groups,
                                    self.num_distinct_blocks, self.conv, self.norm, self.heads,
                                    self.gat_merge)

    @property
    def parameter_count(self) -> int:
        return sum(math.prod(s) for group in self.parameter_shapes() for s in group)

    # ------------------------------------------------------------------ construction
    @classmethod
    def of(cls, arch: Any, **overrides: Any) -> "RevModelShape":
        """From a :class:`~betty.rev.model.RevGNN`, a
        :class:`~betty.rev.model.RevArchitecture` (which does not record the dropout:
        pass ``dropout=``), another :class:`RevModelShape` or a mapping of its fields;
        ``overrides`` replace fields (``None`` values are ignored)."""
        overrides = {k: v for k, v in overrides.items() if v is not None}
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown RevModelShape fields {sorted(unknown)}; "
                             f"allowed: {sorted(known)}")
        if isinstance(arch, cls):
            return replace(arch, **overrides)
        if isinstance(arch, torch.nn.Module):
            if not hasattr(arch, "architecture"):
                raise TypeError(f"arch must be a RevGNN (with .architecture()), "
                                f"got {type(arch).__name__}")
            if not hasattr(arch, "stack"):  # RevGNNDEQ: one cell solved to a fixed point
                raise TypeError(f"{type(arch).__name__} has no reversible block stack; the memory "
                                f"model estimates RevGNN only (train the DEQ with a fixed K and "
                                f"no memory budget)")
            base = _architecture_fields(arch.architecture())
            base["dropout"] = float(getattr(arch, "dropout", 0.0))
            blocks = arch.stack.blocks
            base["check_consistency"] = bool(blocks[0].check_consistency)
            base["uses_mask_fn"] = getattr(arch, "mask_fn", None) is not None
            return cls(**{**base, **overrides})
        if isinstance(arch, Mapping):
            return cls(**{**{k: v for k, v in arch.items() if k in known}, **overrides})
        if hasattr(arch, "num_groups") and hasattr(arch, "conv"):  # a RevArchitecture
            base = _architecture_fields(arch)
            if "dropout" not in overrides:
                raise ValueError(
                    "a RevArchitecture does not record the dropout probability: pass dropout= "
                    "(0.0 for none), or pass the RevGNN itself")
            return cls(**{**base, **overrides})
        raise TypeError(
            f"arch must be a RevGNN, a RevArchitecture, a RevModelShape or a mapping, "
            f"got {type(arch).__name__}")


def _architecture_fields(arch) -> dict:
    names = ("in_feats", "hidden", "out_feats", "num_layers", "num_groups", "conv", "heads",
             "gat_merge", "norm", "reversible", "checkpoint", "weight_tied", "dtype",
             "num_parameters", "graph_backend")
    return {n: getattr(arch, n) for n in names if hasattr(arch, n)}


def _as_vector(values, name: str) -> np.ndarray:
    arr = np.atleast_1d(np.asarray(values, dtype=np.float64))
    if arr.ndim != 1 or (arr < 0).any() or not np.isfinite(arr).all():
        raise ValueError(f"{name} must be non-negative counts (a number or a 1-d sequence), "
                         f"got {values!r}")
    return arr


def rev_persistent_bytes(arch: Any,
                         optimizer: Union[str, OptimizerSpec, torch.optim.Optimizer] = "adam",
                         backend: str = "cpu", **shape_overrides: Any) -> int:
    """Parameters + one gradient per parameter + optimizer state: the floor of every
    part's peak, whatever K is (it grows with depth)."""
    shape = RevModelShape.of(arch, **shape_overrides)
    opt = as_optimizer_spec(optimizer)
    elt = itemsize(shape.dtype, "dtype")
    pbytes = shape.parameter_count * elt
    n_state, has_step = opt.state_tensors()
    n_tensors = sum(len(g) for g in shape.parameter_shapes())
    step = 4 * n_tensors if has_step and (backend == "cpu" or opt.step_on_device) else 0
    return (2 + n_state) * pbytes + step


def rev_replay_config(arch: Any, *,
                      optimizer: Union[str, OptimizerSpec, torch.optim.Optimizer] = "adam",
                      dtype: Optional[torch.dtype] = None, backend: str = "cpu", fresh_grads=True,
                      num_parts: int = 1, label_columns: int = 0,
                      label_dtype: torch.dtype = torch.float32,
                      feat_dtype: Optional[torch.dtype] = None,
                      constants: Optional[BackendConstants] = None, first_step: bool = False,
                      step_parts=None, **shape_overrides: Any) -> tuple[RevReplayConfig, RevModelShape]:
    """The replay's configuration of ``num_parts`` parts of ``arch`` (and its shape): what
    :func:`estimate_rev_sizes` replays, and what a trace diff replays with
    ``replay_rev(..., record=True)``. Arguments: see :func:`estimate_rev_sizes`."""
    shape = RevModelShape.of(arch, **shape_overrides)
    if shape.uses_mask_fn:
        raise ValueError("the model draws its dropout masks with mask_fn (per block, on "
                         "demand): this memory pattern is not modelled; estimate with "
                         "mask_fn=None (RevGNN's shared Bernoulli masks)")
    if dtype is not None and dtype != shape.dtype:
        shape = replace(shape, dtype=dtype)
    if label_columns < 0:
        raise ValueError(f"label_columns must be >= 0, got {label_columns}")
    consts = constants if constants is not None else load_constants(backend)
    elt = itemsize(shape.dtype, "dtype")
    cfg = RevReplayConfig(
        hidden=shape.hidden, num_groups=shape.num_groups, num_layers=shape.num_layers,
        in_feats=shape.in_feats, out_feats=shape.out_feats, conv=shape.conv, heads=shape.heads,
        gat_merge=shape.gat_merge, norm=shape.norm, mode=shape.mode, graph_backend=shape.graph_backend,
        masks_held=shape.masks_held,
        weight_tied=shape.weight_tied, dropout=shape.dropout,
        check_consistency=shape.check_consistency, optimizer=as_optimizer_spec(optimizer), elt=elt,
        feat_elt=itemsize(feat_dtype, "feat_dtype") if feat_dtype is not None else elt,
        fresh_grads=np.broadcast_to(np.asarray(fresh_grads, dtype=bool), (num_parts,)).copy(),
        label_columns=int(label_columns),
        label_elt=itemsize(label_dtype, "label_dtype"), host=not backend.startswith("cuda"),
        granule=consts.granule_bytes, first_step=bool(first_step),
        step_parts=None if step_parts is None else np.broadcast_to(
            np.asarray(step_parts, dtype=bool), (num_parts,)).copy())
    return cfg, shape


def estimate_rev_sizes(num_nodes, num_edges, arch: Any, *,
                       optimizer: Union[str, OptimizerSpec, torch.optim.Optimizer] = "adam",
                       dtype: Optional[torch.dtype] = None, backend: str = "cpu",
                       num_train=None, fresh_grads=True, label_columns: int = 0,
                       label_dtype: torch.dtype = torch.float32,
                       feat_dtype: Optional[torch.dtype] = None,
                       constants: Optional[BackendConstants] = None, first_step: bool = False,
                       step_parts=None, **shape_overrides: Any) -> list[MemoryEstimate]:
    """Estimate P parts at once from their sizes (one vectorized replay).

    Args:
        num_nodes, num_edges: ``(P,)`` node and edge counts of the parts (or numbers).
        arch: see :meth:`RevModelShape.of`; ``shape_overrides`` (e.g. ``dropout=``,
            ``in_feats=``, ``reversible=``) replace its fields.
        optimizer: ``"adam"``, ``"sgd"``, an :class:`~betty.memory.spec.OptimizerSpec`
            or a torch optimizer (its state is assumed to exist, unless ``first_step``).
        dtype: compute dtype (default: the architecture's).
        backend: ``"cpu"``, ``"cuda"`` or ``"cuda-nocudnn"`` (allocation rounding; Adam
            variant: single-tensor on the host, foreach on CUDA).
        num_train: ``(P,)`` training nodes per part (default: every node); a part with
            none is skipped by ``train_step_parts`` (pass its sizes as 0).
        fresh_grads: ``(P,)`` bools: the part starts without ``.grad`` (the first part
            with training nodes of a step).
        label_columns: T for multi-label (BCE) targets of ``label_dtype``; 0 for class
            indices (cross-entropy).
        feat_dtype: the features' dtype (default: ``dtype``).
        constants: override the backend's constants.
        first_step: the optimizer's first step: no state exists while the parts run, the
            step creates it (the parts of ``step_parts`` count it and the step's
            temporaries; the others only what they allocate).
        step_parts: ``(P,)`` bools: the parts whose meter region holds the optimizer step
            (default: every part, each estimate covering the step whichever part runs
            last).
    """
    n = _as_vector(num_nodes, "num_nodes")
    e = _as_vector(num_edges, "num_edges")
    nt = n if num_train is None else _as_vector(num_train, "num_train")
    if not (n.shape == e.shape == nt.shape):
        raise ValueError(f"num_nodes, num_edges and num_train must have the same length, got "
                         f"{n.shape[0]}, {e.shape[0]} and {nt.shape[0]}")
    if (nt > n).any():
        raise ValueError("num_train must not exceed num_nodes")
    cfg, shape = rev_replay_config(arch, optimizer=optimizer, dtype=dtype, backend=backend,
                                   fresh_grads=fresh_grads, num_parts=n.shape[0],
                                   label_columns=label_columns, label_dtype=label_dtype,
                                   feat_dtype=feat_dtype, constants=constants, first_step=first_step,
                                   step_parts=step_parts, **shape_overrides)
    tl = replay_rev(n, e, nt, cfg)
    breakdown = tl.breakdown()
    where = tl.peak_event()
    return [
        MemoryEstimate(peak=int(round(tl.peak[i])), breakdown=breakdown[i], peak_at=where[i],
                       sizes={"num_nodes": int(n[i]), "num_edges": int(e[i]),
                              "num_train": int(nt[i]), "mode": shape.mode,
                              "num_layers": shape.num_layers},
                       backend=backend)
        for i in range(n.shape[0])
    ]


def estimate_rev(num_nodes: int, num_edges: int, arch: Any, *,
                 in_feats: Optional[int] = None, out_feats: Optional[int] = None,
                 optimizer: Union[str, OptimizerSpec, torch.optim.Optimizer] = "adam",
                 dtype: Optional[torch.dtype] = None, backend: str = "cpu",
                 dropout: Optional[float] = None, num_train: Optional[int] = None,
                 label_columns: int = 0, fresh_grads: bool = True,
                 **kwargs: Any) -> MemoryEstimate:
    """Peak of one training step of RevGNN on one graph (``K = 1``) or one part.

    Args:
        num_nodes, num_edges: ``N`` and ``E`` of the (sub)graph the model runs on.
        arch: a RevGNN, its ``architecture()`` (then ``dropout=`` is required), a
            :class:`RevModelShape` or a mapping of its fields.
        in_feats, out_feats, dropout: override the architecture's.
        num_train: training nodes in the part (default ``N``).
        fresh_grads: the part starts without ``.grad`` (True for ``K = 1``).
        Other keywords: see :func:`estimate_rev_sizes`.

    Returns:
        A :class:`~betty.memory.estimator.MemoryEstimate`: ``peak`` bytes, ``breakdown``
        of the bytes live at the peak by component (sums to ``peak``), ``peak_at``.
    """
    return estimate_rev_sizes(
        num_nodes, num_edges, arch, optimizer=optimizer, dtype=dtype, backend=backend,
        num_train=num_train, fresh_grads=fresh_grads, label_columns=label_columns,
        in_feats=in_feats, out_feats=out_feats, dropout=dropout, **kwargs)[0]


def _part_sizes(parts: Sequence[Any], train_mask: Optional[torch.Tensor]):
    n, e, nt = [], [], []
    for part in parts:
        graph = getattr(part, "graph", part)
        if not hasattr(graph, "num_nodes"):
            raise TypeError(f"parts must be GraphPart objects or whole graphs (dgl.DGLGraph, PygGraph), "
                            f"got {type(part).__name__}")
        n.append(graph.num_nodes())
        e.append(graph.num_edges())
        if train_mask is None:
            nt.append(graph.num_nodes())
        else:
            ids = getattr(part, "node_ids", None)
            if ids is None:
                raise ValueError("train_mask needs GraphPart objects (their node_ids)")
            nt.append(int(train_mask[ids.to(train_mask.device)].sum()))
    return np.array(n, float), np.array(e, float), np.array(nt, float)


def estimate_rev_parts(parts: Sequence[Any], arch: Any, *,
                       train_mask: Optional[torch.Tensor] = None, zeroed_grads: bool = True,
                       first_step: bool = False, step_in_region: bool = True,
                       **kwargs: Any) -> list[MemoryEstimate]:
    """Estimate every part of a split as :func:`~betty.rev.engine.train_step_parts`
    runs it; the step's peak is the largest.

    Args:
        parts: :class:`~betty.rev.training.GraphPart` list (from
            :func:`~betty.rev.training.cluster_partition`) or whole graphs of either backend.
        arch: see :func:`estimate_rev`.
        train_mask: ``(N,)`` bool over the full graph (default: every node trains).
            Parts without training nodes are skipped by the step: their estimate is the
            persistent floor plus the optimizer step.
        zeroed_grads: the step starts with ``zero_grad(set_to_none=True)`` (as
            ``train_step_parts`` does): the first part with training nodes
            creates the gradients, the others accumulate into them.
        first_step: the optimizer has not stepped yet (no state: epoch 0). The parts
            are estimated without its state, and the one whose meter region holds the
            step (the last part with training nodes, where ``train_step_parts`` steps)
            also with what the step creates: the state, then the step's temporaries.
        step_in_region: whether the step runs inside the last part's region (one
            process; under ``parallel`` it runs after the regions): with
            ``first_step`` and ``False`` no part counts the step.
        Other keywords: see :func:`estimate_rev_sizes`.
    """
    if len(parts) == 0:
        raise ValueError("parts must not be empty")
    n, e, nt = _part_sizes(parts, train_mask)
    skipped = nt == 0
    n, e = np.where(skipped, 0.0, n), np.where(skipped, 0.0, e)
    fresh = np.zeros(n.shape[0], dtype=bool)
    if zeroed_grads and (~skipped).any():
        fresh[int(np.argmax(~skipped))] = True
    step_parts = None
    if first_step:
        step_parts = np.zeros(n.shape[0], dtype=bool)
        if step_in_region and (~skipped).any():
            step_parts[n.shape[0] - 1 - int(np.argmax(~skipped[::-1]))] = True
    estimates = estimate_rev_sizes(n, e, arch, num_train=nt, fresh_grads=fresh, first_step=first_step,
                                   step_parts=step_parts, **kwargs)
    for est, s in zip(estimates, skipped):
        est.sizes["skipped"] = bool(s)
    return estimates


class RevKSearchError(KSearchError):
    """No K of the candidates fits the budget (a :class:`KSearchError`)."""


@dataclass
class RevKSearchResult:
    """Outcome of :func:`search_k_rev`.

    Attributes:
        k: the chosen number of parts.
        parts: the split of that K (train with exactly these).
        estimates: per-part estimates of that split.
        peak: the largest part's estimated peak.
        tried: ``{K: largest estimated part peak}`` for every K estimated.
    """

    k: int
    parts: list
    estimates: list[MemoryEstimate]
    peak: int
    tried: dict[int, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-ready summary (for logging and the CLI, as
        :meth:`betty.memory.KSearchResult.to_dict`): ``k``, its largest part's estimated
        ``peak_bytes`` and ``tried`` (``{"K": largest estimated part peak}``)."""
        return {"k": int(self.k), "peak_bytes": int(self.peak),
                "tried": {str(k): int(v) for k, v in self.tried.items()}}


def search_k_rev(graph, arch: Any, budget: int, *, method: str = "random", seed: int = 0,
                 train_mask: Optional[torch.Tensor] = None, max_k: Optional[int] = None,
                 safety_margin: float = DEFAULT_SAFETY_MARGIN, max_evaluations: int = 40,
                 min_k: int = 1, **kwargs: Any) -> RevKSearchResult:
    """The smallest K whose largest part (of ``cluster_partition(graph, K, method,
    seed)``) is estimated to fit ``budget · (1 − safety_margin)`` bytes.

    The search is the sampled-batch engine's (:func:`betty.memory.ksearch.
    smallest_fitting_k`): K = 1, then the lower bound from the persistent floor
    (parameters, gradients, optimizer state), overshoot jumps while the largest part does
    not fit, then a binary search down to adjacent integers (splits are heuristic, so the
    search never returns a K whose own split was not estimated to fit). Raises
    :class:`RevKSearchError` when the floor alone exceeds the usable budget, no K up to
    ``max_k`` (default ``N``) fits, or ``max_evaluations`` splits did not settle.
    ``min_k``: the smallest K allowed (``min_k = R`` gives each of R ranks a part; the
    :class:`~betty.rev.engine.RevTrainer` passes 1 on any number of ranks, K being part of
    its model). Other keywords: see
    :func:`estimate_rev_sizes`.
    """
    from betty.memory.ksearch import smallest_fitting_k
    from betty.rev.training import cluster_partition

    n_nodes = graph.num_nodes()
    max_k = n_nodes if max_k is None else int(max_k)
    if not 1 <= max_k <= n_nodes:
        raise ValueError(f"max_k must be in [1, num_nodes={n_nodes}], got {max_k}")
    shape_keys = {f.name for f in fields(RevModelShape)}
    floor = rev_persistent_bytes(arch, kwargs.get("optimizer", "adam"),
                                 kwargs.get("backend", "cpu"),
                                 **{k: v for k, v in kwargs.items() if k in shape_keys})

    def split_and_estimate(k: int):
        parts = cluster_partition(graph, k, method, seed)
        return parts, estimate_rev_parts(parts, arch, train_mask=train_mask, **kwargs)

    found = smallest_fitting_k(
        split_and_estimate, memory_budget=budget, safety_margin=safety_margin, fixed=floor,
        k_max=max_k, max_evaluations=max_evaluations, min_k=min_k,
        limit="one node per part" if max_k == n_nodes else f"max_k = {max_k}",
        error_cls=RevKSearchError)
    return RevKSearchResult(k=found.k, parts=found.split, estimates=found.estimates,
                            peak=max(e.peak for e in found.estimates),
                            tried=dict(sorted(found.tried)))
