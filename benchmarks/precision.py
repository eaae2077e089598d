"""Exactness under mixed precision: relative gradient differences, one table per backend.

For every model (SAGE mean/gcn/pool/lstm, GAT with 2 output heads and with 1, GCN) on
the test graph of ``tests/test_exactness.py`` (600-node power-law graph, 2 layers,
fanouts 5,8, node-keyed dropout 0.5), prints

* ``vs 32``: ``max_p ||r_mixed - r_32|| / ||r_32||``,
* ``K=k``: ``max_p ||g_mixed(K=k) - r_mixed|| / ||r_mixed||`` for k in 1, 2, 4, 8,

with ``r`` the float32 gradient of the independent full-batch reference
(:func:`betty.reference.full_batch_reference`, under the same autocast), ``g`` the one
accumulated by :func:`betty.train.accumulate_gradients` (random split) and ``mixed``
each of ``bf16-mixed`` and ``16-mixed``; the float32 row (``32``) is the same K-way
difference in float32.

    PYTHONPATH=$PWD python benchmarks/precision.py --backend dgl    # .venv
    PYTHONPATH=$PWD python benchmarks/precision.py --backend pyg    # .venv-pyg
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from graphs import power_law_graph  # noqa: E402

from betty.models import build_model  # noqa: E402
from betty.models.dropout import dropout_key  # noqa: E402
from betty.partition import partition_batch  # noqa: E402
from betty.reference import full_batch_reference  # noqa: E402
from betty.sampling import sample_full_batch  # noqa: E402
from betty.train import accumulate_gradients, gradients, max_relative_difference  # noqa: E402

MODELS = [("sage", "mean"), ("sage", "gcn"), ("sage", "pool"), ("sage", "lstm"), ("gat", None),
          ("gat", "1head"), ("gcn", None)]
KS = (1, 2, 4, 8)


def measure(backend: str, precisions: list[str], feature_dtype: str = "float32") -> list[dict]:
    """One row per (model, precision): ``{"model", "precision", "vs32", "k1", "k2", "k4", "k8"}``."""
    g, feat, label, train = power_law_graph(num_nodes=600, avg_degree=8, seed=0)
    feat = feat.to(getattr(torch, feature_dtype))
    batch = sample_full_batch(g, train, [5, 8], seed=0)
    groups = {k: partition_batch(batch, k, "random", seed=3).groups for k in KS}
    rows = []
    for arch, agg in MODELS:
        torch.manual_seed(0)
        model = build_model(arch, 12, 5, hidden=16, layers=2, aggregator=agg if arch == "sage" else "mean",
                            heads=2, output_heads=1 if agg == "1head" else None, dropout=0.5,
                            attn_dropout=0.25, backend=backend).train()

        def grads(k: int, precision: str) -> dict:
            model.zero_grad(set_to_none=True)
            accumulate_gradients(model, batch, groups[k], feat, label, k=k, dropout_key=dropout_key(0, 1),
                                 dtype=torch.float32, precision=precision)
            return gradients(model)

        def reference(precision: str) -> dict:
            return full_batch_reference(model, batch, feat, label, dropout_key=dropout_key(0, 1),
                                        dtype=torch.float32, precision=precision).grads

        r32 = reference("32")
        for prec in ["32"] + precisions:
            ref = r32 if prec == "32" else reference(prec)
            row = {"model": f"{arch}-{agg}" if agg else arch, "precision": prec,
                   "vs32": max_relative_difference(ref, r32)}
            for k in KS:
                row[f"k{k}"] = max_relative_difference(grads(k, prec), ref)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="dgl", choices=["dgl", "pyg"])
    parser.add_argument("--precisions", default="bf16-mixed,16-mixed")
    parser.add_argument("--feature-dtype", default="float32")
    args = parser.parse_args()
    start = time.process_time()
    rows = measure(args.backend, args.precisions.split(","), args.feature_dtype)
    print(f"backend {args.backend}, torch {torch.__version__}, features {args.feature_dtype}")
    print(f"{'model':<10} {'precision':<11} {'vs 32':>9} " + " ".join(f"{'K=%d' % k:>9}" for k in KS))
    for r in rows:
        print(f"{r['model']:<10} {r['precision']:<11} {r['vs32']:9.2e} "
              + " ".join(f"{r[f'k{k}']:9.2e}" for k in KS))
    for prec in sorted({r["precision"] for r in rows}):
        mine = [r for r in rows if r["precision"] == prec]
        print(f"worst {prec}: vs 32 {max(r['vs32'] for r in mine):.2e}, K=1 vs the reference "
              f"{max(r['k1'] for r in mine):.2e}, K-way vs the reference "
              f"{max(r[f'k{k}'] for r in mine for k in KS if k > 1):.2e}")
    print(f"CPU {time.process_time() - start:.1f} s, load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
