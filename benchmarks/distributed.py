"""Epoch time of N = 1 and N = 2 ranks (torch.distributed, gloo, one thread per rank),
side by side in one run.

For each spec, trains ``--epochs`` epochs with ``train.world_size = N`` through
:func:`betty.distributed.launch.launch` (N = 1 goes through the same launcher, so both
pay the same process start) and reports, per N: the mean epoch time after the first
(warm-up) epoch, the scaling efficiency ``t_1 / (N * t_N)``, the gradient all-reduce
payload per rank per step, the time ranks waited in the all-reduce, and the largest
resident set size (RSS) of a rank. Every rank loads its own copy of the graph here.

``--host-memory``: instead, per spec at N = ``--nprocs``' largest value, the ranks'
host memory when each loads its own dataset and when they map the launcher's one
shared copy (:mod:`betty.distributed.shared`), side by side: per rank the peak RSS, the
RSS and the proportional set size (PSS: shared pages divided among the processes that
map them) after the epochs, and the size of the shared files.

Usage::

    python benchmarks/distributed.py                                # synthetic + small synthetic-products
    python benchmarks/distributed.py --specs tiny --epochs 3
    python benchmarks/distributed.py --host-memory --specs synthetic_products --scale 0.02 --epochs 2
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

PRODUCTS_SMALL = ["dataset.scale=0.005", "partition.k=4", "partition.memory_budget=null",
                  "model.hidden=64"]


def rank_epochs(rspec, epochs: int, shared=None) -> dict:
    """On one rank: epoch times, all-reduce figures and host memory (module-level for
    the launcher). ``shared``: map this :class:`SharedDataset` instead of loading."""
    import torch.distributed as dist

    from betty.distributed import DataParallel
    from betty.distributed.shared import memory_of_process
    from workflow.components import load_data, make_trainer

    ds = load_data(rspec) if shared is None else shared.attach()
    trainer, _, _ = make_trainer(rspec, ds, torch.device("cpu"))
    trainer.parallel = dp = DataParallel()
    times = []
    for epoch in range(epochs):
        dist.barrier()
        start = time.perf_counter()
        trainer.train_epoch(epoch)
        times.append(time.perf_counter() - start)
    per_step = max(dp.steps, 1)  # the all-reduce of one step, averaged over the run's
    return {"times": times, "bytes": [dp.reduce_bytes / per_step], "wait": [dp.reduce_wait_s / per_step],
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "memory": memory_of_process()}


def host_memory(specs: list[str], nproc: int, epochs: int, scale: float) -> None:
    """Per rank host memory with a dataset per rank vs one shared copy (see the module
    docstring)."""
    from betty.distributed.launch import launch
    from betty.distributed.shared import share_dataset
    from workflow.components import load_data
    from workflow.specfile import load_spec

    mib = 2**20
    print(f"{'spec':<20} {'N':>2} {'dataset':<8} {'rank':>4} {'peak RSS MiB':>12} {'RSS MiB':>8} "
          f"{'PSS MiB':>8} {'shared files MiB':>16}")
    for name in specs:
        overrides = ["train.measure_memory=false", "evaluate.every=0", f"train.world_size={nproc}"]
        if name == "synthetic_products":
            overrides += [o for o in PRODUCTS_SMALL if not o.startswith("dataset.scale")]
            overrides.append(f"dataset.scale={scale}")
        rspec = load_spec(name, overrides)
        for mode in ("per-rank", "shared"):
            if mode == "shared":
                with share_dataset(load_data(rspec)) as shared:
                    res = launch(rank_epochs, (rspec, epochs, shared), nproc=nproc, threads=1)
                    files = shared.nbytes / mib
            else:
                res = launch(rank_epochs, (rspec, epochs), nproc=nproc, threads=1)
                files = 0.0
            for r in sorted(res):
                m = res[r]["memory"]
                print(f"{name:<20} {nproc:>2} {mode:<8} {r:>4} {m['rss_peak_bytes'] / mib:>12.0f} "
                      f"{m.get('rss_bytes', float('nan')) / mib:>8.0f} "
                      f"{m.get('pss_bytes', float('nan')) / mib:>8.0f} {files:>16.1f}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--specs", nargs="+", default=["synthetic", "synthetic_products"])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--nprocs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--host-memory", action="store_true",
                        help="compare per-rank host memory: dataset per rank vs shared")
    parser.add_argument("--scale", type=float, default=0.02,
                        help="synthetic_products dataset.scale for --host-memory")
    args = parser.parse_args(argv)
    if args.epochs < 2 and not args.host_memory:
        parser.error("--epochs must be at least 2: the timing is the mean over the epochs after the first")
    if args.host_memory:
        host_memory(args.specs, max(args.nprocs), args.epochs, args.scale)
        return

    from betty.distributed.launch import launch
    from workflow.specfile import load_spec

    print(f"{'spec':<20} {'N':>2} {'epoch s':>8} {'eff':>5} {'allreduce MiB/step':>18} "
          f"{'wait s/step':>11} {'max RSS MiB':>11}")
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
            print(f"{name:<20} {n:>2} {per_epoch:>8.3f} {eff:>5.2f} {mb:>18.3f} {wait:>11.4f} {rss:>11.0f}",
                  flush=True)


if __name__ == "__main__":
    main()
