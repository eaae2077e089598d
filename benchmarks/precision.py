"""Exactness under mixed precision: relative gradient differences, one table per backend.

For every model (SAGE mean/gcn/pool/lstm, GAT) on the test graph of
``tests/test_exactness.py`` (600-node power-law graph, 2 layers, fanouts 5,8,
node-keyed dropout 0.5), prints

* ``mixed vs 32``: ``max_p ||g_mixed(K=1) - g_32(K=1)|| / ||g_32(K=1)||``,
* ``K=k vs K=1``: ``max_p ||g_mixed(K=k) - g_mixed(K=1)|| / ||g_mixed(K=1)||`` for k in 2, 4, 8,

with ``g`` the float32 gradient accumulated by :func:`betty.train.accumulate_gradients`
(random split) and ``mixed`` each of ``bf16-mixed`` and ``16-mixed``; the float32 row
(``32``) is the same K-way difference in float32.

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
from betty.sampling import sample_full_batch  # noqa: E402
from betty.train import accumulate_gradients, gradients, max_relative_difference  # noqa: E402

MODELS = [("sage", "mean"), ("sage", "gcn"), ("sage", "pool"), ("sage", "lstm"), ("gat", None)]
KS = (2, 4, 8)


def measure(backend: str, precisions: list[str], feature_dtype: str = "float32") -> list[dict]:
    """One row per (model, precision): ``{"model", "precision", "vs32", "k2", "k4", "k8"}``."""
    g, feat, label, train = power_law_graph(num_nodes=600, avg_degree=8, seed=0)
    feat = feat.to(getattr(torch, feature_dtype))
    batch = sample_full_batch(g, train, [5, 8], seed=0)
    groups = {k: partition_batch(batch, k, "random", seed=3).groups for k in (1,) + KS}
    rows = []
    for arch, agg in MODELS:
        torch.manual_seed(0)
        model = build_model(arch, 12, 5, hidden=16, layers=2, aggregator=agg or "mean", heads=2,
                            dropout=0.5, attn_dropout=0.25, backend=backend).train()

        def grads(k: int, precision: str) -> dict:
            model.zero_grad(set_to_none=True)
            accumulate_gradients(model, batch, groups[k], feat, label, k=k, dropout_key=dropout_key(0, 1),
                                 dtype=torch.float32, precision=precision)
            return gradients(model)

        g32 = grads(1, "32")
        for prec in ["32"] + precisions:
            one = g32 if prec == "32" else grads(1, prec)
            row = {"model": f"{arch}-{agg}" if agg else arch, "precision": prec,
                   "vs32": max_relative_difference(one, g32)}
            for k in KS:
                row[f"k{k}"] = max_relative_difference(grads(k, prec), one)
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
        print(f"worst {prec}: vs 32 {max(r['vs32'] for r in mine):.2e}, K-way vs K=1 "
              f"{max(r[f'k{k}'] for r in mine for k in KS):.2e}")
    print(f"CPU {time.process_time() - start:.1f} s, load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
