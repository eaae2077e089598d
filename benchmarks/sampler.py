"""betty's neighbour sampler against ``dgl.sampling.sample_neighbors``, side by side.

    python benchmarks/sampler.py [--datasets synthetic synthetic-products]
        [--scale 0.25] [--fanouts 10 25] [--repeats 5] [--threads 1] [--root DIR]

For each dataset (``synthetic`` at scale 1, ``synthetic-products`` at ``--scale``) and
each layer's fanout, it times one sampling step on the **same seed nodes**: layer
``L-1`` samples the in-edges of the training nodes, layer ``l`` those of the nodes the
layer above reached (taken from betty's own batch, so both samplers get identical
inputs). Per row: number of seeds, betty's seconds (:func:`betty.sampling.sample_neighbors`
on the cached in-CSR), DGL's seconds (``dgl.sampling.sample_neighbors``, without
replacement, on an int64 CPU graph whose in-CSR was built before timing), and the ratio
betty / DGL, in wall and in CPU-seconds of the process (best of ``--repeats`` for each,
alternating the two). It also times the whole
``betty.sampling.sample_full_batch`` (local relabelling and canonical order included)
against DGL's ``MultiLayerNeighborSampler.sample_blocks``.

Both run on ``--threads`` threads (torch and DGL's OpenMP pool); the default 1 is how
betty ran DGL's sampler when it used it (more threads made DGL's draws depend on the
thread count). betty's sampler gives the same batch on any thread count.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("DGLBACKEND", "pytorch")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from betty.data import load_dataset  # noqa: E402
from betty.graph import as_graph  # noqa: E402
from betty.sampling import sample_full_batch, sample_neighbors  # noqa: E402


def _once(fn) -> tuple[float, float]:
    """``(wall seconds, CPU seconds of this process)`` of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def _alternate(fns, repeats: int) -> list[tuple[float, float]]:
    """Best ``(wall, CPU)`` seconds of each function (each minimum taken separately),
    run in turns so load changes hit both."""
    best = [(float("inf"), float("inf"))] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            wall, cpu = _once(fn)
            best[i] = (min(best[i][0], wall), min(best[i][1], cpu))
    return best


def bench(name: str, root: str, scale: float, fanouts: list[int], repeats: int) -> None:
    import dgl

    ds = load_dataset(name, root, scale=scale)
    graph = as_graph(ds.graph)
    _ = graph.in_csr  # built once, outside the timing (cached on the Graph)
    dg = graph.to_dgl()
    dg.create_formats_()
    seeds = torch.sort(ds.train_idx).values
    batch = sample_full_batch(graph, seeds, fanouts, seed=0)
    print(f"\n{name} (scale {scale}): {graph.num_nodes():,} nodes, {graph.num_edges():,} edges, "
          f"{seeds.numel():,} training nodes, fanouts {fanouts}")
    print(f"{'layer':>5} {'fanout':>6} {'seeds':>9} {'edges':>10} {'betty s':>9} {'dgl s':>9} "
          f"{'ratio':>6} {'betty cpu':>9} {'dgl cpu':>9} {'ratio':>6}")
    gen = torch.Generator()
    for l, fanout in reversed(list(enumerate(fanouts))):
        nodes = batch.layers[l].dst_nid
        row, _ = sample_neighbors(graph, nodes, fanout, gen.manual_seed(1))
        ours, theirs = _alternate(
            [lambda: sample_neighbors(graph, nodes, fanout, gen.manual_seed(1)),
             lambda: dgl.sampling.sample_neighbors(dg, nodes, fanout)], repeats)
        print(f"{l:>5} {fanout:>6} {nodes.numel():>9,} {row.numel():>10,} {ours[0]:>9.4f} "
              f"{theirs[0]:>9.4f} {ours[0] / theirs[0]:>6.2f} {ours[1]:>9.4f} {theirs[1]:>9.4f} "
              f"{ours[1] / theirs[1]:>6.2f}")
    sampler = dgl.dataloading.MultiLayerNeighborSampler(fanouts)
    ours, theirs = _alternate([lambda: sample_full_batch(graph, seeds, fanouts, seed=0),
                               lambda: sampler.sample_blocks(dg, seeds)], repeats)
    print(f"whole batch: betty sample_full_batch {ours[0]:.4f} s ({ours[1]:.4f} CPU-s), DGL "
          f"sample_blocks {theirs[0]:.4f} s ({theirs[1]:.4f} CPU-s), ratio {ours[0] / theirs[0]:.2f} "
          f"wall, {ours[1] / theirs[1]:.2f} CPU")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", nargs="+", default=["synthetic", "synthetic-products"])
    ap.add_argument("--scale", type=float, default=0.25, help="scale of synthetic-products")
    ap.add_argument("--fanouts", type=int, nargs="+", default=[10, 25])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--root", default=None, help="data folder (dataset cache); default a temp dir")
    args = ap.parse_args(argv)

    from dgl.utils import set_num_threads

    torch.set_num_threads(args.threads)
    set_num_threads(args.threads)
    print(f"threads: {args.threads}; torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.root or tmp
        for name in args.datasets:
            bench(name, root, 1.0 if name == "synthetic" else args.scale, args.fanouts, args.repeats)


if __name__ == "__main__":
    main()
