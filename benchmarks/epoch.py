"""Per-step cost of a training epoch on synthetic-products: CPU-seconds and wall.

    python benchmarks/epoch.py [--scale 0.25] [--epochs 2] [--k 8] [--method reg]
        [--set KEY=VALUE ...]

Builds the trainer of ``specs/synthetic_products.yaml`` with ``dataset.scale``,
SAGE-mean (hidden 256, dropout 0.5), fanouts 10,25, full batch, K fixed (``--k``), the
``--method`` partitioner, on the CPU, and runs ``--epochs`` epochs: the first partitions
afresh, the later ones reuse the partition (``partition.reuse: null``). For every epoch
it prints each timer of :class:`betty.engine.EpochRecord` (wall seconds), the epoch's
wall and the process's CPU-seconds (``time.process_time``: all threads), and the
machine's load (``os.getloadavg``). ``--scale 1.0`` is the full size (about 9-13 GiB of
host memory).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from betty.engine import PREPARATION_TIMERS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ("time_sample_s", "time_partition_s", "time_estimate_s", "time_block_s", "time_metrics_s",
         "time_h2d_s", "time_compute_s")
assert set(STEPS) - {"time_partition_s", "time_compute_s"} <= set(PREPARATION_TIMERS)


def log(*args) -> None:
    print(*args, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--method", default="reg")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()

    from workflow.components import load_data, make_trainer
    from workflow.specfile import load_spec

    overrides = [f"dataset.scale={args.scale}", "model.aggregator=mean", f"partition.k={args.k}",
                 f"partition.method={args.method}", "partition.memory_budget=null",
                 "train.device=cpu", *args.overrides]
    rspec = load_spec(os.path.join(ROOT, "specs", "synthetic_products.yaml"), overrides)
    log(f"load {os.getloadavg()[0]:.2f}, torch threads {torch.get_num_threads()}, "
        f"scale {args.scale}, K={args.k}, {args.method}")
    t0, c0 = time.perf_counter(), time.process_time()
    ds = load_data(rspec)
    log(f"dataset: {int(ds.feat.shape[0]):,} nodes, {int(ds.train_idx.numel()):,} outputs; "
        f"load {time.perf_counter() - t0:.1f} s wall, {time.process_time() - c0:.1f} CPU-s")
    trainer, _, _ = make_trainer(rspec, ds, torch.device("cpu"))
    rows = []
    for epoch in range(args.epochs):
        c0 = time.process_time()
        record = trainer.train_epoch(epoch)
        cpu = time.process_time() - c0
        rows.append((epoch, record, cpu, os.getloadavg()[0]))
    log("")
    log("| step (wall s) | " + " | ".join(f"epoch {e}{' (fresh)' if e == 0 else ' (reuse)'}"
                                          for e, *_ in rows) + " |")
    log("|---|" + "---|" * len(rows))
    for name in STEPS:
        log(f"| {name[5:-2]} | " + " | ".join(f"{getattr(r, name):.2f}" for _, r, _, _ in rows) + " |")
    log("| **epoch wall** | " + " | ".join(f"**{r.epoch_time_s:.2f}**" for _, r, _, _ in rows) + " |")
    log("| idle (wall - compute) | " + " | ".join(f"{r.time_idle_s:.2f}" for _, r, _, _ in rows) + " |")
    log("| epoch CPU-s (all threads) | " + " | ".join(f"{c:.2f}" for _, _, c, _ in rows) + " |")
    log("| load after | " + " | ".join(f"{lo:.2f}" for *_, lo in rows) + " |")


if __name__ == "__main__":
    main()
