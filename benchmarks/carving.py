"""Carving cost before and after the O(micro-batch size) Carver, side by side in one run.

    python benchmarks/carving.py [--spec specs/synthetic_products.yaml] [--k 8 32]
        [--method reg] [--baseline-ref 8f3b2c4] [--repeats 3] [--singles 200]

Samples the spec's full batch (outputs = the training nodes, the spec's fanouts and
sampling seed), partitions it with ``--method`` at each K, and times carving every
micro-batch with this tree's :class:`betty.microbatch.Carver` and with the Carver of git
revision ``--baseline-ref`` (loaded from ``git show REF:betty/microbatch.py``; default
8f3b2c4, the last Carver that scanned every source of a layer for each micro-batch),
alternating the two ``--repeats`` times, each going first in every other round
(median reported). Also times carving
``--singles`` one-output micro-batches (the per-micro-batch overhead). Every micro-batch both carvers
produce is checked to be identical (sources, edges, edge IDs, index maps).
``--set KEY=VALUE`` overrides spec keys (e.g. ``dataset.root=/path``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from betty.microbatch import Carver  # noqa: E402
from betty.partition import partition_batch  # noqa: E402
from betty.sampling import sample_full_batch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(*args) -> None:
    print(*args, flush=True)


def baseline_carver(ref: str):
    """The ``Carver`` class of ``betty/microbatch.py`` at git revision ``ref``."""
    src = subprocess.run(["git", "-C", ROOT, "show", f"{ref}:betty/microbatch.py"],
                         check=True, capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "baseline_microbatch.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("baseline_microbatch", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Carver


def same_micro_batch(a, b) -> bool:
    for la, lb, ia, ib in zip(a.layers, b.layers, a.full_src_index, b.full_src_index):
        if not (torch.equal(la.src_nid, lb.src_nid) and la.num_dst == lb.num_dst
                and torch.equal(la.edge_src, lb.edge_src) and torch.equal(la.edge_dst, lb.edge_dst)
                and torch.equal(la.edge_id, lb.edge_id) and torch.equal(ia, ib)):
            return False
    return torch.equal(a.output_index, b.output_index)


def time_carving(carver_cls, full, micro_batches) -> tuple[float, float, list]:
    """``(seconds to build the carver, seconds to carve every micro-batch, the micro-batches)``."""
    t0 = time.perf_counter()
    carver = carver_cls(full)
    t1 = time.perf_counter()
    out = [carver.carve(idx) for idx in micro_batches]
    return t1 - t0, time.perf_counter() - t1, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default=os.path.join(ROOT, "specs", "synthetic_products.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--k", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--method", default="reg")
    ap.add_argument("--baseline-ref", default="8f3b2c4",
                    help="git revision of the Carver to compare with (default: the last one that "
                         "scanned every source of a layer per micro-batch)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--singles", type=int, default=200)
    args = ap.parse_args()

    from workflow.components import load_data
    from workflow.specfile import load_spec, resolve_spec  # noqa: F401

    from workflow.commands._common import load

    rspec = load(args.spec, args.overrides)
    ds = load_data(rspec)
    fanouts = list(rspec.spec.sampling.fanouts)
    t = time.perf_counter()
    full = sample_full_batch(ds.graph, ds.train_idx, fanouts, seed=rspec.spec.sampling.seed)
    log(f"# {rspec.spec.dataset.name}: {full.num_outputs} outputs, sources per layer "
        f"{[layer.num_src for layer in full.layers]}, edges per layer "
        f"{[layer.num_edges for layer in full.layers]} (sampled in {time.perf_counter() - t:.1f}s)")
    log(f"# load average {os.getloadavg()}, torch threads {torch.get_num_threads()}, "
        f"baseline = Carver at {args.baseline_ref}")
    old_cls = baseline_carver(args.baseline_ref)

    gen = torch.Generator().manual_seed(0)
    singles = [torch.tensor([int(i)]) for i in
               torch.randperm(full.num_outputs, generator=gen)[: args.singles]]
    cases = [(f"{args.singles} single-output micro-batches", singles)]
    for k in args.k:
        t = time.perf_counter()
        groups = partition_batch(full, k, args.method, seed=0, graph=ds.graph).groups
        order = torch.argsort(groups, stable=True)
        sizes = torch.bincount(groups, minlength=k).tolist()
        log(f"# {args.method} K={k} partitioned in {time.perf_counter() - t:.1f}s")
        cases.append((f"K={k} ({args.method})", list(torch.split(order, sizes))))

    log("| case | carver | build s | carve s (median of %d) | per micro-batch ms |" % args.repeats)
    log("|---|---|---|---|---|")
    for name, micro_batches in cases:
        times = {"before": [], "after": []}
        builds = {"before": [], "after": []}
        runs = (("before", old_cls), ("after", Carver))
        for r in range(args.repeats):  # alternate the two carvers, and which goes first
            outs = {}
            for label, cls in (runs if r % 2 == 0 else runs[::-1]):
                b, c, outs[label] = time_carving(cls, full, micro_batches)
                builds[label].append(b)
                times[label].append(c)
            assert all(same_micro_batch(x, y) for x, y in zip(outs["before"], outs["after"])), \
                "carvers disagree"
            del outs
        for label in ("before", "after"):
            c = statistics.median(times[label])
            log(f"| {name} | {label} | {statistics.median(builds[label]):.3f} | {c:.3f} | "
                f"{1000 * c / len(micro_batches):.2f} |")
        ratio = statistics.median(times["before"]) / statistics.median(times["after"])
        log(f"| {name} | before/after | | {ratio:.1f}x | |")


if __name__ == "__main__":
    main()
