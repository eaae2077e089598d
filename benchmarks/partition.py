"""Benchmark the partitioners on a products-scale synthetic full batch.

    python benchmarks/partition.py [--scale S] [--k 2 4 8 16 32] [--methods ...]
    python benchmarks/partition.py --partitioners [--k 8 16] [--cut-threads 1 2]

Prints, on one full batch (outputs = the training nodes, fanouts 10,25 by default):

1. the reference operation: one forward + backward pass of an L-layer GraphSAGE-mean
   (L = number of fanouts; ``dgl.nn.SAGEConv``, hidden 256, 100 input features, 47
   classes) at K = 1 on the full batch's blocks, timed in this run;
2. per method at ``--timing-k``: graph build, partitioner and block-carving
   (``betty.microbatch.split``) seconds, their sum and its ratio to the reference;
3. per method and K: redundancy (layer 0), per-layer redundancy and imbalance
   (``--max-hub-degree none``: reg / reg-unweighted with the exact C, as Betty's artifact);
4. the hub cap's cost for ``reg`` / ``reg-all`` (``--hub-caps``);
5. reuse across epochs: a split computed at epoch 0 applied to the fresh samples of
   later epochs (sampled with seed = epoch) against a fresh split of that epoch, and
   the amortized preparation time per epoch.

Data: ``betty.data.load_dataset("synthetic-products", root, scale=S)`` when importable,
otherwise :func:`betty.partition.planted.planted_community_graph` with the same node
count, average degree and training fraction. ``--json PATH`` also writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("DGLBACKEND", "pytorch")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from betty.microbatch import carve, split  # noqa: E402
from betty.partition import PARTITIONERS, split_metrics  # noqa: E402
from betty.partition.base import PartitionResult  # noqa: E402
from betty.microbatch import validate_groups  # noqa: E402
from betty.sampling import sample_full_batch  # noqa: E402

PRODUCTS_NODES, PRODUCTS_AVG_DEGREE, PRODUCTS_TRAIN = 2_449_029, 50.52, 196_615
NUM_FEATURES, NUM_CLASSES, HIDDEN = 100, 47, 256
DEFAULT_METHODS = ["random", "range", "metis", "reg-unweighted", "reg", "reg-all", "hypergraph"]


def log(*args) -> None:
    print(*args, flush=True)


def load_graph(scale: float, root: str, seed: int):
    """``(graph, train_idx, source)`` for the benchmark."""
    try:
        from betty.data import load_dataset

        ds = load_dataset("synthetic-products", root, scale=scale)
        return ds.graph, ds.train_idx, f"synthetic-products (scale {scale})"
    except ImportError as err:  # the dataset module is optional here
        log(f"# betty.data.load_dataset unavailable ({err}); using a planted graph")
    from betty.partition.planted import planted_community_graph

    n = int(round(PRODUCTS_NODES * scale))
    graph, _ = planted_community_graph(
        n, max(47, int(round(470 * scale))), avg_degree=PRODUCTS_AVG_DEGREE, seed=seed
    )
    gen = torch.Generator().manual_seed(seed)
    n_train = max(1, int(round(n * PRODUCTS_TRAIN / PRODUCTS_NODES)))
    train = torch.sort(torch.randperm(n, generator=gen)[:n_train]).values
    return graph, train, f"planted community graph ({n} nodes)"


def hub_cap(value: str) -> int | None:
    """A ``max_hub_degree`` from the command line: ``'none'`` (exact BᵀB) or an int."""
    return None if value.lower() == "none" else int(value)


def time_reference(batch, repeats: int) -> float:
    """Median seconds of one forward+backward of an L-layer SAGE-mean (L = the batch's
    layers; 2 for the issue's reference) on the K=1 blocks."""
    import dgl.nn

    class Sage(torch.nn.Module):
        def __init__(self, num_layers: int):
            super().__init__()
            widths = [NUM_FEATURES] + [HIDDEN] * (num_layers - 1) + [NUM_CLASSES]
            self.convs = torch.nn.ModuleList(
                dgl.nn.SAGEConv(a, b, "mean") for a, b in zip(widths[:-1], widths[1:]))

        def forward(self, blocks, x):
            h = x
            for i, (conv, block) in enumerate(zip(self.convs, blocks)):
                h = conv(block, h)
                if i < len(self.convs) - 1:
                    h = torch.relu(h)
            return h

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch.layers[0].num_src, NUM_FEATURES, generator=gen)
    y = torch.randint(0, NUM_CLASSES, (batch.num_outputs,), generator=gen)
    model = Sage(batch.num_layers)
    times = []
    for rep in range(repeats + 1):  # the first pass warms up
        start = time.perf_counter()
        blocks = carve(batch, torch.arange(batch.num_outputs)).to_blocks()
        built = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(blocks, x), y)
        loss.backward()
        model.zero_grad()
        end = time.perf_counter()
        if rep:
            times.append(end - built)
    log(f"# (carving + to_blocks of the K=1 batch: {built - start:.2f} s, not in the reference)")
    return statistics.median(times)


def run_method(batch, k, method, *, graph, seed=0, **options) -> PartitionResult:
    """Call a registered partitioner directly (to pass options) and validate it."""
    if k == 1:
        return PartitionResult(torch.zeros(batch.num_outputs, dtype=torch.int64), 1, method)
    res = PARTITIONERS[method](batch, k, seed=seed, weights=None, graph=graph, **options)
    res.groups = validate_groups(res.groups, batch.num_outputs, k)
    return res


def timed_split(batch, groups, k) -> float:
    start = time.perf_counter()
    split(batch, groups, k)
    return time.perf_counter() - start


def compare_partitioners(batch, ks: list[int], threads: list[int], seed: int,
                         repeats: int = 1) -> list[dict]:
    """``reg``'s cut by METIS (one thread; betty's scheme, and recursive bisection forced)
    and by KaMinPar (each of ``threads``) at each K, side by side on the same REG, built
    once per index type outside the timings (METIS reads C in its ``idx_t``, KaMinPar in
    int32, as ``reg`` builds them): wall and CPU seconds of the cut alone (CPU = this
    process's, all threads, user + system; system time is mostly first touches of fresh
    pages), betty's redundancy (:func:`split_metrics`, layer 0 and per layer) and the
    imbalance of the outputs. ``repeats`` rounds of every (K, cut), so that each cut's
    time is seen after the others' (a round's order decides which memory comes back
    fresh)."""
    from betty.partition.balance import fill_empty_micro_batches, integer_vertex_weights
    from betty.partition.incidence import output_layer_incidence
    from betty.partition.kaminpar_cut import kaminpar_available, kaminpar_cut
    from betty.partition.metis_cut import metis_cut, metis_index_dtype
    from betty.partition.reg import redundancy_graph

    cuts = [("metis", 1), ("metis-bisection", 1)]
    if kaminpar_available():
        cuts += [("kaminpar", t) for t in threads]
    else:
        log("# kaminpar is not installed: METIS only")
    start = time.perf_counter()
    incidence = output_layer_incidence(batch)
    regs = {dtype: redundancy_graph(incidence, seed=seed, dtype=dtype)[0]
            for dtype in {metis_index_dtype(), np.dtype(np.int32)}}
    del incidence
    log(f"# REG built in {time.perf_counter() - start:.1f} s (not in the cut times)")
    vweights = integer_vertex_weights(None, batch.num_outputs)  # what reg hands the cut

    def cut(name: str, k: int, t: int) -> tuple[torch.Tensor, int]:
        if name == "kaminpar":
            groups, edge_cut = kaminpar_cut(regs[np.dtype(np.int32)], k, vweights=vweights,
                                            use_edge_weights=True, seed=seed, threads=t)
        else:
            groups, edge_cut = metis_cut(regs[metis_index_dtype()], k, vweights=vweights,
                                         use_edge_weights=True, seed=seed,
                                         recursive=True if name == "metis-bisection" else None)
        return fill_empty_micro_batches(groups, k)[0], edge_cut

    rows = []
    log(f"\n## reg cut: METIS against KaMinPar (load {os.getloadavg()[0]:.2f})")
    log(f"{'partitioner':15s} {'threads':>7s} {'K':>3s} {'round':>5s} {'wall s':>8s} "
        f"{'CPU s':>8s} {'sys s':>6s} {'redundancy':>10s} {'per layer':>20s} "
        f"{'max/mean outputs':>16s}")
    for rep, k, (name, t) in ((r, k, c) for r in range(repeats) for k in ks for c in cuts):
        sys_s = os.times().system
        wall, cpu = time.perf_counter(), time.process_time()
        groups, edge_cut = cut(name, k, t)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        sys_s = os.times().system - sys_s
        m = split_metrics(batch, groups, k)
        counts = torch.bincount(groups, minlength=k).double()
        row = {"partitioner": name, "threads": t, "k": k,
               "round": rep, "wall_s": wall, "cpu_s": cpu, "sys_s": sys_s,
               "redundancy": m["redundancy"],
               "redundancy_per_layer": m["redundancy_per_layer"],
               "output_imbalance": float(counts.max() / counts.mean()),
               "edge_cut": edge_cut}
        rows.append(row)
        log(f"{name:15s} {row['threads']:7d} {k:3d} {rep:5d} {wall:8.2f} {cpu:8.2f} "
            f"{sys_s:6.2f} "
            f"{row['redundancy']:10.4f} "
            f"{str([round(r, 4) for r in row['redundancy_per_layer']]):>20s} "
            f"{row['output_imbalance']:16.4f}")
    log(f"# load average at end: {os.getloadavg()}")
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--root", default=os.environ.get("BETTY_DATA", "data"))
    ap.add_argument("--fanouts", type=int, nargs="+", default=[10, 25])
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--methods", nargs="+", default=DEFAULT_METHODS)
    ap.add_argument("--timing-k", type=int, default=8, help="K of the timing table")
    ap.add_argument("--reference-repeats", type=int, default=3)
    ap.add_argument("--hub-caps", nargs="*", default=["none", "256", "64", "16"],
                    help="max_hub_degree values whose cost is measured for reg "
                         "('none' = exact BᵀB)")
    ap.add_argument("--hub-caps-all", nargs="*", default=["64", "16", "8"],
                    help="the same for reg-all")
    ap.add_argument("--max-hub-degree", default=None,
                    help="max_hub_degree of reg and reg-unweighted in the per-K rows "
                         "('none' = exact BᵀB, as the paper and Betty's artifact; "
                         "default: the methods' own default)")
    ap.add_argument("--reuse-epochs", type=int, nargs="*", default=[2, 5, 10])
    ap.add_argument("--reuse-methods", nargs="*", default=None,
                    help="methods of the reuse measurement (default: --methods)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--spread-seeds", type=int, nargs="*", default=[],
                    help="also report mean/min/max redundancy at --timing-k over these "
                         "partitioner seeds (same batch)")
    ap.add_argument("--partitioners", action="store_true",
                    help="only compare reg's cut by METIS and by KaMinPar (at --k, on "
                         "--cut-threads threads for KaMinPar) and stop")
    ap.add_argument("--cut-threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cut-repeats", type=int, default=1,
                    help="rounds of the --partitioners comparison")
    ap.add_argument("--json", default=None, help="also write all figures to this file")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.methods) - set(PARTITIONERS))
    if unknown:
        ap.error(f"unknown method(s) {unknown}; allowed: {sorted(PARTITIONERS)}")
    report: dict = {"args": vars(args)}
    row_options: dict = {}
    if args.max_hub_degree is not None:
        row_options = {"max_hub_degree": hub_cap(args.max_hub_degree)}

    log(f"# load average at start: {os.getloadavg()} on {os.cpu_count()} cores")
    start = time.perf_counter()
    graph, train_idx, source = load_graph(args.scale, args.root, args.seed)
    log(f"# data: {source}, {graph.num_nodes()} nodes, {graph.num_edges()} edges, "
        f"loaded in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    batch = sample_full_batch(graph, train_idx, args.fanouts, seed=0)
    log(f"# batch (epoch 0): {batch.num_outputs} outputs, layers (src, dst, edges) "
        f"{[(l.num_src, l.num_dst, l.num_edges) for l in batch.layers]}, "
        f"sampled in {time.perf_counter() - start:.1f} s")

    if args.partitioners:
        report["partitioners"] = compare_partitioners(batch, args.k, args.cut_threads, args.seed,
                                                     args.cut_repeats)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
        return report

    ref = time_reference(batch, args.reference_repeats)
    report["reference_fwd_bwd_s"] = ref
    log(f"# reference: {batch.num_layers}-layer SAGE-mean fwd+bwd at K=1 on the full batch: "
        f"{ref:.3f} s")

    # -- every method, every K -------------------------------------------------------
    rows = []
    results = {}
    for method in args.methods:
        for k in args.k:
            options = row_options if method in ("reg", "reg-unweighted") else {}
            res = run_method(batch, k, method, graph=graph, seed=args.seed, **options)
            metrics = split_metrics(batch, res.groups, k)
            row = {
                "method": method, "k": k,
                "build_s": res.time_build_s, "partition_s": res.time_partition_s,
                "redundancy": metrics["redundancy"],
                "redundancy_per_layer": metrics["redundancy_per_layer"],
                "imbalance": metrics["imbalance"],
                "info": {a: v for a, v in res.info.items() if isinstance(v, (int, float))},
            }
            if k == args.timing_k:
                row["carve_s"] = timed_split(batch, res.groups, k)
            rows.append(row)
            results[(method, k)] = res
            carved = f" carve {row['carve_s']:.2f} s" if "carve_s" in row else ""
            log(f"  {method:15s} K={k:3d} redundancy {row['redundancy']:.4f} "
                f"per-layer {[round(r, 4) for r in row['redundancy_per_layer']]} "
                f"imbalance {row['imbalance']:.3f} build {row['build_s']:.2f} s "
                f"partition {row['partition_s']:.2f} s{carved}")
    report["rows"] = rows

    log(f"\n## timing at K={args.timing_k} (reference fwd+bwd {ref:.3f} s)")
    log(f"{'method':15s} {'build s':>9s} {'partition s':>12s} {'carve s':>9s} "
        f"{'total s':>9s} {'x ref':>8s}")
    for row in rows:
        if row["k"] != args.timing_k:
            continue
        total = row["build_s"] + row["partition_s"] + row["carve_s"]
        row["total_s"], row["ratio_to_reference"] = total, total / ref
        log(f"{row['method']:15s} {row['build_s']:9.2f} {row['partition_s']:12.2f} "
            f"{row['carve_s']:9.2f} {total:9.2f} {total / ref:8.1f}")

    log("\n## redundancy (layer 0) per K")
    log(f"{'method':15s} " + " ".join(f"{'K=' + str(k):>8s}" for k in args.k))
    for method in args.methods:
        vals = [r["redundancy"] for r in rows if r["method"] == method]
        log(f"{method:15s} " + " ".join(f"{v:8.4f}" for v in vals))
    log("\n## imbalance (max/mean input nodes) per K")
    for method in args.methods:
        vals = [r["imbalance"] for r in rows if r["method"] == method]
        log(f"{method:15s} " + " ".join(f"{v:8.3f}" for v in vals))

    # -- seed spread ------------------------------------------------------------------
    spread_rows = []
    if args.spread_seeds:
        log(f"\n## redundancy over partitioner seeds {args.spread_seeds} at K={args.timing_k}")
        for method in args.methods:
            reds = [split_metrics(batch, run_method(batch, args.timing_k, method, graph=graph,
                                                    seed=s).groups, args.timing_k)["redundancy"]
                    for s in args.spread_seeds]
            spread_rows.append({"method": method, "redundancy": reds})
            log(f"{method:15s} mean {np.mean(reds):.4f} min {min(reds):.4f} "
                f"max {max(reds):.4f}")
    report["seed_spread"] = spread_rows

    # -- hub cap cost ---------------------------------------------------------------
    k = args.timing_k
    caps = {
        "reg": [hub_cap(c) for c in args.hub_caps],
        "reg-all": [hub_cap(c) for c in args.hub_caps_all],
    }
    hub_rows = []
    for method in [m for m in ("reg", "reg-all") if m in args.methods]:
        for cap in caps[method]:
            try:
                res = run_method(batch, k, method, graph=graph, seed=args.seed,
                                 max_hub_degree=cap)
            except MemoryError:
                log(f"  {method} max_hub_degree={cap}: out of memory")
                continue
            red = split_metrics(batch, res.groups, k)["redundancy"]
            hub_rows.append({"method": method, "max_hub_degree": cap, "redundancy": red,
                             "build_s": res.time_build_s, "partition_s": res.time_partition_s,
                             **{a: res.info[a] for a in ("hub_sources", "hub_pin_fraction",
                                                         "pairs_exact", "pairs_built",
                                                         "reg_nnz")}})
    if hub_rows:
        log(f"\n## hub cap cost at K={k}")
        for r in hub_rows:
            log(f"{r['method']:8s} max_hub_degree={str(r['max_hub_degree']):5s} "
                f"redundancy {r['redundancy']:.4f} hub sources {r['hub_sources']} "
                f"({100 * r['hub_pin_fraction']:.1f}% of pins) pairs built "
                f"{r['pairs_built']:,} of {r['pairs_exact']:,}, REG nnz {r['reg_nnz']:,}, "
                f"build {r['build_s']:.1f} s, METIS {r['partition_s']:.1f} s")
    report["hub_cap"] = hub_rows

    # -- reuse across epochs --------------------------------------------------------
    reuse_methods = args.reuse_methods if args.reuse_methods is not None else args.methods
    reuse_rows = []
    if args.reuse_epochs and reuse_methods:
        log(f"\n## reuse at K={k}: epoch-0 split on later epochs' samples vs a fresh split")
        epoch_batches = {}
        for epoch in args.reuse_epochs:
            start = time.perf_counter()
            epoch_batches[epoch] = sample_full_batch(graph, train_idx, args.fanouts, seed=epoch)
            log(f"  sampled epoch {epoch} in {time.perf_counter() - start:.1f} s")
        for method in reuse_methods:
            first = results.get((method, k)) or run_method(batch, k, method, graph=graph,
                                                           seed=args.seed)
            prep0 = first.time_build_s + first.time_partition_s
            for epoch, eb in epoch_batches.items():
                reused = split_metrics(eb, first.groups, k)["redundancy"]
                fresh = run_method(eb, k, method, graph=graph, seed=args.seed)
                fresh_red = split_metrics(eb, fresh.groups, k)["redundancy"]
                carve_s = timed_split(eb, first.groups, k)
                n_epochs = epoch + 1  # one split amortized over epochs 0..epoch
                row = {
                    "method": method, "epoch": epoch, "redundancy_reused": reused,
                    "redundancy_fresh": fresh_red,
                    "prep_fresh_s": fresh.time_build_s + fresh.time_partition_s + carve_s,
                    "prep_reused_amortized_s": prep0 / n_epochs + carve_s,
                }
                reuse_rows.append(row)
                log(f"  {method:15s} epoch {epoch:2d}: redundancy reused {reused:.4f} "
                    f"fresh {fresh_red:.4f}; prep/epoch fresh {row['prep_fresh_s']:.2f} s, "
                    f"reused (split amortized over {n_epochs} epochs) "
                    f"{row['prep_reused_amortized_s']:.2f} s")
    report["reuse"] = reuse_rows

    log(f"# load average at end: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        log(f"# wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
