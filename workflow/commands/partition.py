"""``betty partition SPEC --k 8 --method hypergraph``: split one sampled batch."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from workflow.commands._common import JsonOpt, SetOpt, SpecArg, cli_errors, emit_json, load
from workflow.progress import format_number

REPORT_KEYS = ("method", "k", "redundancy", "redundancy_per_layer", "imbalance", "time_build_s",
               "time_partition_s", "time_block_s")


@cli_errors
def partition(spec: SpecArg,
              k: Annotated[Optional[int], typer.Option("--k", min=1, help="Number of micro-batches (default: the spec's).")] = None,
              method: Annotated[Optional[str], typer.Option("--method", help="Partition method (default: the spec's).")] = None,
              save: Annotated[Optional[Path], typer.Option("--save", help="Write DIR/batch.npz with the batch and its groups.")] = None,
              set_: SetOpt = None, json_: JsonOpt = False) -> None:
    """Partition the spec's first sampled batch as training would (same seed, balance)
    and report redundancy, imbalance and the time to build, partition and carve the
    micro-batch blocks. For model.arch revgnn: split the graph into K induced
    subgraphs as the first epoch would and report part sizes, the share of edges kept
    and the estimated peak memory of the largest part (--save writes DIR/parts.npz)."""
    from workflow.artifacts import save_batch
    from workflow.components import load_data, make_trainer, resolve_device, uses_revgnn
    from workflow.stages.partition import measure_split

    overrides = list(set_ or [])
    if method:
        overrides.append(f"partition.method={method}")
    if k is not None:
        overrides.append(f"partition.k={k}")
    rspec = load(spec, overrides)
    ds = load_data(rspec)
    trainer, _, _ = make_trainer(rspec, ds, resolve_device(rspec.spec.train.device))
    if uses_revgnn(rspec):
        out = _cluster_report(trainer, save)
        if json_:
            emit_json(out)
            return
        for key, value in out.items():
            typer.echo(f"{key:>22}: {format_number(value)}")
        return
    batch = trainer.sample(0, 0)
    report, result, _ = measure_split(trainer, batch)
    out = {key: report[key] for key in REPORT_KEYS}
    if result.info.get("fallback_from"):  # e.g. hypergraph hit partition.time_limit_s
        out["fallback_from"] = result.info["fallback_from"]
        out["fallback_reason"] = result.info["fallback_reason"]
    if report["time_ksearch_s"] is not None:
        out["time_ksearch_s"] = report["time_ksearch_s"]
    if report["estimated_bytes"]:
        out["peak_mem_estimated_bytes"] = max(report["estimated_bytes"])
    if save is not None:
        out["saved"] = str(save_batch(Path(save) / "batch.npz", batch, result.groups))
    if json_:
        emit_json(out)
        return
    for key, value in out.items():
        typer.echo(f"{key:>22}: {format_number(value)}")


CLUSTER_KEYS = ("method", "k", "part_nodes", "part_edges", "part_train", "edges_kept_fraction",
                "edges_dropped_fraction", "imbalance", "time_partition_s", "time_estimate_s")


def _cluster_report(trainer, save: Optional[Path]) -> dict:
    """The revgnn split of the first epoch (``workflow.revgnn.measure_cluster_split``)."""
    import numpy as np

    from workflow.revgnn import measure_cluster_split

    report, parts = measure_cluster_split(trainer)
    out = {key: report[key] for key in CLUSTER_KEYS}
    if report["time_ksearch_s"] is not None:
        out["time_ksearch_s"] = report["time_ksearch_s"]
    if report["estimated_bytes"]:
        out["peak_mem_estimated_bytes"] = max(report["estimated_bytes"])
    if save is not None:
        labels = np.empty(trainer.dataset.num_nodes, dtype=np.int64)
        for i, part in enumerate(parts):
            labels[part.node_ids.cpu().numpy()] = i
        Path(save).mkdir(parents=True, exist_ok=True)
        np.savez_compressed(Path(save) / "parts.npz", part=labels)
        out["saved"] = str(Path(save) / "parts.npz")
    return out


def register(app: typer.Typer) -> None:
    app.command("partition")(partition)
