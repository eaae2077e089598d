"""The train stage's epochs: one loop for one process and for each of N ranks.

:func:`train_epochs` builds the trainer (:func:`workflow.components.make_trainer`),
trains ``train.epochs`` epochs, scores validation every ``evaluate.every`` epochs and
keeps the selected weights (``evaluate.select``; ``train.early_stopping``:
:class:`betty.selection.BestValidation`). It works alike with ``sage``/``gat``/``gcn``
and ``revgnn``: both trainers yield epoch records with ``metrics()`` and ``rows()``.

``train.world_size: N > 1``: the process that holds the MLflow run (the train stage)
launches N ranks with :func:`betty.distributed.launch.launch`
(:func:`train_distributed`); each rank runs :func:`train_epochs` with a
:class:`betty.distributed.DataParallel` (the same trainer, same seeds, its share of each
step's pieces). After every epoch the ranks all-gather their figures
(:func:`_gather_ranks`); rank 0 evaluates when due and returns the whole history and the
selected weights (an early stop is rank 0's decision, broadcast so that every rank
leaves after the same epoch), which the stage logs: the usual per-epoch contract
(``loss``, ``train_acc`` are the full-batch ones; peak memory is the maximum over ranks,
``time_compute_s`` the slowest rank's, ``time_idle_s`` the most idle rank's; the other
timers are rank 0's) plus, per rank r, ``peak_mem_measured_bytes.rank<r>``,
``peak_mem_estimated_bytes.rank<r>``, ``time_compute_s.rank<r>``, ``time_idle_s.rank<r>``,
``allreduce_wait_s.rank<r>``, ``host_rss_peak_bytes.rank<r>`` (the rank's peak resident
memory on the host), ``host_pss_bytes.rank<r>`` (its proportional set size at the end of
the epoch: pages shared with the other ranks are divided among them), and
``allreduce_bytes`` (gradient payload per rank per epoch) and ``world_size``. A failing
rank raises ``ChildFailedError`` naming it, and the stage's run ends FAILED with that
message.

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

from betty.records import estimate_error
from workflow.components import make_selector, make_trainer
from workflow.evaluation import evaluate_model, metric_suffix
from workflow.specfile import ResolvedSpec

__all__ = ["PER_RANK_METRICS", "RankFailed", "train_epochs", "train_distributed", "rank_train",
           "launch_options", "launched", "store_folder"]

PER_RANK_METRICS = ("peak_mem_measured_bytes", "peak_mem_estimated_bytes", "time_compute_s",
                    "time_idle_s", "allreduce_wait_s", "host_rss_peak_bytes", "host_pss_bytes")


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
                metrics, pieces = _gather_ranks(record, parallel, steps_before, metrics, pieces)
            due = bool(every) and (epoch + 1) % every == 0
            if due and rank == 0:
                metrics.update(evaluate_model(model, dataset, rspec, device, splits=("valid",),
                                              train_k=record.k))
                if score_key in metrics:
                    selector.update(epoch, metrics[score_key], model)
            stop = due and selector.should_stop()
            if due and parallel is not None:
                stop = _stop_together(stop)
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


def _gather_ranks(record, parallel, steps_before: int, metrics: dict,
                  rows: list[dict]) -> tuple[dict | None, list[dict] | None]:
    """Every rank's figures of this epoch, all-gathered (see the module docstring): on
    rank 0 the epoch's ``metrics`` with the ranks' combined and per-rank figures, and
    every rank's ``rows`` (each with its ``rank``); ``(None, None)`` on the others."""
    import torch.distributed as dist

    from betty.distributed.shared import memory_of_process

    stats = parallel.history[steps_before:]
    compute = sum(s.time_compute_s for s in stats)
    host = memory_of_process()
    mine = {"peak_mem_measured_bytes": record.peak_mem_measured_bytes,
            "peak_mem_estimated_bytes": record.peak_mem_estimated_bytes,
            "time_compute_s": compute, "time_idle_s": max(0.0, record.epoch_time_s - compute),
            "allreduce_wait_s": sum(s.reduce.wait_s for s in stats),
            "allreduce_bytes": float(sum(s.reduce.bytes for s in stats)),
            "host_rss_peak_bytes": host["rss_peak_bytes"], "host_pss_bytes": host.get("pss_bytes")}
    gathered: list = [None] * parallel.world_size
    dist.all_gather_object(gathered, (mine, [{**row, "rank": parallel.rank} for row in rows]))
    if parallel.rank != 0:
        return None, None
    figures = [fig for fig, _ in gathered]
    rows = [row for _, rank_rows in gathered for row in rank_rows]
    for key in ("peak_mem_measured_bytes", "peak_mem_estimated_bytes"):
        values = [fig[key] for fig in figures if fig[key] is not None]
        if values:
            metrics[key] = float(max(values))
    error = estimate_error((r.get("estimated_bytes"), r.get("peak_bytes")) for r in rows)
    if error is not None:
        metrics["mem_estimate_error"] = error
    metrics["time_compute_s"] = max(fig["time_compute_s"] for fig in figures)
    metrics["time_idle_s"] = max(fig["time_idle_s"] for fig in figures)  # the most idle rank
    metrics["allreduce_bytes"] = figures[0]["allreduce_bytes"]
    metrics["world_size"] = float(parallel.world_size)
    for r, fig in enumerate(figures):
        for key in PER_RANK_METRICS:
            if fig[key] is not None:
                metrics[f"{key}.rank{r}"] = float(fig[key])
    return metrics, rows


def _stop_together(stop: bool) -> bool:
    """Rank 0's early-stopping decision, on every rank (so all ranks leave the loop
    after the same epoch)."""
    import torch.distributed as dist

    decision = [stop]
    dist.broadcast_object_list(decision, src=0)
    return bool(decision[0])


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
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    nproc = world // nnodes
    try:
        if rspec.spec.dataset.store == "distributed":
            results = _launch_on_store(rspec, repeat, dataset, nproc, options)
        else:
            dataset = dataset if dataset is not None else load_data(rspec)
            with share_dataset(dataset) as shared:
                threads = spec_threads(rspec, dataset.num_edges, ranks=nproc) or 1
                results = launch(rank_train, (rspec, repeat, shared), nproc=nproc, threads=threads, **options)
    except ChildFailedError as exc:
        raise RankFailed(describe_failures(exc)) from exc
    return results.get(0)


class RankFailed(RuntimeError):
    """A rank of a distributed training failed (the message names it and its error)."""


def describe_failures(exc) -> str:
    """``"rank 1 failed: RuntimeError: ..."`` / ``"rank 1 was killed by SIGKILL"`` for
    every failed rank of a ``ChildFailedError`` (first failure first). A rank that
    recorded its error and then died of a signal on the way out (a DistDGL client left
    without its exit aborts) is named by its error."""
    parts = []
    for rank, failure in sorted(exc.failures.items(), key=lambda kv: kv[1].timestamp):
        recorded = bool(failure.error_file) and os.path.isfile(failure.error_file)  # the rank wrote its error
        if failure.exitcode is not None and failure.exitcode < 0 and not recorded:
            parts.append(f"rank {rank} was killed by {failure.signal_name()}")
        else:
            message = failure.message
            if isinstance(message, dict):  # the error file's {"message": ..., "extraInfo": ...}
                message = message.get("message", message)
            message = str(message or f"exit code {failure.exitcode}").strip()
            parts.append(f"rank {rank} failed: {message.splitlines()[0]}")
    return "; ".join(parts) or str(exc)


def _parameters(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _one_step(rspec: ResolvedSpec, k: int, device, parallel=None) -> tuple[dict, dict]:
    """(parameters before, after) epoch 0 of the spec with K = ``k`` pieces per batch
    (``sage``/``gat``; same seeds, so the same batch, partition seed and dropout)."""
    from workflow.components import load_data

    trainer, model, _ = make_trainer(rspec, load_data(rspec), device, meter=None)
    trainer.plan.k = k
    trainer.parallel = parallel
    before = _parameters(model)
    trainer.train_epoch(0)
    return before, _parameters(model)


def rank_verify(rspec: ResolvedSpec, ks: list[int]) -> dict[int, dict] | None:
    """On each rank: parameters after epoch 0 at every K (module-level for the launcher)."""
    import torch.distributed as dist

    from betty.distributed import DataParallel

    out = {k: _one_step(rspec, k, torch.device("cpu"), DataParallel(check_every=1))[1] for k in ks}
    return out if dist.get_rank() == 0 else None


def verify_distributed(rspec: ResolvedSpec, ks: list[int], nproc: int, tol: float | None = None) -> dict:
    """The N-rank update of epoch 0 at each K against the single-process full-batch
    (K = 1) update: ``{"world_size", "dtype", "tolerance", "results": [{"k",
    "max_rel_update_diff", "ok"}], "ok"}``."""
    from betty.distributed.launch import launch
    from betty.distributed.verify import update_difference, update_tolerance
    from workflow.components import spec_precision, spec_threads, torch_dtype

    before, reference = _one_step(rspec, 1, torch.device("cpu"))
    ranks = launch(rank_verify, (rspec, ks), nproc=nproc, threads=spec_threads(rspec, ranks=nproc) or 1)[0]
    tol = update_tolerance(torch_dtype(rspec), spec_precision(rspec)) if tol is None else tol
    results = [{"k": k, "max_rel_update_diff": update_difference(before, reference, ranks[k])} for k in ks]
    for row in results:
        row["ok"] = row["max_rel_update_diff"] <= tol
    return {"world_size": nproc, "dtype": rspec.spec.train.dtype,
            "precision": rspec.spec.train.precision, "tolerance": tol,
            "results": results, "ok": all(r["ok"] for r in results)}
