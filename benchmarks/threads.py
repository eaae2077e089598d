"""Carving and training compute at 1 thread, 2 threads and ``train.threads: auto``, side
by side in one run.

    python benchmarks/threads.py [--spec synthetic] [--set KEY=VALUE ...]
        [--threads 1 2 auto] [--k 8] [--repeats 3]

Loads the spec's dataset once, samples its full batch, partitions it with the spec's
method at ``--k`` and then, for each thread setting in turn (the settings alternate and
each goes first in another round, ``--repeats`` rounds, median reported):

* carves every micro-batch (``betty.microbatch.Carver``), wall and CPU seconds;
* trains one epoch with the spec's model and a fixed K (``Trainer.train_epoch``), and
  reports its ``time_compute_s`` (forward + backward + step of every micro-batch).

Prints the load average before and after (other jobs share the cores here), the cores
this process may use, and what ``auto`` resolved to for the graph.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def log(*args) -> None:
    print(*args, flush=True)


def timed(fn):
    """``(wall seconds, CPU seconds of this process, fn())``."""
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w, time.process_time() - c, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="synthetic")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--threads", nargs="+", default=["1", "2", "auto"])
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from betty.microbatch import Carver
    from betty.partition import partition_batch
    from betty.sampling import sample_full_batch
    from betty.threads import available_cores
    from workflow.commands._common import load
    from workflow.components import configure_threads, load_data, make_trainer, spec_threads

    base = load(args.spec, [*args.overrides, f"partition.k={args.k}", "train.measure_memory=false"])
    ds = load_data(base)
    log(f"# {base.spec.dataset.name}: {ds.num_nodes} nodes, {ds.num_edges} edges; cores available "
        f"{available_cores()}; auto -> {spec_threads(base, ds.num_edges)} threads; "
        f"load average {os.getloadavg()}")
    full = sample_full_batch(ds.graph, ds.train_idx, list(base.spec.sampling.fanouts), seed=base.spec.sampling.seed)
    groups = partition_batch(full, args.k, base.spec.partition.method, seed=0, graph=ds.graph).groups
    order = torch.argsort(groups, stable=True)
    micro_batches = list(torch.split(order, torch.bincount(groups, minlength=args.k).tolist()))
    log(f"# {full.num_outputs} outputs, {base.spec.partition.method} K={args.k}")

    rows: dict[str, dict[str, list[float]]] = {t: {"carve wall": [], "carve cpu": [], "compute": []}
                                               for t in args.threads}
    for r in range(args.repeats):
        for setting in (args.threads if r % 2 == 0 else args.threads[::-1]):
            rspec = load(args.spec, [*args.overrides, f"partition.k={args.k}",
                                     "train.measure_memory=false", f"train.threads={setting}"])
            configure_threads(rspec, ds.num_edges)
            def carve_all():  # one Carver per batch, as the engine builds it
                carver = Carver(full)
                return [carver.carve(p) for p in micro_batches]

            wall, cpu, _ = timed(carve_all)
            rows[setting]["carve wall"].append(wall)
            rows[setting]["carve cpu"].append(cpu)
            trainer, _, _ = make_trainer(rspec, ds, torch.device("cpu"))
            rows[setting]["compute"].append(trainer.train_epoch(0).time_compute_s)
    log(f"| threads | torch threads | carve wall s | carve CPU s | epoch compute s (median of {args.repeats}) |")
    log("|---|---|---|---|---|")
    for setting in args.threads:
        rspec = load(args.spec, [*args.overrides, f"train.threads={setting}"])
        row = {k: statistics.median(v) for k, v in rows[setting].items()}
        log(f"| {setting} | {spec_threads(rspec, ds.num_edges)} | {row['carve wall']:.3f} | "
            f"{row['carve cpu']:.3f} | {row['compute']:.3f} |")
    log(f"# load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
