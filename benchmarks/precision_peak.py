"""Measured peak per micro-batch, bf16-mixed against float32, at the same K.

Loads ``synthetic-products`` at ``--scale``, builds GraphSAGE (``--aggregator``, default
lstm) and trains one step per precision with the same batch, the same partition (K
micro-batches, ``--method``) and a :class:`betty.memory.meter.MemoryMeter` (one region per
micro-batch: features, blocks, activations, gradients, the autocast weight cache;
parameters and optimizer state as its baseline). ``32`` uses float32 features;
``bf16-mixed`` stores the features in ``--feature-dtype`` (default bfloat16) on the host.
Prints the largest micro-batch peak of each and their ratio.

    PYTHONPATH=$PWD python benchmarks/precision_peak.py --scale 0.05 --k 4
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from betty.data import load_dataset
from betty.engine import PartitionPlan, Trainer
from betty.memory.meter import MemoryMeter
from betty.models import build_model
from betty.train import build_optimizer


def peak(ds, precision: str, feat_dtype: torch.dtype, args) -> tuple[int, float]:
    """(largest measured micro-batch peak in bytes, CPU seconds) of one step."""
    torch.manual_seed(0)
    model = build_model("sage", ds.num_features, ds.num_classes, hidden=args.hidden, layers=2,
                        aggregator=args.aggregator, dropout=0.5)
    opt = build_optimizer("adam", model.parameters(), lr=0.01)
    feat = ds.feat
    ds.feat = feat.to(feat_dtype)
    try:
        trainer = Trainer(model, opt, ds, [10, 25], PartitionPlan(args.method, args.k),
                          batch_size=args.batch_size, seed=0, precision=precision,
                          meter=MemoryMeter("cpu"), estimate_memory=False)
        trainer.batches = trainer.batches[:1]
        start = time.process_time()
        rec = trainer.train_epoch(0)
        return int(rec.peak_mem_measured_bytes), time.process_time() - start
    finally:
        ds.feat = feat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.05)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--aggregator", default="lstm")
    parser.add_argument("--method", default="random")
    parser.add_argument("--feature-dtype", default="bfloat16")
    parser.add_argument("--root", default="data")
    args = parser.parse_args()
    ds = load_dataset("synthetic-products", args.root, scale=args.scale)
    print(f"synthetic-products scale {args.scale}: {ds.num_nodes:,} nodes, {ds.num_features} features; "
          f"SAGE-{args.aggregator} hidden {args.hidden}, fanouts 10,25, batch {args.batch_size}, K={args.k}")
    p32, t32 = peak(ds, "32", torch.float32, args)
    pbf, tbf = peak(ds, "bf16-mixed", getattr(torch, args.feature_dtype), args)
    print(f"32 (float32 features):          peak {p32 / 2**20:8.2f} MiB  CPU {t32:.1f} s")
    print(f"bf16-mixed ({args.feature_dtype} features): peak {pbf / 2**20:8.2f} MiB  CPU {tbf:.1f} s")
    print(f"ratio bf16-mixed / 32: {pbf / p32:.3f}; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
