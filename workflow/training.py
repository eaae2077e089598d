"""The train stage's epochs, on one process or N launched ranks.

:func:`train_epochs` builds the spec's trainer (:func:`workflow.components.make_trainer`)
and runs :func:`betty.fit.fit` with the spec's validation, selection and early stopping.
``train.world_size: N > 1`` (or ``dataset.store: distributed``): the train stage's
process launches the ranks (:func:`train_distributed`), each runs :func:`train_epochs`
with a :class:`betty.distributed.DataParallel`, and rank 0's result comes back; a
failing rank ends the launch with :class:`betty.distributed.launch.RankFailed` naming
it. Per-rank metrics: docs/distributed.md.

Host memory: the launching process loads the dataset once and shares its tensors with
its ranks (:func:`betty.distributed.shared.share_dataset`: files in ``/dev/shm`` the
ranks map instead of loading the dataset again); every machine does so for its own ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from betty.evaluation import metric_suffix

from workflow.components import make_selector, make_trainer
from workflow.evaluation import evaluate_model
from workflow.signals import check as check_signals
from workflow.specfile import ResolvedSpec

__all__ = ["train_epochs", "train_distributed", "rank_train", "launch_options", "launched", "store_folder"]


def launch_options() -> dict[str, Any]:
    """Several machines: ``BETTY_NNODES``, ``BETTY_NODE_RANK``, ``BETTY_RDZV_ENDPOINT``,
    ``BETTY_RUN_ID`` (set by ``betty run --nnodes/--node-rank/--rdzv-endpoint``)."""
    out: dict[str, Any] = {}
    if "BETTY_NNODES" in os.environ:
        out["nnodes"] = _env_int("BETTY_NNODES", None, 1)
        out["node_rank"] = _env_int("BETTY_NODE_RANK", "0", 0)
        out["rdzv_endpoint"] = os.environ.get("BETTY_RDZV_ENDPOINT")
        out["run_id"] = os.environ.get("BETTY_RUN_ID", "betty")
    return out


def _env_int(name: str, default: str | None, least: int) -> int:
    """The environment variable ``name`` (else ``default``) as an integer >= ``least``."""
    text = os.environ.get(name, default)
    if text is None or not text.strip().isdigit() or int(text) < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {text!r}")
    return int(text)


def _inject_fault(rank: int, epoch: int) -> None:
    """Testing hook: ``BETTY_FAULT=raise@R`` / ``kill@R`` makes rank R raise / SIGKILL
    itself during its first epoch (the failure tests of tests/test_workflow_distributed.py)."""
    fault = os.environ.get("BETTY_FAULT")
    if not fault or epoch != 0:
        return
    action, _, target = fault.partition("@")
    if int(target) != rank:
        return
    if action == "raise":
        raise RuntimeError(f"injected failure on rank {rank} (BETTY_FAULT={fault})")
    if action == "kill":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError(f"BETTY_FAULT must be raise@RANK or kill@RANK, got {fault!r}")


def train_epochs(rspec: ResolvedSpec, dataset, device, repeat: int = 0, *, parallel=None,
                 on_epoch: Callable[[dict, bool], None] | None = None) -> dict | None:
    """Train repeat ``repeat``'s model with :func:`betty.fit.fit` (validation every
    ``evaluate.every`` epochs, ``evaluate.select``, ``train.early_stopping``).

    Args:
        parallel: this rank's :class:`betty.distributed.DataParallel` (``None``: one
            process).
        on_epoch: called on rank 0 with each epoch's ``{"epoch", **metrics}`` and whether
            it is the last one.

    Returns:
        on rank 0 (in one process: always) ``{"history", "rows", "searches",
        "selection", "record", "model"}``: :class:`betty.fit.FitResult`'s fields (rows
        labelled with ``repeat``), every K-search result and the model holding the
        selected weights; ``None`` on the other ranks.
    """
    from betty.fit import fit
    from betty.memory.meter import MemoryMeter

    spec = rspec.spec
    meter = MemoryMeter(device) if spec.train.measure_memory else None
    searches: list = []
    trainer, model, optimizer = make_trainer(rspec, dataset, device, repeat=repeat, meter=meter,
                                             on_search=searches.append)
    trainer.parallel = parallel
    if meter is not None:
        meter.track(model, optimizer)

    def validate(epoch: int, k: int) -> dict[str, float]:
        return evaluate_model(model, dataset, rspec, device, splits=("valid",), train_k=k)

    def before_epoch(epoch: int) -> None:
        check_signals()  # one whose KeyboardInterrupt a callback swallowed (a finalizer's)
        if parallel is not None:
            _inject_fault(parallel.rank, epoch)

    result = fit(trainer, spec.train.epochs, validate=validate, every=spec.evaluate.every,
                 selector=make_selector(rspec), score_key=f"valid_{metric_suffix(dataset)}",
                 on_epoch=on_epoch, before_epoch=before_epoch, row_labels={"repeat": repeat})
    if result is None:
        return None
    return {"history": result.history, "rows": result.rows, "searches": searches,
            "selection": result.selection, "record": result.record, "model": model}


def launched(rspec: ResolvedSpec) -> bool:
    """Whether the train stage runs its epochs in launched ranks
    (:func:`train_distributed`): several of them, or the trainers of a distributed
    graph store (``dataset.store: distributed``), which join its servers."""
    spec = rspec.spec
    return spec.train.world_size > 1 or spec.dataset.store == "distributed"


def rank_train(rspec: ResolvedSpec, repeat: int, shared=None, store: str | None = None) -> dict | None:
    """One rank's :func:`train_epochs` (module-level: the launcher pickles it).
    ``shared``: the launcher's :class:`betty.distributed.shared.SharedDataset`;
    ``store``: the folder of a DistDGL partitioning whose servers this rank joins
    (:func:`betty.backends.distdgl.connect`, and leaves once trained); neither: load the
    dataset here. Returns rank 0's result with the selected weights as ``state`` (CPU
    tensors) instead of the model; ``None`` elsewhere."""
    from betty.distributed import DataParallel
    from betty.distributed.launch import rank_device
    from workflow.components import configure_threads, load_data, resolve_device

    if store is not None:
        from betty.backends.distdgl import connect, read_layout

        dataset = connect(read_layout(store))
        configure_threads(rspec, dataset.num_edges)
    elif shared is None:
        dataset = load_data(rspec)
    else:
        dataset = shared.attach()
        configure_threads(rspec, dataset.num_edges)
    device = rank_device() if resolve_device(rspec.spec.train.device).type == "cuda" else torch.device("cpu")
    out = train_epochs(rspec, dataset, device, repeat, parallel=DataParallel())
    if store is not None:
        dataset.close()  # after training only: a failing trainer's servers are stopped by the launcher
    if out is not None:
        out["state"] = {k: v.detach().cpu() for k, v in out.pop("model").state_dict().items()}
    return out


def store_folder(rspec: ResolvedSpec, machines: int) -> Path:
    """The DistDGL partitioning of the spec's dataset for ``machines`` machines:
    ``dataset.store_folder``, or ``<root>/distdgl/<dataset>-<options hash>-<machines>``."""
    ds = rspec.spec.dataset
    if ds.store_folder is not None:
        return Path(ds.store_folder)
    key = hashlib.sha256(json.dumps(rspec.dataset_options, sort_keys=True).encode()).hexdigest()[:12]
    return Path(ds.root) / "distdgl" / f"{ds.name}-{key}-{machines}"


def _launch_on_store(rspec: ResolvedSpec, repeat: int, dataset, nproc: int, options: dict) -> dict:
    """:func:`betty.backends.distdgl.launch`: this machine's graph server beside its
    ``nproc`` ranks, on the partitioning node 0 writes where it is missing (from
    ``dataset``, or the dataset loaded here) and the other machines wait for."""
    from betty.backends.distdgl import ensure_partitions, launch
    from workflow.components import load_data, spec_threads

    ds = rspec.spec.dataset
    nnodes, node_rank = options.get("nnodes", 1), options.get("node_rank", 0)
    layout = ensure_partitions(lambda: dataset if dataset is not None else load_data(rspec),
                               store_folder(rspec, nnodes), nnodes, method=ds.store_method,
                               write=node_rank == 0, dataset=ds.name)
    threads = spec_threads(rspec, layout.num_edges, ranks=nproc) or 1
    check_signals()  # the ranks never see a signal this process recorded
    return launch(rank_train, (rspec, repeat, None, str(layout.folder)), layout=layout,
                  ip_config=ds.store_ip_config, nproc=nproc, threads=threads, **options)


def train_distributed(rspec: ResolvedSpec, repeat: int = 0, dataset=None) -> dict | None:
    """Launch ``train.world_size`` ranks on this machine (or this node's share, see
    :func:`launch_options`) and return rank 0's result (``None`` on nodes without it).
    ``dataset``: the spec's dataset if this process holds it already (else loaded
    here); its tensors are shared with the ranks, not loaded again by each."""
    from betty.distributed.launch import launch
    from betty.distributed.shared import share_dataset
    from workflow.components import load_data, spec_threads

    options = launch_options()
    if "run_id" in options:  # one rendezvous per repeat: a store of the last one may linger
        options["run_id"] = f"{options['run_id']}-repeat{repeat}"
    nnodes = options.get("nnodes", 1)
    world = rspec.spec.train.world_size
    if world % nnodes:
        raise ValueError(f"train.world_size={world} is not a multiple of the {nnodes} nodes")
    nproc = world // nnodes
    if rspec.spec.dataset.store == "distributed":
        results = _launch_on_store(rspec, repeat, dataset, nproc, options)
    else:
        dataset = dataset if dataset is not None else load_data(rspec)
        with share_dataset(dataset) as shared:
            threads = spec_threads(rspec, dataset.num_edges, ranks=nproc) or 1
            check_signals()  # the ranks never see a signal this process recorded
            results = launch(rank_train, (rspec, repeat, shared), nproc=nproc, threads=threads, **options)
    return results.get(0)
