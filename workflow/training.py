"""The train stage's epochs: one loop for one process and for each of N ranks.

:func:`train_epochs` builds the trainer (:func:`workflow.components.make_trainer`),
trains ``train.epochs`` epochs, scores validation every ``evaluate.every`` epochs and
keeps the selected weights (``evaluate.select``; ``train.early_stopping``:
:class:`betty.selection.BestValidation`). It works alike with ``sage``/``gat``/``gcn``
and ``revgnn``: both trainers yield epoch records with ``metrics()`` and ``rows()``.

``train.world_size: N > 1`` (or ``dataset.store: distributed``): the train stage's
process launches the ranks (:func:`train_distributed`); each runs :func:`train_epochs`
with a :class:`betty.distributed.DataParallel`, the ranks' figures are gathered after
every epoch (:func:`betty.distributed.gather.gather_epoch`: the metric names), rank 0
evaluates and decides an early stop for all, and returns the history and the selected
weights. A failing rank ends the launch with :class:`betty.distributed.launch.RankFailed`
naming it. Metrics: docs/distributed.md.

Host memory: the launching process loads the dataset once and shares its tensors with
its ranks (:func:`betty.distributed.shared.share_dataset`: files in ``/dev/shm`` the
ranks map instead of loading the dataset again); every machine does so for its own ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import torch

from workflow.components import make_selector, make_trainer
from workflow.evaluation import evaluate_model, metric_suffix
from workflow.specfile import ResolvedSpec

__all__ = ["train_epochs", "train_distributed", "rank_train", "launch_options", "launched", "store_folder"]


def launch_options() -> dict[str, Any]:
    """Several machines: ``BETTY_NNODES``, ``BETTY_NODE_RANK``, ``BETTY_RDZV_ENDPOINT``,
    ``BETTY_RUN_ID`` (set by ``betty run --nnodes/--node-rank/--rdzv-endpoint``)."""
    out: dict[str, Any] = {}
    if "BETTY_NNODES" in os.environ:
        out["nnodes"] = int(os.environ["BETTY_NNODES"])
        out["node_rank"] = int(os.environ.get("BETTY_NODE_RANK", "0"))
        out["rdzv_endpoint"] = os.environ.get("BETTY_RDZV_ENDPOINT")
        out["run_id"] = os.environ.get("BETTY_RUN_ID", "betty")
    return out


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
    """Train repeat ``repeat``'s model (see the module docstring): the one epoch loop.

    Args:
        parallel: this rank's :class:`betty.distributed.DataParallel` (``None``: one
            process).
        on_epoch: called on rank 0 with each epoch's ``{"epoch", **metrics}`` and whether
            it is the last one (the last of ``train.epochs``, or an early stop).

    Returns:
        on rank 0 (in one process: always) ``{"history", "rows", "searches",
        "selection", "record", "model"}``: the per-epoch entries, the memory table's rows
        (``repeat`` first; ``rank`` last on N ranks), every K-search result, the
        selection metrics (``best_valid_acc``, ``best_epoch``, ``stopped_epoch``), the
        epoch record type (its ``ROWS_TABLE``, ``ROW_COLUMNS``, ``PIECE``) and the model
        holding the selected weights; ``None`` on the other ranks.
    """
    from betty.distributed.gather import agree, gather_epoch
    from betty.memory.meter import MemoryMeter

    spec = rspec.spec
    meter = MemoryMeter(device) if spec.train.measure_memory else None
    searches: list = []
    trainer, model, optimizer = make_trainer(rspec, dataset, device, repeat=repeat, meter=meter,
                                             on_search=searches.append)
    trainer.parallel = parallel
    if meter is not None:
        meter.track(model, optimizer)
    rank = 0 if parallel is None else parallel.rank
    every, selector = spec.evaluate.every, make_selector(rspec)
    score_key = f"valid_{metric_suffix(dataset)}"
    history, rows, record = [], [], None
    with closing(trainer.epochs(range(spec.train.epochs))) as epochs:
        for epoch in range(spec.train.epochs):
            steps_before = 0
            if parallel is not None:
                steps_before = len(parallel.history)
                _inject_fault(rank, epoch)
            record = next(epochs)
            metrics, pieces = record.metrics(), [{"repeat": repeat, **row} for row in record.rows()]
            if parallel is not None:
                metrics, pieces = gather_epoch(record, parallel, steps_before, metrics, pieces)
            due = bool(every) and (epoch + 1) % every == 0
            if due and rank == 0:
                metrics.update(evaluate_model(model, dataset, rspec, device, splits=("valid",),
                                              train_k=record.k))
                if score_key in metrics:
                    selector.update(epoch, metrics[score_key], model)
            stop = due and selector.should_stop()
            if due and parallel is not None:
                stop = agree(stop)
            if rank == 0:
                history.append({"epoch": epoch, **metrics})
                rows.extend(pieces)
                if on_epoch is not None:
                    on_epoch(history[-1], stop or epoch + 1 == spec.train.epochs)
            if stop:
                break
    if rank != 0:
        return None
    selector.apply(model)
    return {"history": history, "rows": rows, "searches": searches, "selection": selector.metrics(score_key),
            "record": type(record), "model": model}


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
            results = launch(rank_train, (rspec, repeat, shared), nproc=nproc, threads=threads, **options)
    return results.get(0)
