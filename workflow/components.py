"""Library objects built from a resolved spec: device, dataset, model, plan, trainer.

Every stage goes through :func:`make_trainer`, so the ``sample`` and ``partition``
stages see exactly the batch and split the trainer's first epoch uses; ``sampling.seed``
(+ repeat) seeds batches, sampling and partitioning, ``train.seed`` (+ repeat) weights
and dropout.
"""

from __future__ import annotations

import torch

from betty.precision import Precision

from workflow.specfile import ResolvedSpec

__all__ = [
    "uses_revgnn",
    "resolve_device",
    "torch_dtype",
    "spec_precision",
    "feature_dtype",
    "dataset_digest",
    "load_data",
    "build_model",
    "partition_plan",
    "make_trainer",
    "first_batch",
]


def uses_revgnn(rspec: ResolvedSpec) -> bool:
    """Whether the spec's model is ``revgnn``, trained by the RevGNN trainer (whole graph
    or K cluster parts per step, :mod:`betty.rev.engine`) rather than a sampled-block
    model's (:mod:`betty.engine`); true also with ``model.reversible: false``, whose
    blocks run as a residual network on the same trainer."""
    return rspec.spec.model.arch == "revgnn"


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> ``cuda`` when available, else ``cpu``; other names as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"train.device is {name!r} but CUDA is not available here; use 'auto' or 'cpu'")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise RuntimeError(f"train.device is {name!r} but this machine has {torch.cuda.device_count()} "
                           f"CUDA device(s): cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


def torch_dtype(rspec: ResolvedSpec) -> torch.dtype:
    """The parameters' dtype: ``train.dtype`` (float64 for ``train.precision: 64``, else float32)."""
    return {"float32": torch.float32, "float64": torch.float64}[rspec.spec.train.dtype]


def spec_precision(rspec: ResolvedSpec) -> Precision:
    """``train.precision`` as a :class:`betty.precision.Precision`."""
    return Precision.parse(rspec.spec.train.precision)


def feature_dtype(rspec: ResolvedSpec) -> torch.dtype:
    """``dataset.feature_dtype`` as a torch dtype."""
    return getattr(torch, rspec.spec.dataset.feature_dtype)


def spec_threads(rspec: ResolvedSpec, work_edges: int | None = None, *, ranks: int | None = None) -> int | None:
    """``train.threads`` as a count (:func:`betty.threads.resolve_threads`)."""
    from betty.threads import resolve_threads

    return resolve_threads(rspec.spec.train.threads, work_edges, ranks=ranks)


def configure_threads(rspec: ResolvedSpec, work_edges: int | None = None) -> None:
    """Apply ``train.threads`` and ``train.prep_workers`` (:func:`betty.workers.configure_threads`;
    ``auto`` sized for ``work_edges``)."""
    from betty.workers import configure_threads as configure

    configure(rspec.spec.train.threads, rspec.spec.train.prep_workers, work_edges=work_edges)


def dataset_digest(rspec: ResolvedSpec) -> str:
    """The digest of the spec's dataset content (:func:`betty.data.dataset_digest`: name,
    options and the source files' sizes and times; reads no data)."""
    from betty.data import dataset_digest as digest

    ds = rspec.spec.dataset
    return digest(ds.name, ds.root, **rspec.dataset_options)


def load_data(rspec: ResolvedSpec):
    """The spec's dataset via :func:`betty.data.load_dataset` (cached under root), its
    features in ``dataset.feature_dtype``: the option reaches the loader, so a
    bfloat16 or float16 cache entry holds them in that dtype and they are
    memory-mapped, never converted from float32. Every stage and command starts
    here, so it also applies ``train.threads`` (``auto`` once more after loading, sized
    by the graph's edges)."""
    configure_threads(rspec)
    from betty.data import load_dataset

    ds = rspec.spec.dataset
    dataset = load_dataset(ds.name, ds.root, **rspec.dataset_options)
    if dataset.feat.dtype != feature_dtype(rspec):  # a guard: load_dataset gives this dtype
        dataset.feat = dataset.feat.to(feature_dtype(rspec))
    configure_threads(rspec, dataset.num_edges)
    return dataset


def build_model(rspec: ResolvedSpec, dataset, *, seed: int | None = None) -> torch.nn.Module:
    """The spec's model for ``dataset`` (weights seeded by ``seed``, default
    ``train.seed``), in the spec's dtype, on the CPU."""
    from betty import models

    m = rspec.spec.model
    torch.manual_seed(rspec.spec.train.seed if seed is None else seed)
    model = models.build_model(m.arch, dataset.num_features, dataset.num_classes,
                               **m.model_dump(exclude={"arch"}))  # every other model key is an argument
    return model.to(torch_dtype(rspec))


def partition_plan(rspec: ResolvedSpec):
    """``betty.engine.PartitionPlan`` (``sage``/``gat``) or ``betty.rev.engine.RevPlan``
    (``revgnn``) of the spec's ``partition`` section; with ``train.world_size: N`` the K
    search starts at N (so the partition stage reports the K the ranks will use)."""
    p = rspec.spec.partition
    if uses_revgnn(rspec):
        from betty.rev.engine import RevPlan

        return RevPlan(method=p.method, k=p.k, memory_budget=p.memory_budget,
                       safety_margin=p.safety_margin)
    from betty.engine import PartitionPlan

    return PartitionPlan(method=p.method, k=p.k, reuse=p.reuse, balance=p.balance,
                         memory_budget=p.memory_budget, safety_margin=p.safety_margin,
                         options=partition_options(rspec), min_k=rspec.spec.train.world_size)


def partition_options(rspec: ResolvedSpec) -> dict:
    """The ``options`` of ``betty.partition.partition_batch`` set by the spec
    (``partition.time_limit_s``, ``partition.deterministic``, ``partition.partitioner``,
    ``train.threads``: the hypergraph's threads and, for KaMinPar, the trainer's share of
    the cores)."""
    p = rspec.spec.partition
    threads = spec_threads(rspec)
    return {"time_limit_s": p.time_limit_s, "deterministic": p.deterministic,
            "threads": threads, "partitioner": p.partitioner, "trainer_threads": threads}


def make_trainer(rspec: ResolvedSpec, dataset, device, *, repeat: int = 0, meter=None,
                 on_search=None):
    """``(trainer, model, optimizer)`` for repeat ``repeat``: a fresh model (weights
    seeded by ``train.seed + repeat``) on ``device`` and a :class:`betty.engine.Trainer`
    (``revgnn``: a :class:`betty.rev.engine.RevTrainer`) seeded by ``sampling.seed +
    repeat``. The trainer builds the memory estimator and, for ``partition.k: auto``,
    the K search itself; ``on_search`` receives every K-search result."""
    from betty.engine import Trainer
    from betty.rev.engine import RevTrainer
    from betty.train import build_optimizer, parameter_groups

    t, s = rspec.spec.train, rspec.spec.sampling
    model = build_model(rspec, dataset, seed=t.seed + repeat).to(device)
    groups = parameter_groups(model, t.weight_decay, t.weight_decay_first_layer_only)
    optimizer = build_optimizer(t.optimizer, groups, lr=t.lr, weight_decay=t.weight_decay)
    common = dict(device=device, seed=s.seed + repeat, dropout_seed=t.seed + repeat,
                  dtype=torch_dtype(rspec), precision=spec_precision(rspec), meter=meter, on_search=on_search,
                  prefetch=t.prefetch if t.pipeline else 0)
    if uses_revgnn(rspec):
        trainer = RevTrainer(model, optimizer, dataset, partition_plan(rspec),
                             dropout_mode=rspec.spec.model.dropout_mode, **common)
    else:
        trainer = Trainer(model, optimizer, dataset, s.fanouts, partition_plan(rspec),
                          batch_size=None if s.batch_size == "full" else s.batch_size,
                          sample_device=sample_device(rspec), **common)
    return trainer, model, optimizer


def sample_device(rspec: ResolvedSpec) -> str | None:
    """``sampling.device`` as the Trainer's ``sample_device`` (``host``: None)."""
    device = rspec.spec.sampling.device
    return None if device == "host" else device


def first_batch(rspec: ResolvedSpec, dataset):
    """The full batch the trainer samples first (epoch 0, batch 0): a ``SampledBatch``
    (``sage``/``gat`` only: ``revgnn`` samples nothing)."""
    if uses_revgnn(rspec):
        raise ValueError("model.arch revgnn samples no batches: it trains on the whole graph or "
                         "on partition.k cluster parts (betty.rev.engine.RevTrainer.split)")
    trainer, _, _ = make_trainer(rspec, dataset, resolve_device(rspec.spec.train.device))
    return trainer.sample(0, 0)


def make_selector(rspec: ResolvedSpec):
    """The run's :class:`betty.selection.BestValidation` (``evaluate.select``,
    ``train.early_stopping.patience``)."""
    from betty.selection import BestValidation

    stopping = rspec.spec.train.early_stopping
    return BestValidation(rspec.spec.evaluate.select, None if stopping is None else stopping.patience)
