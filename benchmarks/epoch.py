"""Per-step cost of a training epoch on synthetic-products: CPU-seconds and wall.

    python benchmarks/epoch.py [--scale 0.25] [--epochs 2] [--k 8] [--method reg]
        [--mode both|serial|pipelined] [--set KEY=VALUE ...]

Builds the trainer of ``specs/synthetic_products.yaml`` with ``dataset.scale``,
SAGE-mean (hidden 256, dropout 0.5), fanouts 10,25, full batch, K fixed (``--k``), the
``--method`` partitioner, on the CPU, and runs ``--epochs`` epochs: the first partitions
afresh, the later ones reuse the partition (``partition.reuse: null``). For every epoch
it prints each timer of :class:`betty.engine.EpochRecord` (wall seconds), the epoch's
wall and the process's CPU-seconds (``time.process_time``: all threads), and the
machine's load (``os.getloadavg``). ``--scale 1.0`` is the full size (about 9-13 GiB of
host memory).

``--mode both`` (default) trains two trainers on the one loaded dataset, one after the
other, each from the same initial weights: ``train.pipeline: false`` (serial: each step
waits for its batch's preparation) and ``train.pipeline: true`` (``train.prefetch: 1``:
the next batch is prepared on a thread while the current one trains, the next epoch's
too). For each it prints the timers, the epoch's wall, ``time_wait_s`` (the step waiting
for preparation), the preparation's wall (sample + partition + estimate + metrics +
block, on whichever thread ran them), and ``wall / max(preparation, compute)``: 1.0 when
one of the two hides the other completely, about 2 when they run one after the other.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import betty  # noqa: E402,F401  (its process defaults, before torch)

import torch  # noqa: E402

from betty.engine import PREPARATION_TIMERS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ("time_sample_s", "time_partition_s", "time_estimate_s", "time_block_s", "time_metrics_s",
         "time_h2d_s", "time_compute_s")
assert set(STEPS) - {"time_partition_s", "time_compute_s"} <= set(PREPARATION_TIMERS)
#: What :meth:`betty.engine.Trainer.prepare` does (and, pipelined, the carving in ``block``).
PREPARED = ("time_sample_s", "time_partition_s", "time_estimate_s", "time_metrics_s", "time_block_s")


def log(*args) -> None:
    print(*args, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--method", default="reg")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--mode", choices=("both", "serial", "pipelined"), default="both")
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
    modes = ("serial", "pipelined") if args.mode == "both" else (args.mode,)
    columns = []
    for mode in modes:
        mode_spec = load_spec(os.path.join(ROOT, "specs", "synthetic_products.yaml"),
                              [*overrides, f"train.pipeline={'true' if mode == 'pipelined' else 'false'}"])
        trainer, _, _ = make_trainer(mode_spec, ds, torch.device("cpu"))
        epochs = trainer.epochs(range(args.epochs))
        for epoch in range(args.epochs):
            c0 = time.process_time()
            record = next(epochs)
            cpu = time.process_time() - c0
            columns.append((mode, epoch, record, cpu, os.getloadavg()[0]))
            log(f"{mode} epoch {epoch}: {record.epoch_time_s:.2f} s wall, {cpu:.2f} CPU-s")
        epochs.close()
    log("")
    log("| step (wall s) | " + " | ".join(f"{m} epoch {e}{' (fresh)' if e == 0 else ' (reuse)'}"
                                          for m, e, *_ in columns) + " |")
    log("|---|" + "---|" * len(columns))

    def row(label, values, fmt="{:.2f}"):
        log(f"| {label} | " + " | ".join(fmt.format(v) for v in values) + " |")

    for name in STEPS:
        row(name[5:-2], [getattr(r, name) for _, _, r, _, _ in columns])
    row("**epoch wall**", [r.epoch_time_s for _, _, r, _, _ in columns], "**{:.2f}**")
    row("idle (wall - compute)", [r.time_idle_s for _, _, r, _, _ in columns])
    row("wait for preparation", [r.time_wait_s for _, _, r, _, _ in columns])
    prep = [sum(getattr(r, n) for n in PREPARED) for _, _, r, _, _ in columns]
    row("preparation (sum of its steps)", prep)
    row("wall / max(preparation, compute)",
        [r.epoch_time_s / max(p, r.time_compute_s) for (_, _, r, _, _), p in zip(columns, prep)])
    row("prepared bytes held (MiB)", [r.prefetch_bytes / 2**20 for _, _, r, _, _ in columns], "{:.0f}")
    row("epoch CPU-s (all threads)", [c for *_, c, _ in columns])
    row("load after", [lo for *_, lo in columns])


if __name__ == "__main__":
    main()
