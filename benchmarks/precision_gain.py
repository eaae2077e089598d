"""The memory gain of bf16-mixed over float32 on synthetic-products: estimated K = 1 peak,
the K the search picks for a quarter of the float32 peak in each precision, and the
measured largest micro-batch at K = 8 (forward and loss under autocast).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/precision_gain.py 0.05   # scale
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from betty.data import load_dataset
from betty.models import build_model
from betty.sampling import sample_full_batch
from betty.memory import search_k, estimate_micro_batches
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("scale", type=float, help="dataset.scale of synthetic-products (0.05: 122k nodes)")
scale = parser.parse_args().scale
torch.set_num_threads(1)
ds = load_dataset("synthetic-products", "data", cache=False, scale=scale)
train = ds.train_idx
print("nodes", ds.graph.num_nodes(), "feats", tuple(ds.feat.shape), "train", len(train))
batch = sample_full_batch(ds.graph, train, [10, 25], seed=0)
model = build_model("sage", ds.feat.shape[1], ds.num_classes, hidden=256, layers=2, aggregator="mean")
zeros = torch.zeros(batch.num_outputs, dtype=torch.int64)
p32 = estimate_micro_batches(batch, zeros, 1, model, "adam")[0].peak
pbf = estimate_micro_batches(batch, zeros, 1, model, "adam", precision="bf16-mixed")[0].peak
print(f"K=1 estimated peak: 32 {p32/2**20:.1f} MiB, bf16-mixed {pbf/2**20:.1f} MiB, ratio {pbf/p32:.3f}")
budget = p32 / 4
for prec in ("32", "bf16-mixed"):
    r = search_k(batch, model, "adam", memory_budget=budget, method="random", precision=prec)
    mx = max(e.peak for e in r.estimates)
    print(f"budget {budget/2**20:.1f} MiB precision {prec}: K={r.k}, largest micro-batch {mx/2**20:.1f} MiB")
from autocast_step import autocast_step
from betty.memory import MemoryMeter
from betty.partition import partition_batch
from betty.train import accumulate_gradients, build_optimizer, train_step
opt = build_optimizer("adam", model.parameters(), 1e-3)
label = ds.label.clamp(min=0)
train_step(model, opt, batch, zeros, ds.feat, label, dropout_key=1)
meter = MemoryMeter("cpu"); meter.track(model, opt)
k = 8
groups = partition_batch(batch, k, "random", seed=0).groups
peaks = {}
for prec in ("32", "bf16-mixed"):
    opt.zero_grad(set_to_none=True)
    with autocast_step(model, prec) as m:
        res = accumulate_gradients(m, batch, groups, ds.feat, label, k=k, meter=meter, dropout_key=2)
    est = estimate_micro_batches(batch, groups, k, model, opt, precision=prec)
    meas = [r.peak_bytes for r in res.micro]
    err = max(abs(e.peak - r) / r for e, r in zip(est, meas))
    peaks[prec] = max(meas)
    print(f"K={k} {prec}: largest measured micro-batch {max(meas)/2**20:.2f} MiB, worst estimate error {err:.3%}")
print(f"measured peak ratio bf16-mixed / 32 at K={k}: {peaks['bf16-mixed']/peaks['32']:.3f}")
