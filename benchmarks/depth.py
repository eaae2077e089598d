"""Training memory of RevGNN versus depth: reversible, residual, residual + checkpointing.

For each depth and mode, builds ``RevGNN(in, hidden, out, depth)`` on a random graph and
measures one training step (:func:`betty.rev.engine.train_step_parts`:
``zero_grad`` + forward + backward on each of ``--parts`` random parts + optimizer step,
cross-entropy on random labels, every node training) with
``betty.memory.meter.MemoryMeter`` (tracking the model and optimizer; with Adam, one
unmeasured step first so its state exists). Columns:

* ``peak``: measured peak live bytes (parameters included);
* ``params``: parameter bytes (the gradients add the same again during the step);
* ``activ``: ``peak - 2 * params`` (what is neither a parameter nor a gradient);
* ``estimate``: :func:`betty.rev.memory.estimate_rev_parts` (largest part), and ``err``
  its relative error against ``peak``;
* ``time``: wall time of the measured step (the dispatch meter slows small ops down).

Builds the graph with DGL: run it in ``.venv`` (the RevGNN models run on PyG too).

Usage::

    python benchmarks/depth.py                       # N=4096, hidden=8, depths 8 32 128 512
    python benchmarks/depth.py --nodes 2000 --hidden 16 --depths 8 64 --modes reversible residual
"""

from __future__ import annotations

import argparse
import time

import dgl
import torch

from betty.memory.meter import MemoryMeter
from betty.rev.memory import estimate_rev_parts
from betty.rev.model import RevGNN
from betty.rev.engine import train_step_parts
from betty.rev.training import cluster_partition

MODES = ("reversible", "residual", "checkpoint")


def measure(
    graph: dgl.DGLGraph,
    feat: torch.Tensor,
    label: torch.Tensor,
    *,
    hidden: int,
    out_feats: int,
    depth: int,
    mode: str,
    conv: str,
    groups: int,
    dropout: float,
    parts: int,
    optimizer: str,
    device: torch.device,
) -> dict:
    """One measured training step and its estimate; returns bytes and seconds."""
    torch.manual_seed(0)
    model = RevGNN(
        feat.shape[1], hidden, out_feats, num_layers=depth, num_groups=groups, conv=conv,
        dropout=dropout, reversible=mode == "reversible", checkpoint=mode == "checkpoint",
    ).to(device)
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    split = cluster_partition(graph, parts, "random", seed=0)
    train_mask = torch.ones(graph.num_nodes(), dtype=torch.bool, device=device)
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    if optimizer == "adam":  # the steady state: Adam's moments exist
        train_step_parts(model, opt, split, feat, label, train_mask, loss_fn=loss_fn)
    meter = MemoryMeter(device)
    meter.track(model, opt)
    start = time.perf_counter()
    with meter.measure() as reading:
        train_step_parts(model, opt, split, feat, label, train_mask, loss_fn=loss_fn)
    seconds = time.perf_counter() - start
    backend = "cuda" if device.type == "cuda" else "cpu"
    estimate = max(e.peak for e in estimate_rev_parts(split, model, train_mask=train_mask,
                                                      optimizer=opt, backend=backend))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"peak": reading.peak_bytes, "params": params, "estimate": estimate,
            "seconds": seconds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=4096)
    parser.add_argument("--avg-degree", type=int, default=4)
    parser.add_argument("--in-feats", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=8)
    parser.add_argument("--out-feats", type=int, default=4)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--conv", default="gcn", choices=("gcn", "sage", "gat"))
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--parts", type=int, default=1, help="K random parts per step")
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"))
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 32, 128, 512])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1 avoids OpenMP contention on busy machines)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    n = args.nodes
    src = torch.randint(n, (args.avg_degree * n,))
    dst = torch.randint(n, (args.avg_degree * n,))
    graph = dgl.add_self_loop(dgl.graph((src, dst), num_nodes=n)).to(device)
    graph.create_formats_()
    feat = torch.randn(n, args.in_feats, device=device)
    label = torch.randint(args.out_feats, (n,), device=device)

    mb = 1e6
    print(f"N={n}, E={graph.num_edges()}, hidden={args.hidden} ({args.groups} groups), "
          f"conv={args.conv}, {args.optimizer}, K={args.parts}, float32, "
          f"one (N, hidden) activation = {n * args.hidden * 4 / mb:.3f} MB")
    header = (f"{'depth':>6} {'mode':>11} {'peak MB':>9} {'params MB':>10} {'activ MB':>9} "
              f"{'estimate MB':>12} {'err %':>7} {'time s':>7}")
    print(header)
    print("-" * len(header))
    peaks: dict[tuple[str, int], int] = {}
    for mode in args.modes:
        for depth in args.depths:
            r = measure(graph, feat, label, hidden=args.hidden, out_feats=args.out_feats,
                        depth=depth, mode=mode, conv=args.conv, groups=args.groups,
                        dropout=args.dropout, parts=args.parts, optimizer=args.optimizer,
                        device=device)
            peaks[(mode, depth)] = r["peak"]
            err = 100.0 * (r["estimate"] - r["peak"]) / r["peak"]
            print(f"{depth:>6} {mode:>11} {r['peak'] / mb:>9.3f} {r['params'] / mb:>10.3f} "
                  f"{(r['peak'] - 2 * r['params']) / mb:>9.3f} {r['estimate'] / mb:>12.3f} "
                  f"{err:>+7.2f} {r['seconds']:>7.1f}", flush=True)
    lo, hi = min(args.depths), max(args.depths)
    if lo != hi:
        ratios = ", ".join(
            f"{mode} {peaks[(mode, hi)] / peaks[(mode, lo)]:.2f}x" for mode in args.modes
        )
        print(f"peak(depth {hi}) / peak(depth {lo}): {ratios}")


if __name__ == "__main__":
    main()
