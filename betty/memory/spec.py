"""What the memory model needs to know about a model and its optimizer.

:class:`ModelSpec` describes a :class:`betty.models.BlockGNN` by its architecture and
widths only (no tensors), so an estimate can be made before the model exists, e.g. from
an experiment spec. :func:`parameter_shapes` lists the parameters such a model has, in
the layout of :mod:`betty.models`, and :class:`OptimizerSpec` says which optimizer
state those parameters carry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ModelSpec", "OptimizerSpec", "parameter_shapes", "as_model_spec", "as_optimizer_spec",
           "report_optimizer_spec"]

ARCHS = ("sage", "gat", "gcn")
AGGREGATORS = ("mean", "gcn", "pool", "lstm")
ACTIVATIONS = ("relu", "elu", "leaky_relu", "gelu")  # betty.models.base.ACTIVATIONS
DEFAULT_ACTIVATION = {"sage": "relu", "gat": "elu", "gcn": "relu"}  # betty.models.DEFAULT_ACTIVATION
SAVES_RESULT = ("relu",)  # betty.models.base.SAVES_RESULT: the others save their input
OPTIMIZER_NAMES = ("adam", "sgd")
GNN_BACKENDS = ("dgl", "pyg")  # betty.backends.BACKENDS (not imported: no framework import here)


@dataclass(frozen=True)
class ModelSpec:
    """Shape-level description of a betty GNN.

    Attributes:
        arch: ``"sage"``, ``"gat"`` or ``"gcn"``.
        widths: ``[in_feats, w_1, ..., out_feats]`` (L + 1 entries): the feature width
            entering each layer, then the output width. For GAT hidden widths are
            ``heads * hidden``.
        aggregator: GraphSAGE aggregator (ignored for GAT).
        heads: GAT attention heads (ignored for SAGE).
        output_heads: GAT attention heads of the last layer (``None``: ``heads``).
        dropout: input dropout probability of every layer.
        attn_dropout: GAT attention dropout probability.
        dropout_mode: ``"deterministic"`` (hash dropout) or ``"standard"``.
        param_dtype: dtype of the parameters (their gradients and optimizer state).
        backend: the GNN backend the model runs on (``"dgl"`` or ``"pyg"``,
            :mod:`betty.backends`): the replay follows that backend's op sequences.
        activation: the non-linearity between layers (``None``: the arch's default,
            ReLU for SAGE, ELU for GAT); the replay keeps its saved output
            (``relu``) or input (``elu``, ``leaky_relu``, ``gelu``).
    """

    arch: str
    widths: tuple[int, ...]
    aggregator: str = "mean"
    heads: int = 1
    dropout: float = 0.0
    attn_dropout: float = 0.0
    dropout_mode: str = "deterministic"
    param_dtype: torch.dtype = torch.float32
    backend: str = "dgl"
    output_heads: int | None = None
    activation: str | None = None

    def __post_init__(self) -> None:
        if self.activation is not None and self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.backend not in GNN_BACKENDS:
            raise ValueError(f"backend must be one of {GNN_BACKENDS}, got {self.backend!r}")
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        if self.arch == "sage" and self.aggregator not in AGGREGATORS:
            raise ValueError(f"aggregator must be one of {AGGREGATORS}, got {self.aggregator!r}")
        if len(self.widths) < 2 or any(int(w) < 1 for w in self.widths):
            raise ValueError(f"widths must list L + 1 >= 2 positive widths, got {self.widths!r}")
        if self.arch == "gat":
            if self.heads < 1 or self.last_heads < 1:
                raise ValueError(f"heads and output_heads must be >= 1, got {self.heads} "
                                 f"and {self.last_heads}")
            bad = [w for w in self.widths[1:-1] if w % self.heads]
            if bad:
                raise ValueError(f"GAT hidden widths must be multiples of heads={self.heads}, got {bad}")

    @property
    def num_layers(self) -> int:
        return len(self.widths) - 1

    @property
    def last_heads(self) -> int:
        """GAT attention heads of the last layer."""
        return self.heads if self.output_heads is None else self.output_heads

    def layer_heads(self, l: int) -> int:
        """GAT attention heads of layer ``l``."""
        return self.last_heads if l == self.num_layers - 1 else self.heads

    @property
    def activation_name(self) -> str:
        """The activation between layers (the arch's default when ``activation`` is ``None``)."""
        return self.activation or DEFAULT_ACTIVATION[self.arch]

    @property
    def activation_saves_result(self) -> bool:
        """Whether the activation's backward keeps its output (else its input)."""
        return self.activation_name in SAVES_RESULT

    @classmethod
    def from_config(cls, arch: str, in_feats: int, out_feats: int, *, hidden: int = 256,
                    layers: int = 2, aggregator: str = "mean", heads: int = 4,
                    output_heads: int | None = None, dropout: float = 0.0, attn_dropout: float = 0.0,
                    dropout_mode: str = "deterministic",
                    param_dtype: torch.dtype = torch.float32,
                    backend: str = "dgl", activation: str | None = None) -> "ModelSpec":
        """Same arguments as :func:`betty.models.build_model` (``backend`` resolved:
        ``"dgl"`` or ``"pyg"``)."""
        if arch == "gat":
            widths = (in_feats,) + (hidden * heads,) * (layers - 1) + (out_feats,)
        else:
            widths = (in_feats,) + (hidden,) * (layers - 1) + (out_feats,)
        return cls(arch, tuple(int(w) for w in widths), aggregator, heads, dropout,
                   attn_dropout, dropout_mode, param_dtype, backend,
                   output_heads=output_heads if arch == "gat" else None, activation=activation)

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> "ModelSpec":
        """Read the spec off a :class:`betty.models.GraphSAGE`, :class:`~betty.models.GAT`
        or :class:`~betty.models.GCN`."""
        from betty.models import GAT, GCN, GraphSAGE

        dtype = next(model.parameters()).dtype
        backend = getattr(model, "backend_name", "dgl")
        activation = getattr(model, "activation_name", None)
        if isinstance(model, GraphSAGE):
            return cls("sage", tuple(model.widths), model.aggregator, 1, model.dropout, 0.0,
                       model.dropout_mode, dtype, backend, activation=activation)
        if isinstance(model, GAT):
            return cls("gat", tuple(model.widths), "mean", model.heads, model.dropout,
                       model.attn_dropout, model.dropout_mode, dtype, backend,
                       output_heads=model.output_heads, activation=activation)
        if isinstance(model, GCN):
            return cls("gcn", tuple(model.widths), "mean", 1, model.dropout, 0.0,
                       model.dropout_mode, dtype, backend, activation=activation)
        raise TypeError(f"model must be a betty GraphSAGE, GAT or GCN, got {type(model).__name__}")


def parameter_shapes(spec: ModelSpec) -> list[list[tuple[int, ...]]]:
    """Per layer, the shapes of its parameters (the order of ``module.parameters()``)."""
    out = []
    for l in range(spec.num_layers):
        wi, wo = spec.widths[l], spec.widths[l + 1]
        if spec.arch == "gat":
            heads = spec.layer_heads(l)
            f = wo // heads if l < spec.num_layers - 1 else wo
            out.append([(heads * f, wi), (1, heads, f), (1, heads, f), (heads, f)])
            continue
        if spec.arch == "gcn":
            out.append([(wi, wo), (wo,)])  # weight, bias
            continue
        agg = spec.aggregator
        shapes: list[tuple[int, ...]] = []
        if agg == "pool":
            shapes += [(wi, wi), (wi,)]
        if agg == "lstm":
            shapes += [(4 * wi, wi), (4 * wi, wi), (4 * wi,), (4 * wi,)]
        shapes.append((wo, wi))  # fc_neigh
        shapes += [(wo,)] if agg == "gcn" else [(wo, wi), (wo,)]  # bias | fc_self
        out.append(shapes)
    return out


@dataclass(frozen=True)
class OptimizerSpec:
    """Which per-parameter state an optimizer keeps after its first step.

    ``adam`` (``torch.optim.Adam`` and ``AdamW``, whose decoupled weight decay works in
    place): ``exp_avg`` and ``exp_avg_sq`` (parameter-sized), with ``amsgrad`` also
    ``max_exp_avg_sq``, and a 0-d float32 ``step`` (on the host unless
    ``capturable``/``fused``). ``sgd``: a ``momentum_buffer`` when ``momentum > 0``, else
    nothing. ``decay``: weight decay added to the gradient (``Adam``'s and ``SGD``'s, not
    ``AdamW``'s, which scales the parameters in place); ``foreach``: the multi-tensor
    step (``None``: torch's default, multi-tensor on CUDA, one tensor at a time on the
    host). These two shape the step's temporaries (:func:`betty.memory.estimator.step_bytes`).

    ``nesterov`` (SGD with momentum) and ``maximize`` (both) add gradient-sized
    temporaries to the step.

    ``groups``: the optimizer's parameter groups, read off a torch optimizer
    (:func:`as_optimizer_spec`), in the order its step visits them: per group the
    element counts of its parameters, in order, and whether weight decay is added to
    their gradients (``decay`` then says whether any group's is). ``None`` (a spec made
    by name): one group of the model's parameters, all decayed where ``decay``.
    """

    name: str = "adam"
    momentum: float = 0.0
    step_on_device: bool = False
    amsgrad: bool = False
    decay: bool = False
    foreach: bool | None = None
    nesterov: bool = False
    maximize: bool = False
    groups: tuple[tuple[tuple[int, ...], bool], ...] | None = None

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZER_NAMES:
            raise ValueError(f"optimizer must be one of {OPTIMIZER_NAMES}, got {self.name!r}")

    def state_tensors(self) -> tuple[int, bool]:
        """(parameter-sized state tensors per parameter, whether a 0-d step exists)."""
        if self.name == "adam":
            return 2 + self.amsgrad, True
        return (1 if self.momentum > 0 else 0), False


def as_model_spec(model) -> ModelSpec:
    """A :class:`ModelSpec` from a spec or a betty model."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, torch.nn.Module):
        return ModelSpec.from_model(model)
    raise TypeError(f"model must be a ModelSpec or a betty model, got {type(model).__name__}")


# the group keys that decide which state a parameter gets and how the step runs: the
# memory model takes one value of each for the whole optimizer
_UNIFORM_KEYS = {"adam": ("amsgrad", "foreach", "capturable", "fused", "decoupled_weight_decay", "maximize"),
                 "sgd": ("momentum", "foreach", "nesterov", "maximize")}


def _param_groups(optimizer: torch.optim.Optimizer, name: str, decoupled: bool):
    """``(first group, OptimizerSpec.groups)`` of a torch ``optimizer`` (empty groups left
    out): per group its parameters' element counts and whether weight decay is added to
    their gradients (a nonzero ``weight_decay``, unless ``decoupled``).

    Raises:
        ValueError: the groups differ in a key of :data:`_UNIFORM_KEYS` (named)."""
    groups = [g for g in optimizer.param_groups if g["params"]] or optimizer.param_groups[:1]
    first = groups[0]
    for key in _UNIFORM_KEYS[name]:
        values = [g.get(key) for g in groups]
        if any(v != values[0] for v in values):
            raise ValueError(
                f"the memory model takes one {key!r} for all of the optimizer's parameter groups "
                f"(it sizes every parameter's state and step alike); got {values} across "
                f"{len(groups)} groups: give every group the same {key!r}")
    return first, tuple((tuple(int(p.numel()) for p in g["params"]),
                         bool(g.get("weight_decay", 0)) and not decoupled) for g in groups)


def report_optimizer_spec(optimizer) -> OptimizerSpec:
    """:func:`as_optimizer_spec` for a memory report, which estimates whatever the
    trainer's ``estimate_memory``: an optimizer the model does not know is a
    ``TypeError`` saying that, not how to train without estimates."""
    try:
        return as_optimizer_spec(optimizer)
    except TypeError:
        raise TypeError(f"memory_report needs the memory model, which knows the state of torch.optim.Adam, "
                        f"AdamW and SGD, not {type(optimizer).__name__}") from None


def as_optimizer_spec(optimizer) -> OptimizerSpec:
    """An :class:`OptimizerSpec` from a spec, a name or a torch optimizer (its parameter
    groups recorded in ``groups``; groups that differ in a key deciding the state or the
    step's variant are refused with a ``ValueError`` naming the key)."""
    if isinstance(optimizer, OptimizerSpec):
        return optimizer
    if isinstance(optimizer, str):
        return OptimizerSpec(optimizer)
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(
            optimizer.param_groups[0].get("decoupled_weight_decay"))
        group, groups = _param_groups(optimizer, "adam", decoupled)
        return OptimizerSpec("adam", 0.0, bool(group.get("capturable") or group.get("fused")),
                             amsgrad=bool(group.get("amsgrad")), foreach=group.get("foreach"),
                             maximize=bool(group.get("maximize")), decay=any(d for _, d in groups),
                             groups=groups)
    if isinstance(optimizer, torch.optim.SGD):
        group, groups = _param_groups(optimizer, "sgd", False)
        return OptimizerSpec("sgd", float(group.get("momentum", 0.0)), foreach=group.get("foreach"),
                             nesterov=bool(group.get("nesterov")), maximize=bool(group.get("maximize")),
                             decay=any(d for _, d in groups), groups=groups)
    raise TypeError(
        f"the memory model knows the state of torch.optim.Adam, AdamW and SGD (or an OptimizerSpec, "
        f"or one of {OPTIMIZER_NAMES}), not {type(optimizer).__name__}; to train with it, turn the "
        f"estimates off (Trainer(..., estimate_memory=False) with an integer partition K)"
    )
