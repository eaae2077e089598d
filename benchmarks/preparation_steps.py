"""CPU-seconds of each host preparation step on one thread, on synthetic-products.

    python benchmarks/preparation_steps.py [--scale 1.0] [--k 8] [--method reg] [--repeats 2]
        [--root data]

Loads ``specs/synthetic_products.yaml`` at ``dataset.scale``, samples the full batch of
all training nodes with fanouts 10,25, splits it with ``--method`` at ``--k`` pieces once,
then times, ``--repeats`` times each with every per-batch cache cleared: sampling, the
piece sizes the memory estimate reads (:func:`betty.memory.sizes.piece_sizes`: the
piece membership and the sizes), carving every piece (:class:`betty.microbatch.Carver`)
and the sorted feature gather of every piece's inputs
(:func:`betty.data.store.gather_rows`, what a device's step reads from the host).
``time.process_time`` on one torch thread and one preparation worker; the machine's load
is printed beside each row. Run it at two commits to compare them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--method", default="reg")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--root", default="data")
    args = ap.parse_args()

    from betty.data.store import gather_rows
    from betty.memory.sizes import piece_sizes
    from betty.microbatch import Carver
    from betty.partition import partition_batch
    from betty.sampling import sample_full_batch
    from workflow.components import load_data
    from workflow.specfile import load_spec

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rspec = load_spec(os.path.join(root, "specs", "synthetic_products.yaml"),
                      [f"dataset.scale={args.scale}", f"dataset.root={args.root}", "train.device=cpu"])
    ds = load_data(rspec)
    torch.set_num_threads(1)
    try:
        from betty import workers
    except ImportError:  # a commit from before preparation threads: one thread anyway
        pass
    else:
        workers.set_prep_workers(1)
    fanouts = [10, 25]
    batch = sample_full_batch(ds.graph, ds.train_idx, fanouts, seed=0)
    groups = partition_batch(batch, args.k, args.method, seed=0, graph=ds.graph).groups
    order = torch.argsort(groups, stable=True)
    outputs = torch.split(order, torch.bincount(groups, minlength=args.k).tolist())
    print(f"scale {args.scale}: {int(ds.feat.shape[0]):,} nodes, {batch.num_outputs:,} outputs, "
          f"{args.method} K={args.k}, one thread")

    def timed(step, run) -> None:
        for rep in range(args.repeats):
            batch._derived.clear()
            start = time.process_time()
            run()
            print(f"{step:<28s} rep {rep}: {time.process_time() - start:6.2f} CPU-s  "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)

    timed("sample", lambda: sample_full_batch(ds.graph, ds.train_idx, fanouts, seed=1))
    timed("piece sizes (estimate)", lambda: piece_sizes(batch, groups, args.k))
    pieces = []

    def carve_all() -> None:
        carver = Carver(batch)
        pieces[:] = [carver.carve(idx) for idx in outputs]

    timed(f"carve {args.k} pieces", carve_all)
    timed("gather every piece's inputs",
          lambda: [gather_rows(ds.feat, mb.input_nid) for mb in pieces])


if __name__ == "__main__":
    main()
