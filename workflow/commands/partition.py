"""``betty partition SPEC --k 8 --method hypergraph``: split one sampled batch."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from workflow.commands._common import JsonOpt, SetOpt, SpecArg, check_k_fits, emit_fields, fail, load
from workflow.progress import format_number


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
    import numpy as np

    from betty.batchfile import save_batch
    from workflow.components import load_data, make_trainer, resolve_device

    if save is not None and save.exists() and not save.is_dir():
        raise fail(f"--save {str(save)!r} is a file; give a folder (created if missing) for the split", 2)
    rspec = load(spec, set_, {"partition.method": method, "partition.k": k})
    trainer, _, _ = make_trainer(rspec, load_data(rspec), resolve_device(rspec.spec.train.device))
    if k is not None:
        check_k_fits(trainer, k, f"--k {k}")
    split = trainer.measure_split()
    out = dict(split.report)
    if save is not None and split.batch is not None:
        out["saved"] = str(save_batch(Path(save) / "batch.npz", split.batch, split.arrays["groups"]))
    elif save is not None:
        Path(save).mkdir(parents=True, exist_ok=True)
        np.savez_compressed(Path(save) / "parts.npz", **split.arrays)
        out["saved"] = str(Path(save) / "parts.npz")
    emit_fields(out, json_, width=22, show=format_number)
