"""The experiment spec schema (pydantic v2, strict, unknown keys refused).

Field types, ranges and choices live in the section models (:class:`Spec`), rules
spanning several keys and the dataset's own options in :func:`check_spec`, arch-dependent
defaults in :func:`with_arch_defaults`. Every problem is a :class:`Problem` naming the key
path, the value and what is allowed. Choices owned by the library (datasets, partition
methods, aggregators, optimizers) are read from it, so the schema grows with it.

Keys, defaults and allowed values: docs/workflow.md, *Specs* (``revgnn``: *Reversible deep GNNs*).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, field_validator, model_validator

from betty import catalog  # read when a spec is checked: the schema grows with the library
from betty.checks import check_dropout
from betty.data.registry import FEATURE_DTYPES, dataset_names  # the feature dtypes and datasets accepted
from betty.data.options import MAX_SEED  # sampling.seed and train.seed too
from betty.sizes import BYTE_SIZE_HELP, parse_bytes
from betty.precision import PRECISIONS

__all__ = [
    "Problem",
    "SpecError",
    "short_repr",
    "short_text",
    "Spec",
    "DatasetSection",
    "SamplingSection",
    "ModelSection",
    "PartitionSection",
    "SweepSection",
    "TrainSection",
    "EarlyStoppingSection",
    "EvaluateSection",
    "check_spec",
    "check_device",
    "spec_notes",
    "with_arch_defaults",
    "weight_pickers",
]

DEFAULT_SWEEP_K = (2, 4, 8, 16, 32)
MAX_WIDTH = 16384
"""Largest ``model.hidden`` (and, for ``gat``, ``hidden * heads``): one 16384 x 16384
float32 weight is 1 GiB, so a typo cannot allocate terabytes before any check."""
MAX_HEADS = 64
MAX_LAYERS = 1024
"""Largest ``model.layers`` (RevGNN's deepest published network has 1001)."""
PSEUDO_FILESYSTEMS = ("/proc", "/sys", "/dev")
"""Where ``dataset.root`` and data paths may not point (``/dev/shm``, a real tmpfs, may)."""


def short_text(text: str, limit: int = 60) -> str:
    """``text`` cut to ``limit`` characters (``...`` marks the cut): an error message
    names a key or value without echoing a whole file's worth of text."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut like :func:`short_text`."""
    return short_text(repr(value), limit)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec: ``path`` (``"model.layers"``), the offending value
    (``None`` when the key is missing) and a message saying what is allowed.
    ``hide_value`` leaves the value out of the message (an unknown key's value may be
    any text of the file); long values are cut (:func:`short_repr`)."""

    path: str
    value: Any
    message: str
    missing: bool = False
    hide_value: bool = False

    def __str__(self) -> str:
        if self.missing or self.hide_value:
            return f"{self.path}: {self.message}"
        return f"{self.path} = {short_repr(self.value, 200)}: {self.message}"


class SpecError(ValueError):
    """A spec (or an override) is invalid; ``problems`` lists every issue found."""

    def __init__(self, problems: list[Problem], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        where = f" {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid spec{where}:\n{lines}")


# ----------------------------------------------------------------- field validators


def _library_choice(kind: str, value: Any, choices: list[str] | tuple[str, ...]) -> str:
    """``value`` when it is one of ``choices``; otherwise a :class:`ValueError` naming the
    ``kind`` and the choices, quoted as in a spec (``unknown aggregator; allowed: 'mean',
    'gcn', 'pool', 'lstm'``). The :class:`Problem` built from it adds the key and value."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"unknown {kind}; allowed: {', '.join(map(repr, choices))}")
    return value


def _one_of(kind: str, choices: Callable[[], Sequence[str]]) -> AfterValidator:
    """The check of a ``str`` field that must be one of ``choices()`` (read when a spec is
    checked, so that the library's lists are the schema's): :func:`_library_choice`."""
    return AfterValidator(lambda value: _library_choice(kind, value, choices()))


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count_or(word: str, allowed: str) -> PlainValidator:
    """The check of a field that is an integer >= 1 or ``word``; ``allowed`` says so."""

    def check(value: Any) -> int | str:
        if value == word or (_int(value) and value >= 1):
            return value
        raise ValueError(allowed)

    return PlainValidator(check)


def _check_budget(value: Any) -> int | None:
    if value is None:
        return None
    try:
        size = parse_bytes(value)
    except ValueError:
        raise ValueError(f"not a byte size; allowed: {BYTE_SIZE_HELP}") from None
    if size == 0:
        raise ValueError(f"must be more than 0 bytes; allowed: {BYTE_SIZE_HELP}")
    return size


def _check_threads(value: Any) -> int | str | None:
    if value is None or value == "auto":
        return value
    from betty.threads import available_cores  # torch-free

    cores = available_cores()
    if _int(value) and 1 <= value <= cores:
        return value
    raise ValueError(f"allowed: 'auto' (the idle cores, betty.threads), null (the libraries' default) "
                     f"or an integer from 1 to {cores} (the CPU cores available to this process)")


def _check_probability(value: Any) -> float:
    try:
        return check_dropout(value)  # the models' own rule
    except ValueError:
        raise ValueError("allowed: a probability from 0 to less than 1 (at most 1 - 2^-24: hash "
                         "dropout draws 24-bit uniforms)") from None


def _check_fanout(value: Any) -> int:
    if _int(value) and (value >= 1 or value == -1):
        return value
    raise ValueError("allowed: an integer >= 1, or -1 for every neighbour")


DEVICE_TYPES = ("cpu", "cuda")
"""The device types betty trains on (those the memory model has constants for)."""


def check_device(value: Any, allowed: str = "allowed: 'auto' (cuda if available, else cpu), "
                                             "'cpu', 'cuda', 'cuda:<index>'") -> str:
    if not isinstance(value, str):
        raise ValueError(allowed)
    if value == "auto":
        return value
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"not a torch device; {allowed}") from None
    if device.type not in DEVICE_TYPES:
        raise ValueError(f"betty trains on {' and '.join(DEVICE_TYPES)} devices only; {allowed}")
    return value


def _check_sample_device(value: Any) -> str:
    allowed = "allowed: 'host' (the NumPy sampler), 'cpu', 'cuda', 'cuda:<index>'"
    if value == "host":
        return value
    if value == "auto" or not isinstance(value, str):
        raise ValueError(allowed)
    return check_device(value, allowed)


Fanout = Annotated[int, PlainValidator(_check_fanout)]
SampleDevice = Annotated[str, PlainValidator(_check_sample_device)]
KValue = Annotated[int | str, _count_or("auto", "allowed: an integer >= 1 or 'auto' (search K with the memory model)")]
BatchSize = Annotated[int | str, _count_or("full", "allowed: 'full' (every training node in one batch) "
                                                   "or an integer >= 1")]
ByteBudget = Annotated[int | None, PlainValidator(_check_budget)]
Device = Annotated[str, PlainValidator(check_device)]
Probability = Annotated[float, PlainValidator(_check_probability)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Threads = Annotated[int | str | None, PlainValidator(_check_threads)]
PrepWorkers = Annotated[int | str, _count_or("auto", "allowed: 'auto' (the cores the trainer's threads leave, "
                                                     "betty.workers) or an integer >= 1 (1: preparation in one "
                                                     "thread)")]
# model.arch: sampled blocks (betty.engine) or revgnn (betty.rev.engine)
Arch = Annotated[str, _one_of("architecture", lambda: catalog.ARCHS)]
Aggregator = Annotated[str, _one_of("aggregator", lambda: catalog.SAGE_AGGREGATORS)]
Activation = Annotated[str, _one_of("activation", lambda: catalog.ACTIVATIONS)]
Optimizer = Annotated[str, _one_of("optimizer", lambda: catalog.OPTIMIZERS)]
PartitionMethod = Annotated[str, _one_of("partition method", lambda: sorted(catalog.PARTITION_METHODS))]
RegPartitioner = Annotated[str, _one_of("partition.partitioner", lambda: catalog.REG_PARTITIONERS)]
DatasetName = Annotated[str, _one_of("dataset", dataset_names)]


_DTYPE_PRECISION = {"float32": "32", "float64": "64"}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=False)


# ------------------------------------------------------------------------ sections


STORES = ("local", "distributed")
STORE_METHODS = ("metis", "random")
#: the dataset keys that say where the graph is held, not what it is
STORE_KEYS = ("store", "store_folder", "store_ip_config", "store_method")


class DatasetSection(BaseModel):
    """``dataset``: ``name``, ``root``, ``feature_dtype``, where the graph is held
    (``store*``, :mod:`betty.backends.distdgl`) and the dataset's own options as further
    keys (checked by :func:`check_spec`)."""

    model_config = ConfigDict(extra="allow", strict=True)

    name: DatasetName
    root: str = "data"
    feature_dtype: str = "float32"
    store: Annotated[str, _one_of("store", lambda: STORES)] = "local"
    store_folder: str | None = None
    store_ip_config: str | None = None
    store_method: Annotated[str, _one_of("store method", lambda: STORE_METHODS)] = "metis"

    @field_validator("feature_dtype")
    @classmethod
    def _feature_dtype(cls, value: str) -> str:
        if value not in FEATURE_DTYPES:
            raise ValueError(f"dataset.feature_dtype must be one of {', '.join(FEATURE_DTYPES)}; "
                             f"got {value!r}")
        return value

    @property
    def options(self) -> dict[str, Any]:
        """The dataset options given in the spec (keys other than name/root)."""
        return dict(self.model_extra or {})


class SamplingSection(_Section):
    """``sampling``: ``fanouts`` (input layer first), ``batch_size``, ``seed`` and
    ``device`` (``betty.engine.Trainer``'s ``sample_device``); ``revgnn`` may leave it
    out."""

    fanouts: list[Fanout] | None = Field(None, min_length=1)
    batch_size: BatchSize = "full"
    seed: Seed = 0
    device: SampleDevice = "host"


class ModelSection(_Section):
    """``model``: the GNN (:func:`betty.models.build_model`); which keys apply to
    which arch: :data:`_ARCH_ONLY` and :func:`check_spec`."""

    arch: Arch = "sage"
    hidden: int = Field(256, ge=1, le=MAX_WIDTH)
    layers: int = Field(2, ge=1, le=MAX_LAYERS)
    aggregator: Aggregator = "mean"
    heads: int = Field(4, ge=1, le=MAX_HEADS)
    output_heads: int | None = Field(None, ge=1, le=MAX_HEADS)
    dropout: Probability = 0.0
    attn_dropout: Probability = 0.0
    dropout_mode: Literal["deterministic", "standard"] = "deterministic"
    groups: int = Field(2, ge=2)
    conv: Literal["gcn", "sage", "gat"] = "gcn"
    norm: Literal["layer", "batch", "none"] = "layer"
    reversible: bool = True
    checkpoint: bool = False
    weight_tied: bool = False
    deq: bool = False
    deq_max_iter: int = Field(50, ge=1, le=100_000)
    deq_tol: float = Field(1e-5, gt=0.0, lt=1.0, allow_inf_nan=False)
    backend: str = Field("auto", validate_default=True)
    activation: Activation | None = None

    @field_validator("backend")
    @classmethod
    def _backend(cls, value: str) -> str:
        from betty.backends import BACKEND_CHOICES, BackendUnavailable, resolve_backend

        value = _library_choice("backend", value, BACKEND_CHOICES)
        try:
            resolve_backend(value, import_check=False)  # installed; importing it waits for a run
        except BackendUnavailable as err:
            raise ValueError(str(err)) from None
        return value


class SweepSection(_Section):
    """``partition.sweep``: the partition stage's comparison of ``methods`` at
    every K in ``k`` (an empty list turns it off), bounded by ``max_k`` and
    ``time_limit_s``."""

    k: list[Annotated[int, Field(ge=2)]] = Field(default_factory=lambda: list(DEFAULT_SWEEP_K))
    methods: list[PartitionMethod] | None = None
    max_k: dict[PartitionMethod, Annotated[int, Field(ge=2)]] = Field(default_factory=dict)
    time_limit_s: Seconds | None = None


class PartitionSection(_Section):
    """``partition``: how each batch is split (``betty.engine.PartitionPlan``;
    ``revgnn``: ``betty.rev.engine.RevPlan``)."""

    method: PartitionMethod = "reg"
    k: KValue = 4
    memory_budget: ByteBudget = None
    safety_margin: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.05
    balance: Literal["nodes", "memory"] = "nodes"
    reuse: Annotated[int, Field(ge=1)] | None = None
    time_limit_s: Seconds | None = None
    deterministic: bool = False
    partitioner: RegPartitioner = catalog.DEFAULT_REG_PARTITIONER
    sweep: SweepSection = Field(default_factory=SweepSection)


class EarlyStoppingSection(_Section):
    """``patience``: stop training once this many validation evaluations in a row
    (every ``evaluate.every`` epochs) brought no improvement (:class:`betty.selection.BestValidation`)."""

    patience: int = Field(ge=1)


class TrainSection(_Section):
    """``train``: optimisation, seeds, repeats, threads, ranks, early stopping and
    the preparation pipeline (``betty.engine.Trainer``'s ``prefetch``)."""

    epochs: int = Field(10, ge=1)
    lr: float = Field(0.01, gt=0.0, allow_inf_nan=False)
    weight_decay: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    weight_decay_first_layer_only: bool = False
    optimizer: Optimizer = "adam"
    device: Device = "auto"
    dtype: Literal["float32", "float64"] = "float32"
    precision: Any = "32"
    seed: Seed = 0
    repeats: int = Field(1, ge=1)
    measure_memory: bool = True
    threads: Threads = "auto"
    prep_workers: PrepWorkers = "auto"
    world_size: int = Field(1, ge=1)
    early_stopping: EarlyStoppingSection | None = None
    pipeline: bool = True
    prefetch: int = Field(1, ge=1, le=16)

    @field_validator("precision", mode="before")
    @classmethod
    def _precision(cls, value: Any) -> str:
        if isinstance(value, bool) or not isinstance(value, (str, int)) or str(value) not in PRECISIONS:
            raise ValueError(f"train.precision must be one of {', '.join(PRECISIONS)}; got {value!r}")
        return str(value)

    @model_validator(mode="after")
    def _dtype_alias(self) -> "TrainSection":
        """``train.dtype`` is the older name of ``train.precision`` 32/64 (the
        parameters' dtype): one given sets the other; both given must agree
        (:func:`_precision_problems`)."""
        given = self.model_fields_set
        if {"dtype", "precision"} <= given:
            return self  # both as given, checked by check_spec
        if "dtype" in given:
            object.__setattr__(self, "precision", _DTYPE_PRECISION[self.dtype])
        else:
            object.__setattr__(self, "dtype", "float64" if self.precision == "64" else "float32")
        return self


class EvaluateSection(_Section):
    """``evaluate``: validation during training, the weights kept (``select``)
    and how the evaluate stage infers (``inference``, ``fanouts``, ``chunk_size``,
    ``views``, ``parts``)."""

    every: int = Field(1, ge=0)
    select: Literal["last", "best_valid"] = "last"
    inference: Literal["full", "sampled", "multiview"] = "full"
    fanouts: list[Fanout] | None = None
    chunk_size: int = Field(16384, ge=1)
    views: int = Field(10, ge=1)
    parts: Annotated[int, Field(ge=1)] | None = None


class Spec(_Section):
    """A whole experiment. ``sampling`` may be left out with ``model.arch: revgnn``."""

    name: str = Field("spec", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=100)
    description: str | None = None
    experiment: str | None = Field(None, min_length=1, max_length=200)
    dataset: DatasetSection
    sampling: SamplingSection
    model: ModelSection = Field(default_factory=ModelSection)
    partition: PartitionSection = Field(default_factory=PartitionSection)
    train: TrainSection = Field(default_factory=TrainSection)
    evaluate: EvaluateSection = Field(default_factory=EvaluateSection)

    @model_validator(mode="before")
    @classmethod
    def _revgnn_needs_no_sampling(cls, data: Any) -> Any:
        """A ``revgnn`` spec may omit ``sampling`` (it samples nothing)."""
        if isinstance(data, dict) and "sampling" not in data:
            model = data.get("model")
            if isinstance(model, dict) and model.get("arch") == "revgnn":
                data = {**data, "sampling": {}}
        return data


# --------------------------------------------------------------- cross-field rules

_ARCH_ONLY = {
    "aggregator": ("sage",),
    "attn_dropout": ("gat",),
    "output_heads": ("gat",),
    "groups": ("revgnn",),
    "conv": ("revgnn",),
    "norm": ("revgnn",),
    "reversible": ("revgnn",),
    "checkpoint": ("revgnn",),
    "weight_tied": ("revgnn",),
    "deq": ("revgnn",),
    "deq_max_iter": ("revgnn",),
    "deq_tol": ("revgnn",),
    "activation": ("sage", "gat", "gcn"),
}


def _dataset_problems(ds: DatasetSection) -> list[Problem]:
    """The dataset's options as the data layer checks them
    (:func:`betty.data.options.option_problems`), each at its key path."""
    from betty.data.options import option_problems

    return [Problem("dataset" if p.key is None else f"dataset.{short_text(p.key)}", p.value, p.message,
                    hide_value=p.unknown) for p in option_problems(ds.name, ds.options)]


def _k_size_problems(spec: Spec) -> list[Problem]:
    """A fixed ``partition.k`` larger than what it splits, where the dataset's size is
    known without loading it (generated datasets): a sage/gat batch's output nodes, or
    revgnn's graph nodes."""
    from betty.data.options import generated_config

    k, ds = spec.partition.k, spec.dataset
    config = generated_config(ds.name, ds.options) if _int(k) else None
    if config is None:
        return []
    if spec.model.arch == "revgnn":
        limit, what = config.scaled_num_nodes, "the graph's nodes"
    else:
        size = spec.sampling.batch_size
        limit = config.scaled_num_train if size == "full" else min(size, config.scaled_num_train)
        what = "a batch's output nodes"
    if k <= limit:
        return []
    return [Problem("partition.k", k, f"is larger than {what} ({limit:,} for this dataset); "
                    f"allowed: an integer from {1 if spec.model.arch == 'revgnn' else spec.train.world_size} "
                    f"to {limit:,}, or 'auto'")]


def _path_problems(ds: DatasetSection) -> list[Problem]:
    """``dataset.root`` (and dgl-file's ``path``) must not be on a pseudo-filesystem;
    ``root``, where it exists, must be a folder, and an existing dgl-file ``path`` a
    ``dgl.save_graphs`` file (checked by its header, nothing else is read)."""
    from pathlib import Path

    from betty.data.names import is_dgl_file

    out = []
    paths = [("dataset.root", ds.root)]
    if ds.name == "dgl-file" and isinstance(ds.options.get("path"), str):
        paths.append(("dataset.path", ds.options["path"]))
    for key, value in paths:
        try:
            resolved = Path(value).expanduser().resolve()
        except (RuntimeError, ValueError, OSError) as err:  # ~nosuchuser, a NUL byte
            out.append(Problem(key, value, f"is not a usable path ({err}); allowed: a path on a real disk"))
            continue
        shm = resolved == Path("/dev/shm") or Path("/dev/shm") in resolved.parents
        if not shm and any(resolved == Path(p) or Path(p) in resolved.parents for p in PSEUDO_FILESYSTEMS):
            out.append(Problem(key, value, f"is on a pseudo-filesystem ({', '.join(PSEUDO_FILESYSTEMS)})"
                               "; allowed: a path on a real disk"))
        elif key == "dataset.root" and resolved.exists() and not resolved.is_dir():
            out.append(Problem(key, value, "is not a folder; allowed: the folder holding the "
                               "dataset files and betty's cache (created if missing)"))
        elif key == "dataset.path" and resolved.exists() and not is_dgl_file(resolved):
            out.append(Problem(key, value, "is not a dgl.save_graphs file (its header is not DGL's); "
                               "allowed: a file written by dgl.save_graphs"))
    return out


def changed_keys(section: BaseModel) -> set[str]:
    """Keys a spec gives with a value other than their default (a default value written
    out explicitly is harmless)."""
    fields = type(section).model_fields
    return {k for k in section.model_fields_set
            if k in fields and getattr(section, k) != fields[k].get_default(call_default_factory=True)}


def _given(path: str, section: BaseModel, keys: Sequence[str], message: str) -> list[Problem]:
    """A problem saying ``message`` for each of ``keys`` that ``section`` (at ``path``)
    gives a value other than its default (:func:`changed_keys`), in the order of ``keys``."""
    changed = changed_keys(section)
    return [Problem(f"{path}.{key}", getattr(section, key), message) for key in keys if key in changed]


def _sampled_problems(spec: Spec) -> list[Problem]:
    """Rules of the sampled-block archs (``sage``, ``gat``, ``gcn``)."""
    m, ev, out = spec.model, spec.evaluate, []
    if m.arch == "gcn" and spec.dataset.options.get("self_loops") is True:  # the layer adds its own
        out.append(Problem("dataset.self_loops", True,
                           "is not allowed with model.arch gcn: the GCN layer adds every node's "
                           "self term itself (a self-loop edge would count it twice); allowed: false"))
    if "heads" in changed_keys(m) and m.arch != "gat":
        out.append(Problem("model.heads", m.heads,
                           "applies to model.arch gat (or revgnn with conv gat) only"))
    if m.arch == "gat" and m.hidden * m.heads > MAX_WIDTH:
        out.append(Problem("model.hidden", m.hidden, f"times model.heads = {m.heads} is "
                           f"{m.hidden * m.heads:,}; allowed: a product up to {MAX_WIDTH}"))
    if spec.sampling.fanouts is None:
        out.append(Problem("sampling.fanouts", None, "required key is missing (one fanout per "
                           "layer, input layer first)", missing=True))
    for path, fanouts in (("sampling.fanouts", spec.sampling.fanouts), ("evaluate.fanouts", ev.fanouts)):
        if fanouts is not None and len(fanouts) != m.layers:
            out.append(Problem(path, fanouts,
                               f"has {len(fanouts)} entries but model.layers is {m.layers}; "
                               "give one fanout per layer, input layer first"))
    on = spec.sampling.device
    if on.startswith("cuda"):
        if spec.train.device not in ("auto", on) and not {spec.train.device, on} <= {"cuda", "cuda:0"}:
            out.append(Problem("sampling.device", on, f"prepares batches on the training device; "
                               f"allowed with train.device {spec.train.device!r}: 'host', 'cpu' or "
                               f"train.device itself"))
        if spec.train.pipeline:
            out.append(Problem("train.pipeline", True, f"must be false with sampling.device {on!r}: "
                               f"each batch is prepared on the device when its step starts (a batch "
                               f"prepared ahead would hold device memory beside the step's)"))
    if ev.inference == "multiview":
        out.append(Problem("evaluate.inference", ev.inference, "applies to model.arch revgnn only; "
                           "allowed here: full, sampled"))
    out += _given("evaluate", ev, ("views", "parts"), "applies to evaluate.inference multiview "
                  "(model.arch revgnn) only")
    return out


_REVGNN_NOT_SAMPLED = ("revgnn samples no neighbourhoods: each step runs on the whole graph "
                       "or on partition.k cluster parts")


def _revgnn_problems(spec: Spec) -> list[Problem]:
    """Rules of ``revgnn`` (reversible blocks keep the node set: no sampled blocks)."""
    m, s, p, ev, out = spec.model, spec.sampling, spec.partition, spec.evaluate, []
    changed = changed_keys(m)
    if "heads" in changed and m.conv != "gat" and m.heads != 1:
        out.append(Problem("model.heads", m.heads, f"applies to model.conv gat only (model.conv "
                           f"is {m.conv!r}); allowed otherwise: 1"))
    if m.norm == "batch" and spec.train.world_size > 1:
        out.append(Problem("model.norm", m.norm, f"is not allowed with train.world_size "
                           f"{spec.train.world_size}: each rank would update the running statistics "
                           "from its own parts only; allowed: layer, none"))
    if m.reversible and m.checkpoint and not m.deq:
        out.append(Problem("model.checkpoint", m.checkpoint, "applies to model.reversible: false "
                           "(the residual network); reversible blocks keep no activations"))
    if m.deq:
        out += _given("model", m, ("reversible", "checkpoint", "weight_tied"), "does not apply with model.deq: "
                      "true (one weight-tied cell solved to a fixed point)")
        if m.norm == "batch":
            out.append(Problem("model.norm", m.norm, "allowed with model.deq: true: layer, none"))
        if p.k == "auto":
            out.append(Problem("partition.k", p.k, "'auto' needs the reversible memory estimator "
                               "(betty.rev.memory), which does not model model.deq: true; allowed: "
                               "an integer >= 1"))
        elif p.memory_budget is not None:
            out.append(Problem("partition.memory_budget", p.memory_budget, "needs the reversible "
                               "memory estimator (betty.rev.memory), which does not model model.deq: "
                               "true, so no split would be held to it; allowed: null"))
    else:
        out += _given("model", m, ("deq_max_iter", "deq_tol"), "applies to model.deq: true only "
                      "(the fixed-point solves)")
    if not m.deq and m.hidden % m.groups:
        out.append(Problem("model.hidden", m.hidden,
                           f"must be divisible by model.groups = {m.groups} (channels are split into groups)"))
    out += _given("sampling", s, ("batch_size",), f"applies to sage/gat/gcn only ({_REVGNN_NOT_SAMPLED}); "
                  "allowed: full")
    allowed = ", ".join(catalog.CLUSTER_METHODS)
    if "method" in p.model_fields_set and p.method not in catalog.CLUSTER_METHODS:
        out.append(Problem("partition.method", p.method, "revgnn splits the graph into induced "
                           f"subgraphs; allowed: {allowed} (random is re-drawn every epoch)"))
    out += _given("partition", p, ("balance", "reuse", "time_limit_s", "deterministic", "partitioner"),
                  "applies to sage/gat/gcn micro-batches only; revgnn re-draws random clusters every "
                  "epoch and keeps METIS clusters for the run")
    for i, method in enumerate(p.sweep.methods or []):
        if method not in catalog.CLUSTER_METHODS:
            out.append(Problem(f"partition.sweep.methods[{i}]", method, f"allowed for revgnn: {allowed}"))
    if ev.inference == "sampled":
        out.append(Problem("evaluate.inference", ev.inference,
                           "revgnn has no sampled inference; allowed: full, multiview"))
    if spec.train.precision.endswith("-mixed"):
        out.append(Problem("train.precision", spec.train.precision, "is not supported for model.arch "
                           "revgnn: its backward rebuilds each block's input by inverting the "
                           "coupling, exact only in the forward's own dtype; allowed: 32, 64"))
    out += _given("evaluate", ev, ("chunk_size",), "applies to sage/gat/gcn (layer-wise inference); "
                  "revgnn runs the whole graph (full) or whole parts (multiview)")
    if ev.inference != "multiview":
        out += _given("evaluate", ev, ("views", "parts"), "applies to evaluate.inference multiview only")
    return out


def weight_pickers(spec: Spec) -> list[str]:
    """The keys by which validation scores decide the weights a run keeps:
    ``evaluate.select best_valid`` (the best epoch's) and ``train.early_stopping`` (those
    of the epoch it stops at); empty when the last epoch's weights are kept."""
    return [what for what, on in (("evaluate.select best_valid", spec.evaluate.select == "best_valid"),
                                  ("train.early_stopping", spec.train.early_stopping is not None)) if on]


def _selection_problems(spec: Spec) -> list[Problem]:
    """Best-validation selection and early stopping need validation scores during
    training: ``evaluate.every`` from 1 to ``train.epochs`` (beyond it nothing is scored,
    and the run would silently keep the last weights)."""
    every, epochs = spec.evaluate.every, spec.train.epochs
    needs = weight_pickers(spec)
    if needs and not 1 <= every <= epochs:
        return [Problem("evaluate.every", every, f"must be from 1 to train.epochs = {epochs} with "
                        f"{' and '.join(needs)} (validation is scored every evaluate.every epochs, "
                        "to pick the best epoch and to count the patience)")]
    return []


def _precision_problems(spec: Spec) -> list[Problem]:
    """``train.dtype`` and ``train.precision`` both given must agree: float64 is
    precision 64; float32 is 32, bf16-mixed or 16-mixed."""
    t = spec.train
    if {"dtype", "precision"} <= t.model_fields_set and (t.dtype == "float64") != (t.precision == "64"):
        return [Problem("train.dtype", t.dtype, f"disagrees with train.precision {t.precision!r} (train.dtype "
                        "float64 is train.precision 64; float32 is 32, bf16-mixed or 16-mixed); give "
                        "only train.precision")]
    return []


def _store_problems(spec: Spec) -> list[Problem]:
    """Rules of ``dataset.store``: the DistDGL store serves sampled batches to DGL
    models, its keys apply to it alone."""
    ds, out = spec.dataset, []
    if ds.store == "local":
        return _given("dataset", ds, STORE_KEYS[1:], "applies to dataset.store distributed only")
    if ds.store_ip_config is None:
        out.append(Problem("dataset.store_ip_config", None, "is required with dataset.store distributed: "
                           "a file with one line 'HOST PORT' per machine (the graph server of "
                           "each partition)", missing=True))
    if spec.model.arch == "revgnn":
        out.append(Problem("dataset.store", ds.store, "serves sampled batches; model.arch revgnn trains on "
                           "the whole graph or its cluster parts; allowed archs: sage, gat, gcn"))
    if spec.model.backend == "pyg":
        out.append(Problem("dataset.store", ds.store, "is DistDGL (dgl.distributed): it needs "
                           "model.backend dgl or auto, not pyg"))
    if spec.sampling.device != "host":
        out.append(Problem("sampling.device", spec.sampling.device, "must be host with dataset.store "
                           "distributed (the trainers sample what the servers send)"))
    return out


def check_spec(spec: Spec) -> list[Problem]:
    """Rules spanning several keys (field-level rules live in the models)."""
    dataset_problems = _dataset_problems(spec.dataset)
    out = dataset_problems + _path_problems(spec.dataset) + _store_problems(spec)
    m = spec.model
    # an arch-specific key set to a non-default value under another arch is a mistake
    # (e.g. aggregator: lstm with arch: gat); the default value is harmless
    changed = changed_keys(m)
    for key, archs in _ARCH_ONLY.items():
        if key in changed and m.arch not in archs:
            out.append(Problem(f"model.{key}", getattr(m, key),
                               f"applies to model.arch {' or '.join(archs)} only (model.arch is {m.arch!r})"))
    out.extend(_revgnn_problems(spec) if m.arch == "revgnn" else _sampled_problems(spec))
    p = spec.partition
    if p.k == "auto" and p.memory_budget is None:
        out.append(Problem("partition.memory_budget", None,
                           "is required when partition.k is 'auto'; allowed: " + BYTE_SIZE_HELP,
                           missing=True))
    world = spec.train.world_size
    if isinstance(p.k, int) and p.k < world and m.arch != "revgnn":  # revgnn: ranks beyond K wait
        out.append(Problem("partition.k", p.k,
                           f"is below train.world_size {world}: training on N ranks splits each batch "
                           f"into K >= N micro-batches so that every rank has one; allowed: an integer "
                           f">= {world}, or 'auto' (the K search then starts at K = {world})"))
    out.extend(_selection_problems(spec))
    if spec.train.weight_decay_first_layer_only and spec.train.weight_decay == 0:
        out.append(Problem("train.weight_decay_first_layer_only", True, "needs train.weight_decay > 0 "
                           "(the decay it restricts to the first layer)"))
    out.extend(_precision_problems(spec))
    if not dataset_problems:  # the dataset's size is known only from valid options
        out.extend(_k_size_problems(spec))
    if spec.evaluate.fanouts is not None and spec.evaluate.inference != "sampled":
        out.append(Problem("evaluate.fanouts", spec.evaluate.fanouts,
                           "applies to evaluate.inference 'sampled' only"))
    return out


def spec_notes(spec: Spec) -> list[str]:
    """Harmless but noteworthy things in a valid spec (shown by ``betty validate`` and
    logged by the stage concerned): keys that are accepted but not used."""
    notes, m = [], spec.model
    if m.arch == "revgnn" and spec.sampling.fanouts is not None:
        notes.append(f"sampling.fanouts = {spec.sampling.fanouts!r} is ignored: {_REVGNN_NOT_SAMPLED} "
                     "(accepted so that a sage/gat/gcn spec tries revgnn without removing them)")
    if m.arch == "revgnn" and m.deq:
        for key in ("layers", "groups"):
            if key in changed_keys(m):
                notes.append(f"model.{key} = {getattr(m, key)!r} is ignored with model.deq: true (one "
                             "weight-tied cell of width model.hidden solved to a fixed point)")
    return notes


def with_arch_defaults(spec: Spec) -> Spec:
    """``spec`` with the defaults that depend on the arch filled in for keys it leaves
    out: ``revgnn`` gets ``model.heads: 1`` and ``partition.method: random``."""
    if spec.model.arch != "revgnn":
        return spec
    update = {}
    if "heads" not in spec.model.model_fields_set:
        update["model"] = spec.model.model_copy(update={"heads": 1})
    if "method" not in spec.partition.model_fields_set:
        update["partition"] = spec.partition.model_copy(update={"method": "random"})
    return spec.model_copy(update=update) if update else spec
