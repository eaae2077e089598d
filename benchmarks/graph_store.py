"""Host memory of a preparation process: load a dataset, sample one full batch, cut it.

Runs each phase in this process and prints, per phase, the wall time, the CPU time, the
process's peak RSS so far (``getrusage``'s ``ru_maxrss``) and, after the phase, its
resident anonymous memory and resident pages of mapped files (``RssAnon``, ``RssFile``
of ``/proc/self/status``), plus the bytes of the raw arrays a preparation process needs
(features + in-CSR as stored). Run it once to
build the dataset cache, then again to measure a load from the cache::

    PYTHONPATH=$PWD python benchmarks/graph_store.py --scale 0.25 --root /tmp/gs
    PYTHONPATH=$PWD python benchmarks/graph_store.py --scale 0.25 --root /tmp/gs --k 8

The partition phase uses ``--method`` (default ``reg``, the workflow's default, at
``--k`` micro-batches): its working set on the sampled batch is part of the peak.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from betty.data import load_dataset
from betty.partition import partition_batch
from betty.sampling import sample_full_batch


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _resident_gib() -> tuple[float, float]:
    """``(RssAnon, RssFile)`` of this process now, in GiB (NaN where not reported)."""
    found = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile"):
                    found[key] = int(value.split()[0]) / 2**20
    except OSError:
        pass
    return found.get("RssAnon", float("nan")), found.get("RssFile", float("nan"))


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="synthetic-products")
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--root", default="data")
    ap.add_argument("--fanouts", default="10,25")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--method", default="reg")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []

    def phase(name, fn):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        rows.append((name, time.perf_counter() - t0, time.process_time() - c0, _peak_gib(),
                     *_resident_gib()))
        return out

    ds = phase("load", lambda: load_dataset(args.dataset, args.root, scale=args.scale))
    fanouts = [int(f) for f in args.fanouts.split(",")]
    batch = phase("sample", lambda: sample_full_batch(ds.graph, ds.train_idx, fanouts, seed=0))
    phase("partition", lambda: partition_batch(batch, args.k, args.method, seed=0, graph=ds.graph))
    indptr, indices, eid = ds.graph.in_csr
    raw = _nbytes(ds.feat) + _nbytes(indptr) + _nbytes(indices) + _nbytes(eid)
    print(f"{args.dataset} scale {args.scale}: {ds.num_nodes:,} nodes, {ds.num_edges:,} edges; "
          f"raw arrays (features + in-CSR as held): {raw / 2**30:.2f} GiB "
          f"(indices {indices.dtype}, eid {None if eid is None else eid.dtype})")
    print(f"{'phase':<10} {'wall s':>8} {'cpu s':>8} {'peak RSS GiB':>13} {'RssAnon after':>14} "
          f"{'RssFile after':>14}")
    for name, wall, cpu, peak, anon, mapped in rows:
        print(f"{name:<10} {wall:8.2f} {cpu:8.2f} {peak:13.2f} {anon:14.2f} {mapped:14.2f}")
    print(f"peak RSS / raw arrays: {rows[-1][3] / (raw / 2**30):.2f}")


if __name__ == "__main__":
    main()
