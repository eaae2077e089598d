"""Loss curves of the default spec in bf16-mixed: K=1 against K=8, overlaid.

    python benchmarks/precision_curves.py [--epochs 50] [--precision bf16-mixed]
        [--ks 1,8] [--out docs/figures/precision_curves.png] [--set KEY=VALUE ...]

Trains ``specs/synthetic.yaml`` (SAGE-mean, fanouts 10,25, hidden 256, dropout 0.5,
full batch, ``reg``) on the CPU once per K in ``--ks``, each from the same initial
weights, and plots the training loss of every epoch, one line per K, in one figure
(``--out``). Under mixed precision every node still computes its full-batch
computation, so the K-way curves differ from K=1 only by autocast's rounding; the
script prints, per epoch, each K's loss and the largest relative difference from the
first K's, and the final train accuracy of each.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import betty  # noqa: E402,F401  (sets OMP_WAIT_POLICY before torch is imported)
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--ks", default="1,8")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "figures", "precision_curves.png"))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from workflow.components import load_data, make_trainer
    from workflow.specfile import load_spec

    curves = {}
    for k in ks:
        rspec = load_spec(os.path.join(ROOT, "specs", "synthetic.yaml"),
                          [f"train.precision={args.precision}", f"partition.k={k}", "train.device=cpu",
                           f"train.epochs={args.epochs}", "train.measure_memory=false", *args.overrides])
        ds = load_data(rspec)
        trainer, _, _ = make_trainer(rspec, ds, torch.device("cpu"))
        start = time.perf_counter()
        records = list(trainer.epochs(range(args.epochs)))
        curves[k] = records
        print(f"K={k}: {args.epochs} epochs in {time.perf_counter() - start:.1f} s, "
              f"final loss {records[-1].loss:.4f}, train acc {records[-1].train_acc:.4f}", flush=True)
    base = curves[ks[0]]
    worst = 0.0
    print("epoch " + " ".join(f"loss K={k:<3d}" for k in ks))
    for e in range(args.epochs):
        row = [curves[k][e].loss for k in ks]
        worst = max(worst, *(abs(v - row[0]) / abs(row[0]) for v in row[1:]))
        print(f"{e:5d} " + " ".join(f"{v:10.6f}" for v in row))
    print(f"largest relative loss difference from K={ks[0]} over {args.epochs} epochs: {worst:.2e}")

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for k, style in zip(ks, ("-", "--", ":", "-.")):
        ax.plot([r.epoch for r in curves[k]], [r.loss for r in curves[k]], style, label=f"K={k}")
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss")
    ax.set_title(f"synthetic spec, {args.precision}: K-way against K={ks[0]}"
                 f" (largest relative difference {worst:.1e})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
