"""One SAGE-mean epoch on synthetic-papers read from disk: RSS, page-cache traffic, time.

Phases, each timed (wall and CPU) with this process's RSS after it (and its anonymous
and mapped-file parts, ``RssAnon`` / ``RssFile``), its peak RSS so far (``getrusage``)
and the bytes it read from storage (``/proc/self/io`` ``read_bytes``: what missed the
page cache; ``rchar``: every byte read through ``read()``, the hashing of the store
included; page faults on memory-mapped files count in ``read_bytes``)::

    PYTHONPATH=$PWD python benchmarks/out_of_core.py --scale 0.01 --root /tmp/papers

``generate`` runs only when the store is not there yet. K is chosen by the memory model
for ``--budget`` bytes (``k="auto"``); ``--batch-size`` splits the training nodes into
batches (one optimizer step each; default: one full batch).
"""

from __future__ import annotations

import argparse
import resource
import time

from proc_io import process_io  # benchmarks/, the script's folder


def _rss_gib() -> tuple[float, float, float]:
    """``(VmRSS, RssAnon, RssFile)`` of this process now, in GiB."""
    found = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                found[key] = int(value.split()[0]) / 2**20
    return found["VmRSS"], found["RssAnon"], found["RssFile"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=0.01)
    ap.add_argument("--root", default="data")
    ap.add_argument("--fanouts", default="10,15")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--budget", type=float, default=64 * 2**20, help="device bytes for the K search")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=None, help="outputs per batch (default: all)")
    ap.add_argument("--method", default="random", help="partitioner of each batch")
    args = ap.parse_args()

    import torch

    from betty.data import cache_path, load_dataset
    from betty.engine import PartitionPlan, Trainer
    from betty.models import build_model

    torch.set_num_threads(args.threads)
    rows = []

    def phase(name, fn):
        io0, t0, c0 = process_io(), time.perf_counter(), time.process_time()
        out = fn()
        io1 = process_io()
        rows.append((name, time.perf_counter() - t0, time.process_time() - c0, *_rss_gib(),
                     resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                     (io1.get("read_bytes", 0) - io0.get("read_bytes", 0)) / 2**30,
                     (io1.get("rchar", 0) - io0.get("rchar", 0)) / 2**30))
        return out

    opts = {"scale": args.scale}
    folder = cache_path("synthetic-papers", args.root, **opts)
    if not folder.is_dir():
        phase("generate", lambda: load_dataset("synthetic-papers", args.root, **opts))
    ds = phase("load", lambda: load_dataset("synthetic-papers", args.root, **opts))
    disk = sum(p.stat().st_size for p in folder.iterdir()) / 2**30
    torch.manual_seed(0)
    model = build_model("sage", ds.num_features, ds.num_classes, hidden=args.hidden, layers=2,
                        aggregator="mean")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.003)
    plan = PartitionPlan(method=args.method, k="auto", memory_budget=int(args.budget))
    trainer = Trainer(model, optimizer, ds, [int(f) for f in args.fanouts.split(",")], plan, seed=0,
                      batch_size=args.batch_size)
    record = phase("epoch", lambda: trainer.train_epoch(0))
    print(f"synthetic-papers scale {args.scale}: {ds.num_nodes:,} nodes, {ds.num_edges:,} edges, "
          f"{ds.train_idx.numel():,} training nodes; store {disk:.2f} GiB at {folder}")
    print(f"epoch: {len(record.batches)} batches, K={record.k} loss={record.loss:.4f} "
          f"sample {record.time_sample_s:.2f} s, partition {record.time_partition_s:.2f} s, "
          f"estimate {record.time_estimate_s:.2f} s, blocks {record.time_block_s:.2f} s, "
          f"gather {record.time_h2d_s:.2f} s, compute {record.time_compute_s:.2f} s")
    print(f"{'phase':<9} {'wall s':>8} {'cpu s':>8} {'RSS GiB':>8} {'RssAnon':>8} {'RssFile':>8} "
          f"{'peak GiB':>9} {'read_bytes GiB':>15} {'rchar GiB':>10}")
    for name, wall, cpu, rss, anon, mapped, peak, rb, rc in rows:
        print(f"{name:<9} {wall:8.2f} {cpu:8.2f} {rss:8.2f} {anon:8.2f} {mapped:8.2f} {peak:9.2f} "
              f"{rb:15.2f} {rc:10.2f}")


if __name__ == "__main__":
    main()
