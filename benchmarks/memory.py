"""Memory model accuracy sweep: estimated vs measured peak of every micro-batch.

For each model (GraphSAGE mean/gcn/pool/lstm, GAT), depth, hidden width, graph size and
K, trains one step with :class:`betty.memory.MemoryMeter` tracking model and optimizer
(after one optimizer step, so Adam state exists), estimates every micro-batch with
:func:`betty.memory.estimate_micro_batches` and prints, per configuration, the worst micro-batch's
estimated and measured peak and the relative error, then the overall maximum.

    .venv/bin/python benchmarks/memory.py                 # default sweep
    .venv/bin/python benchmarks/memory.py --sizes 1000 --hidden 64 --layers 2
    .venv/bin/python benchmarks/memory.py --backend pyg     # the PyTorch Geometric backend
    .venv/bin/python benchmarks/memory.py --precision bf16-mixed --models sage-mean

With ``--precision bf16-mixed`` each micro-batch's forward pass and loss run under
``torch.autocast(cpu, bfloat16)`` (float32 parameters, gradients, Adam state and
features) and the estimate is :func:`betty.memory.estimate_micro_batches` with that precision.
With ``--multilabel T`` the targets are ``(N, T)`` float32 0/1 (the models have T
outputs, the loss is the mean over tasks of BCE with logits):

    .venv/bin/python benchmarks/memory.py --precision bf16-mixed --multilabel 16
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from autocast_step import autocast_step  # noqa: E402
from betty.memory import MemoryMeter, estimate_micro_batches  # noqa: E402
from betty.precision import PRECISIONS  # noqa: E402
from betty.models import build_model  # noqa: E402
from betty.partition import partition_batch  # noqa: E402
from betty.sampling import sample_full_batch  # noqa: E402
from betty.train import accumulate_gradients, build_optimizer, train_step  # noqa: E402

MODELS = ["sage-mean", "sage-gcn", "sage-pool", "sage-lstm", "gat"]
FANOUTS = [5, 10, 15]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--layers", default="1,2,3")
    parser.add_argument("--hidden", default="16,64,256")
    parser.add_argument("--sizes", default="1000,3000", help="graph node counts")
    parser.add_argument("--k", default="1,4,8")
    parser.add_argument("--feats", type=int, default=100)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--method", default="random")
    parser.add_argument("--backend", default="dgl", choices=["dgl", "pyg"],
                        help="the model's GNN backend (betty.backends)")
    parser.add_argument("--precision", default="32", choices=[p for p in PRECISIONS if p != "64"],
                        help="training precision (mixed: forward and loss under autocast)")
    parser.add_argument("--multilabel", type=int, default=0, metavar="T",
                        help="T > 0: (N, T) multi-label targets and the BCE loss")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from graphs import power_law_graph

    print(f"{'model':10s} {'L':>1s} {'hid':>4s} {'nodes':>6s} {'K':>3s} "
          f"{'estimated':>12s} {'measured':>12s} {'error':>8s}  peak at")
    worst_all, rows = 0.0, 0
    worst: dict[str, tuple[float, str]] = {}
    start = time.perf_counter()
    for n in _ints(args.sizes):
        g, feat, label, train = power_law_graph(num_nodes=n, avg_degree=10, num_feats=args.feats,
                                                num_classes=8, seed=n)
        multilabel, outputs = args.multilabel > 0, args.multilabel or 8
        if multilabel:
            gen = torch.Generator().manual_seed(n)
            label = (torch.rand(n, args.multilabel, generator=gen) > 0.5).float()
        for layers in _ints(args.layers):
            batch = sample_full_batch(g, train, FANOUTS[:layers], seed=0)
            for name in args.models.split(","):
                arch, _, agg = name.partition("-")
                for hidden in _ints(args.hidden):
                    torch.manual_seed(0)
                    model = build_model(arch, args.feats, outputs, hidden=hidden, layers=layers,
                                        aggregator=agg or "mean", heads=4, dropout=args.dropout,
                                        attn_dropout=args.dropout / 2,
                                        backend=args.backend).train()
                    opt = build_optimizer("adam", model.parameters(), 1e-3)
                    zeros = torch.zeros(batch.num_outputs, dtype=torch.int64)
                    train_step(model, opt, batch, zeros, feat, label, dropout_key=1,
                               multilabel=multilabel)
                    meter = MemoryMeter("cpu")
                    meter.track(model, opt)
                    for k in _ints(args.k):
                        groups = partition_batch(batch, k, args.method, seed=k).groups
                        opt.zero_grad(set_to_none=True)
                        with autocast_step(model, args.precision) as stepped:
                            res = accumulate_gradients(stepped, batch, groups, feat, label, k=k,
                                                       meter=meter, dropout_key=2,
                                                       multilabel=multilabel)
                        ests = estimate_micro_batches(batch, groups, k, model, opt,
                                                      precision=args.precision,
                                                      label_columns=args.multilabel)
                        errs = [(e.peak - m.peak_bytes) / m.peak_bytes for e, m in zip(ests, res.micro)]
                        i = max(range(k), key=lambda j: abs(errs[j]))
                        worst_all = max(worst_all, abs(errs[i]))
                        if abs(errs[i]) >= worst.get(name, (0.0, ""))[0]:
                            worst[name] = (abs(errs[i]), f"L={layers} hidden={hidden} nodes={n} K={k}")
                        rows += 1
                        print(f"{name:10s} {layers:1d} {hidden:4d} {n:6d} {k:3d} "
                              f"{ests[i].peak:12d} {res.micro[i].peak_bytes:12d} "
                              f"{errs[i] * 100:+7.2f}%  {ests[i].peak_at}", flush=True)
    print(f"\n{rows} configurations, every micro-batch compared; max |error| = "
          f"{worst_all * 100:.2f}% ({time.perf_counter() - start:.0f} s)")
    targets = f"{args.multilabel} multi-label tasks" if args.multilabel else "8 classes"
    print(f"\nworst |error| per model, backend {args.backend}, precision {args.precision}, "
          f"{targets}, torch {torch.__version__}:")
    for name, (err, where) in worst.items():
        print(f"  {name:10s} {err * 100:7.3f}%  at {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
