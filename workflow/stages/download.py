"""Stage ``download``: load (or generate) the dataset offline and cache it under ``root``.

Metrics and ``dataset.json``: docs/workflow.md, *Stages*.
"""

from __future__ import annotations

import time

import mlflow

from workflow.artifacts import write_json
from workflow.checksums import log_artifact
from workflow.runs import log_metrics
from workflow.stages.base import StageContext

__all__ = ["run"]


def run(ctx: StageContext) -> dict[str, float]:
    from betty.data import cache_path

    spec = ctx.rspec.spec
    start = time.perf_counter()
    ds = ctx.dataset()
    took = time.perf_counter() - start
    stats = ds.stats()
    log_metrics({**stats, "time_load_s": took})
    cached = cache_path(spec.dataset.name, spec.dataset.root, **ctx.rspec.dataset_options)
    if cached is not None:
        mlflow.set_tag("dataset_cache", str(cached.resolve()))
    info = {"name": spec.dataset.name, "root": spec.dataset.root, "options": ctx.rspec.dataset_options,
            "cache_file": str(cached.resolve()) if cached is not None else None,
            "is_ogb": ds.is_ogb, "ogb_name": ds.ogb_name, "stats": stats}
    log_artifact(write_json(ctx.workdir / "dataset.json", info))
    ctx.reporter.note(f"{spec.dataset.name}: {stats['num_nodes']:,} nodes, {stats['num_edges']:,} edges, "
                      f"{stats['num_train']:,} training nodes ({took:.1f}s)")
    return {"num_nodes": stats["num_nodes"], "num_edges": stats["num_edges"], "time_load_s": took}
