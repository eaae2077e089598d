"""Epoch time of N = 1 and N = 2 ranks (torch.distributed, gloo, one thread per rank),
side by side in one run.

For each spec, trains ``--epochs`` epochs with ``train.world_size = N`` through
:func:`betty.distributed.launch.launch` (N = 1 goes through the same launcher, so both
pay the same process start) and reports, per N: the mean epoch time after the first
(warm-up) epoch, the scaling efficiency ``t_1 / (N * t_N)``, the gradient all-reduce
payload per rank per step, the time ranks waited in the all-reduce, and the largest
resident set size (RSS) of a rank. Every rank loads its own copy of the graph (no
shared memory yet), so the RSS column is what each rank costs the host.

Usage::

    python benchmarks/distributed.py                                # synthetic + small synthetic-products
    python benchmarks/distributed.py --specs tiny --epochs 3
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

PRODUCTS_SMALL = ["dataset.scale=0.005", "partition.k=4", "partition.memory_budget=null",
                  "model.hidden=64"]


def rank_epochs(rspec, epochs: int) -> dict:
    """On one rank: epoch times and all-reduce figures (module-level for the launcher)."""
    import torch.distributed as dist

    from betty.distributed import DataParallel
    from workflow.components import load_data, make_trainer

    ds = load_data(rspec)
    trainer, _, _ = make_trainer(rspec, ds, torch.device("cpu"))
    trainer.parallel = dp = DataParallel()
    times = []
    for epoch in range(epochs):
        dist.barrier()
        start = time.perf_counter()
        trainer.train_epoch(epoch)
        times.append(time.perf_counter() - start)
    return {"times": times, "bytes": [s.reduce.bytes for s in dp.history],
            "wait": [s.reduce.wait_s for s in dp.history],
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--specs", nargs="+", default=["synthetic", "synthetic_products"])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--nprocs", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)

    from betty.distributed.launch import launch
    from workflow.specfile import load_spec

    print(f"{'spec':<20} {'N':>2} {'epoch s':>8} {'eff':>5} {'allreduce MB/step':>17} "
          f"{'wait s/step':>11} {'max RSS MB':>10}")
    for name in args.specs:
        overrides = ["train.measure_memory=false", "evaluate.every=0"]
        if name == "synthetic_products":
            overrides += PRODUCTS_SMALL
        base = None
        for n in args.nprocs:
            rspec = load_spec(name, [*overrides, f"train.world_size={n}"])
            res = launch(rank_epochs, (rspec, args.epochs), nproc=n, threads=1)
            per_epoch = statistics.fmean(max(res[r]["times"][e] for r in res)
                                         for e in range(1, args.epochs))
            base = per_epoch if base is None else base
            eff = base / (n * per_epoch)
            mb = statistics.fmean(res[0]["bytes"]) / 2**20
            wait = statistics.fmean(w for r in res for w in res[r]["wait"])
            rss = max(res[r]["rss"] for r in res) / 2**20
            print(f"{name:<20} {n:>2} {per_epoch:>8.3f} {eff:>5.2f} {mb:>17.3f} {wait:>11.4f} {rss:>10.0f}",
                  flush=True)


if __name__ == "__main__":
    main()
