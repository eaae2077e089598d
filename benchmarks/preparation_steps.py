"""CPU-seconds of a batch's host preparation on one thread, on synthetic-products.

    python benchmarks/preparation_steps.py [--scale 1.0] [--k 8] [--method reg] [--repeats 2]
        [--root data] [--checkout DIR]

Loads ``specs/synthetic_products.yaml`` at ``dataset.scale`` (all training nodes, one
full batch, fanouts 10,25, SAGE-mean hidden 256 for the memory estimate) and prints two
tables, ``time.process_time`` on one torch thread and one preparation worker, with the
machine's load beside each row:

1. **Per step**, each ``--repeats`` times with the batch's caches cleared, on one split
   (``--method`` at ``--k`` micro-batches): sampling, the micro-batch sizes from the split's micro-batch
   membership (:func:`betty.memory.sizes.split_sizes`, what a K search estimates from),
   carving every micro-batch (:class:`betty.microbatch.Carver`), the sizes read off the carved
   micro-batches, and the sorted feature gather of every micro-batch's inputs
   (:func:`betty.data.store.gather_rows`, the host side of a device's copy), into new
   buffers and into buffers kept from the repeat before (``out=``).
2. **Per batch**, fresh (sample and partition) and reused (sample, the partition kept),
   ``--repeats`` times each, every step in the order :meth:`betty.engine.Trainer.prepare`
   runs them for a batch carved ahead (the pipeline's default): sample, partition,
   carve, estimate, redundancy (``split_metrics``), gather. The gather writes into the
   buffers the batch before used (where they are large enough), as the engine's gather
   ahead does on CUDA,
   where torch's caching pinned-host allocator hands the freed buffers out again; the
   first batch's gather, and the ``gather, new buffers`` column (the same rows into
   fresh ``torch.empty`` buffers, timed apart and not in the total), show what fresh
   pages cost on this host.

``--checkout DIR`` imports ``betty`` and ``workflow`` from another checkout of the
project (``git worktree add DIR COMMIT``) with this script's steps, so that two commits
are measured by one method, one after the other; where that checkout lacks a step
(no carved sizes, no ``gather_rows``) the batch table runs what it has: the estimate
and redundancy from the membership before carving, and ``feat[ids]`` into new buffers
every batch (such a checkout copied pageable rows to the device).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--method", default="reg")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--root", default="data")
    ap.add_argument("--checkout", default=ROOT, help="the project checkout to measure")
    args = ap.parse_args()
    checkout = os.path.abspath(args.checkout)
    sys.path.insert(0, checkout)
    import workflow.env  # noqa: F401  (its environment defaults, before torch)

    import torch

    from betty.memory import make_estimator
    import betty.memory.sizes as sizes
    from betty.microbatch import Carver, split
    from betty.partition import partition_batch
    from betty.partition.metrics import split_metrics
    from betty.sampling import sample_full_batch
    from workflow.components import build_model, load_data
    from workflow.specfile import load_spec

    try:
        from betty.data.store import gather_rows
    except ImportError:  # a checkout from before the sorted gather
        def gather_rows(table, ids):  # and a pageable copy to the device: new buffers each time
            return table[ids]
    reusable = "out" in inspect.signature(gather_rows).parameters
    # a checkout from before the micro-batch names has them as piece_sizes and
    # carved_piece_sizes; one from before the carved sizes lacks that step
    membership_sizes = getattr(sizes, "split_sizes", None) or getattr(sizes, "piece_sizes")
    carved_sizes = getattr(sizes, "carved_split_sizes", None) or getattr(sizes, "carved_piece_sizes", None)

    rspec = load_spec(os.path.join(checkout, "specs", "synthetic_products.yaml"),
                      [f"dataset.scale={args.scale}", f"dataset.root={args.root}", "train.device=cpu"])
    ds = load_data(rspec)
    torch.set_num_threads(1)
    try:
        from betty import workers
    except ImportError:  # a checkout from before preparation threads: one thread anyway
        pass
    else:
        workers.set_prep_workers(1)
    fanouts, k = [10, 25], args.k
    estimate = make_estimator(build_model(rspec, ds), "adam")
    batch = sample_full_batch(ds.graph, ds.train_idx, fanouts, seed=0)
    groups = partition_batch(batch, k, args.method, seed=0, graph=ds.graph).groups
    order = torch.argsort(groups, stable=True)
    outputs = torch.split(order, torch.bincount(groups, minlength=k).tolist())
    print(f"checkout {checkout}; scale {args.scale}: {int(ds.feat.shape[0]):,} nodes, "
          f"{batch.num_outputs:,} outputs, {args.method} K={k}, one thread; "
          f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE')}", flush=True)

    def timed(step, run) -> None:
        for rep in range(args.repeats):
            getattr(batch, "_derived", {}).clear()  # a checkout from before the derived cache has none
            start = time.process_time()
            run()
            print(f"{step:<30s} rep {rep}: {time.process_time() - start:6.2f} CPU-s  "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)

    micro_batches = []

    def gather_kept(micro, buffers: list) -> None:
        """Each micro-batch's rows into ``buffers[i]`` (kept from the batch before; a new
        buffer where there is none or it is too small), ``buffers`` updated."""
        for i, mb in enumerate(micro):
            held = buffers[i] if i < len(buffers) else None
            rows = gather_rows(ds.feat, mb.input_nid, out=held)
            buffers[i:i + 1] = [rows]

    def carve_all() -> None:
        carver = Carver(batch)
        micro_batches[:] = [carver.carve(idx) for idx in outputs]

    timed("sample", lambda: sample_full_batch(ds.graph, ds.train_idx, fanouts, seed=1))
    timed("micro-batch sizes (membership)", lambda: membership_sizes(batch, groups, k))
    timed(f"carve {k} micro-batches", carve_all)
    if carved_sizes is not None:
        timed("micro-batch sizes (carved micro-batches)", lambda: carved_sizes(batch, groups, k, micro_batches))
    timed("gather every micro-batch's inputs", lambda: [gather_rows(ds.feat, mb.input_nid) for mb in micro_batches])
    if reusable:
        kept_buffers = [gather_rows(ds.feat, mb.input_nid) for mb in micro_batches]
        timed("gather, into kept buffers", lambda: gather_kept(micro_batches, kept_buffers))
    del micro_batches[:]

    print("\nper batch, in the engine's order (carved ahead where this checkout can):", flush=True)
    kept, kept_buffers = groups, []  # the first batch's gather allocates its buffers
    for rep in range(args.repeats):
        for fresh in (True, False):
            steps: dict[str, float] = {}

            def clock(name, run):
                start = time.process_time()
                value = run()
                steps[name] = steps.get(name, 0.0) + time.process_time() - start
                return value

            one = clock("sample", lambda: sample_full_batch(ds.graph, ds.train_idx, fanouts,
                                                            seed=100 + 2 * rep + fresh))
            if fresh:
                kept = clock("partition", lambda: partition_batch(one, k, args.method, seed=rep,
                                                                  graph=ds.graph).groups)
            micro = None
            if carved_sizes is not None:
                micro = clock("carve", lambda: split(one, kept, k))
                clock("carve", lambda: carved_sizes(one, kept, k, micro))
            clock("estimate", lambda: estimate(one, kept, k))
            clock("redundancy", lambda: split_metrics(one, kept, k))
            if micro is None:
                micro = clock("carve", lambda: split(one, kept, k))
            if reusable:
                clock("gather", lambda: gather_kept(micro, kept_buffers))
                start = time.process_time()
                new = [gather_rows(ds.feat, mb.input_nid) for mb in micro]
                apart = f", gather, new buffers {time.process_time() - start:.2f}"
                del new
            else:
                clock("gather", lambda: [gather_rows(ds.feat, mb.input_nid) for mb in micro])
                apart = ""
            del micro, one
            print(f"{'fresh' if fresh else 'reused':<6s} rep {rep}: {sum(steps.values()):6.2f} CPU-s  ("
                  + ", ".join(f"{name} {s:.2f}" for name, s in steps.items())
                  + f"{apart})  load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
