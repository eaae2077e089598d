"""One epoch's figures of N ranks, as rank 0 reports them.

Each rank trains its share of every step's micro-batches (:class:`DataParallel`), so its
epoch record holds its own memory peaks, timers and micro-batch rows. :func:`gather_epoch`
all-gathers them; rank 0 gets the epoch's metrics with

* the figures of the whole job: ``peak_mem_measured_bytes`` and
  ``peak_mem_estimated_bytes`` the maximum over ranks, ``mem_estimate_error`` over
  every rank's micro-batches, ``time_compute_s`` (forward and backward of the rank's
  micro-batches, the record's own, as in one process) the slowest rank's, ``time_idle_s``
  the most idle rank's (epoch time less compute), ``allreduce_bytes`` (gradient payload
  per rank per epoch) and ``world_size``; ``loss`` and ``train_acc`` are the full-batch
  ones already;
* per rank ``r``, ``<name>.rank<r>`` for every name of :data:`PER_RANK_METRICS`:
  ``host_rss_peak_bytes`` is the rank's peak resident memory on the host,
  ``host_pss_bytes`` its proportional set size at the end of the epoch (pages shared
  with the other ranks divided among them);

and every rank's rows, each with its ``rank``. The other timers are rank 0's.
"""

from __future__ import annotations

from betty.records import estimate_error

__all__ = ["PER_RANK_METRICS", "gather_epoch"]

PER_RANK_METRICS = ("peak_mem_measured_bytes", "peak_mem_estimated_bytes", "time_compute_s",
                    "time_idle_s", "allreduce_wait_s", "host_rss_peak_bytes", "host_pss_bytes")


def gather_epoch(record, parallel, reduced_before: tuple[int, float], metrics: dict,
                 rows: list[dict]) -> tuple[dict | None, list[dict] | None]:
    """Every rank's figures of this epoch (see the module docstring).

    Args:
        record: this rank's epoch record (``EpochRecord`` or ``RevEpochRecord``).
        parallel: this rank's :class:`betty.distributed.DataParallel`.
        reduced_before: ``(parallel.reduce_bytes, parallel.reduce_wait_s)`` when the
            epoch started (the epoch's all-reduces are what was added since).
        metrics: ``record.metrics()``.
        rows: this rank's micro-batch rows (``record.rows()``, maybe with more keys).

    Returns:
        on rank 0 ``(metrics, rows)`` with the job's and the per-rank figures and every
        rank's rows; ``(None, None)`` on the other ranks.
    """
    import torch.distributed as dist

    from betty.distributed.shared import memory_of_process

    compute = record.time_compute_s  # forward + backward of this rank's micro-batches (the step follows the all-reduce)
    host = memory_of_process()
    mine = {"peak_mem_measured_bytes": record.peak_mem_measured_bytes,
            "peak_mem_estimated_bytes": record.peak_mem_estimated_bytes,
            "time_compute_s": compute, "time_idle_s": max(0.0, record.epoch_time_s - compute),
            "allreduce_wait_s": parallel.reduce_wait_s - reduced_before[1],
            "allreduce_bytes": float(parallel.reduce_bytes - reduced_before[0]),
            "host_rss_peak_bytes": host["rss_peak_bytes"], "host_pss_bytes": host.get("pss_bytes")}
    gathered: list = [None] * parallel.world_size
    dist.all_gather_object(gathered, (mine, [{**row, "rank": parallel.rank} for row in rows]), group=parallel.group)
    if parallel.rank != 0:
        return None, None
    figures = [fig for fig, _ in gathered]
    rows = [row for _, rank_rows in gathered for row in rank_rows]
    metrics = dict(metrics)
    for key in ("peak_mem_measured_bytes", "peak_mem_estimated_bytes"):
        values = [fig[key] for fig in figures if fig[key] is not None]
        if values:
            metrics[key] = float(max(values))
    error = estimate_error((r.get("estimated_bytes"), r.get("peak_bytes")) for r in rows)
    if error is not None:
        metrics["mem_estimate_error"] = error
    metrics["time_compute_s"] = max(fig["time_compute_s"] for fig in figures)
    metrics["time_idle_s"] = max(fig["time_idle_s"] for fig in figures)
    metrics["allreduce_bytes"] = figures[0]["allreduce_bytes"]
    metrics["world_size"] = float(parallel.world_size)
    for r, fig in enumerate(figures):
        for key in PER_RANK_METRICS:
            if fig[key] is not None:
                metrics[f"{key}.rank{r}"] = float(fig[key])
    return metrics, rows

