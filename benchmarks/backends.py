"""Cross-backend parity, exactness per backend and DGL-vs-PyG step and epoch time, side by side.

    python benchmarks/backends.py [--nodes 600] [--repeats 5]
    python benchmarks/backends.py --epoch SPEC [--set KEY=VALUE ...] [--repeats 3] [--warmup 1]

Needs both DGL and PyTorch Geometric (``.venv``). On one sampled batch of the
``tests/graphs.py`` power-law graph (12 features, 5 classes, 2 layers, fanouts 5,8,
hidden 16, 2 GAT heads, dropout 0.5, attention dropout 0.25), prints per model:

1. parity: the same weights on the same blocks, DGL vs PyG, float64: max relative
   difference of the outputs and of the gradients (``betty.train.max_relative_difference``);
2. exactness on each backend: the worst relative gradient error of K-way
   accumulation (K in 2, 3, 7; range, random, reg) against
   ``betty.reference.full_batch_reference``, float64 and float32;
3. step time: median over ``--repeats`` of one K=4 accumulation step (float32) on each
   backend, and the PyG/DGL ratio (same process, alternating backends).

``--epoch SPEC`` instead times whole epochs of a workflow spec (``specs/SPEC.yaml``,
``--set`` overrides as in ``betty run``; ``train.epochs`` is irrelevant, ``train.threads``
defaults to 1 and ``train.pipeline`` to false, so the parts add up) through betty's engine: each repeat builds a fresh
``betty.engine.Trainer`` per backend (``workflow.components.make_trainer`` with
``model.backend`` set to ``dgl``, then ``pyg``; the order alternates between repeats)
and runs its epoch 0 (after ``--warmup`` untimed epochs per backend, default 1: the
first epoch in a process pays one-time costs), so both backends train on the same
sampled batch, the same split and the same partition (same seeds; K from the spec or
its K search, checked equal). It
prints the median over repeats of the engine's ``EpochRecord`` times: sampling,
partition (K search and memory estimates included), block building, compute
(forward + backward + optimizer step) and the whole epoch, per backend, and the PyG/DGL
ratios of the epoch and of its training part (blocks + compute). It refuses to report
when the backends trained with different K or their losses differ (``LOSS_RTOL``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("DGLBACKEND", "pytorch")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

from betty.models import build_model  # noqa: E402
from betty.models.dropout import dropout_key  # noqa: E402
from betty.partition import partition_batch  # noqa: E402
from betty.reference import full_batch_reference  # noqa: E402
from betty.sampling import sample_full_batch  # noqa: E402
from betty.train import accumulate_gradients, gradients, max_relative_difference  # noqa: E402
from graphs import power_law_graph  # noqa: E402

MODELS = [("sage", "mean"), ("sage", "gcn"), ("sage", "pool"), ("sage", "lstm"), ("gat", None)]
KEY = dropout_key(0, 1)


def _model(arch, agg, backend, dtype):
    torch.manual_seed(0)
    return build_model(arch, 12, 5, hidden=16, layers=2, aggregator=agg or "mean", heads=2,
                       dropout=0.5, attn_dropout=0.25, backend=backend).to(dtype).train()


def _full(model, batch, feat, label, dtype):
    model.zero_grad(set_to_none=True)
    out = model(model.make_blocks(batch.layers), feat[batch.input_nid].to(dtype),
                src_nids=[l.src_nid for l in batch.layers], edge_ids=[l.edge_id for l in batch.layers],
                dropout_key=KEY)
    torch.nn.functional.cross_entropy(out, label[batch.output_nid]).backward()
    return out.detach(), gradients(model)


def _k_way(model, batch, feat, label, k, method, dtype):
    model.zero_grad(set_to_none=True)
    groups = partition_batch(batch, k, method, seed=3).groups
    accumulate_gradients(model, batch, groups, feat, label, k=k, dropout_key=KEY, dtype=dtype)
    return gradients(model)


LOSS_RTOL = 1e-5
"""Both backends train the same weights on the same blocks, so every epoch's loss agrees
to float32 rounding (betty's float32 exactness tolerance); a larger spread means the
two timed runs did not do the same work."""

EPOCH_PARTS = ("time_sample_s", "time_partition_s", "time_block_s", "time_compute_s", "epoch_time_s")


def time_epochs(spec: str, overrides: list[str], repeats: int,
                warmup: int = 1) -> dict[str, dict[str, list[float]]]:
    """``{backend: {part: [seconds per repeat]}}`` of epoch 0 of fresh trainers on the
    spec, the backends alternating (DGL first on even repeats), plus ``k``, ``loss``,
    after ``warmup`` untimed epochs per backend."""
    from workflow.components import load_data, make_trainer, resolve_device
    from workflow.specfile import load_spec

    if not any(o.startswith("train.threads=") for o in overrides):
        overrides = [*overrides, "train.threads=1"]
    if not any(o.startswith("train.pipeline=") for o in overrides):
        # serial: each part then lies inside the epoch's wall (pipelined, the carving
        # runs on the preparation thread while compute runs, and the parts overlap)
        overrides = [*overrides, "train.pipeline=false"]
    specs = {b: load_spec(spec, [*overrides, f"model.backend={b}"]) for b in ("dgl", "pyg")}
    start = time.perf_counter()
    dataset = load_data(specs["dgl"])  # applies train.threads; the same dataset for both
    print(f"dataset {specs['dgl'].spec.dataset.name}: {dataset.graph.num_nodes():,} nodes, "
          f"{dataset.graph.num_edges():,} edges, {int(dataset.train_idx.numel()):,} training nodes "
          f"(loaded in {time.perf_counter() - start:.1f} s)", flush=True)
    device = resolve_device(specs["dgl"].spec.train.device)
    times = {b: {part: [] for part in (*EPOCH_PARTS, "k", "loss")} for b in specs}
    for _ in range(warmup):  # untimed: first-call costs (allocator, kernels) would go to one backend
        for backend in specs:
            rec = make_trainer(specs[backend], dataset, device)[0].train_epoch(0)
            print(f"  warm-up {backend}: {rec.epoch_time_s:.2f} s", flush=True)
    for r in range(repeats):
        order = ("dgl", "pyg") if r % 2 == 0 else ("pyg", "dgl")
        for backend in order:
            trainer, model, _ = make_trainer(specs[backend], dataset, device)
            if model.backend_name != backend:
                raise RuntimeError(f"asked for backend {backend!r}, built {model.backend_name!r}")
            rec = trainer.train_epoch(0)
            for part in EPOCH_PARTS:
                times[backend][part].append(getattr(rec, part))
            times[backend]["k"].append(rec.k)
            times[backend]["loss"].append(rec.loss)
            print(f"  repeat {r} {backend}: K={rec.k} loss={rec.loss:.6f} epoch {rec.epoch_time_s:.2f} s "
                  f"(sample {rec.time_sample_s:.2f}, partition {rec.time_partition_s:.2f}, "
                  f"blocks {rec.time_block_s:.2f}, compute {rec.time_compute_s:.2f})", flush=True)
    ks = {k for b in times for k in times[b]["k"]}
    if len(ks) != 1:
        raise RuntimeError(f"the backends trained with different K: {ks}")
    losses = [loss for b in times for loss in times[b]["loss"]]
    spread = (max(losses) - min(losses)) / abs(losses[0])
    if spread > LOSS_RTOL:
        raise RuntimeError(f"the backends' epoch losses differ by {spread:.1e} relative (> {LOSS_RTOL:g}): "
                           f"{ {b: times[b]['loss'] for b in times} }")
    return times


def epoch_main(spec: str, overrides: list[str], repeats: int, warmup: int) -> None:
    times = time_epochs(spec, overrides, repeats, warmup)
    med = {b: {p: statistics.median(v) for p, v in parts.items()} for b, parts in times.items()}
    print(f"spec {spec} {' '.join(overrides)}: K={int(med['dgl']['k'])}, median of {repeats} epochs, "
          f"seconds")
    print(f"{'backend':8} {'sample':>8} {'partition':>10} {'blocks':>8} {'compute':>9} {'epoch':>8} "
          f"{'loss':>10}")
    for b in ("dgl", "pyg"):
        m = med[b]
        print(f"{b:8} {m['time_sample_s']:8.3f} {m['time_partition_s']:10.3f} {m['time_block_s']:8.3f} "
              f"{m['time_compute_s']:9.3f} {m['epoch_time_s']:8.3f} {m['loss']:10.6f}")
    train = {b: med[b]["time_block_s"] + med[b]["time_compute_s"] for b in med}
    print(f"pyg/dgl: epoch {med['pyg']['epoch_time_s'] / med['dgl']['epoch_time_s']:.2f}, "
          f"training (blocks + compute) {train['pyg'] / train['dgl']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epoch", metavar="SPEC", help="time whole epochs of this workflow spec")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="spec override (with --epoch), repeatable")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed epochs per backend before the timed ones (with --epoch)")
    args = parser.parse_args()
    if args.epoch:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        epoch_main(args.epoch, args.overrides, args.repeats, args.warmup)
        return
    torch.set_num_threads(1)
    g, feat, label, train = power_law_graph(num_nodes=args.nodes, avg_degree=8, seed=0)
    batch = sample_full_batch(g, train, [5, 8], seed=0)
    print(f"batch: {batch.num_outputs} outputs, {batch.layers[0].num_src} inputs, "
          f"{sum(l.num_edges for l in batch.layers)} edges")
    print(f"{'model':10} {'parity out':>11} {'parity grad':>12} {'dgl exact f64':>14} "
          f"{'dgl exact f32':>14} {'pyg exact f64':>14} {'pyg exact f32':>14} "
          f"{'dgl step s':>11} {'pyg step s':>11} {'pyg/dgl':>8}")
    for arch, agg in MODELS:
        name = f"{arch}-{agg}" if agg else arch
        d, p = _model(arch, agg, "dgl", torch.float64), _model(arch, agg, "pyg", torch.float64)
        p.load_state_dict(d.state_dict())
        out_d, grad_d = _full(d, batch, feat, label, torch.float64)
        out_p, grad_p = _full(p, batch, feat, label, torch.float64)
        parity_out = float((out_p - out_d).abs().max() / out_d.abs().max())
        parity_grad = max_relative_difference(grad_p, grad_d)
        exact = {}
        for backend in ("dgl", "pyg"):
            for dtype in (torch.float64, torch.float32):
                model = _model(arch, agg, backend, dtype)
                ref = full_batch_reference(model, batch, feat, label, dropout_key=KEY, dtype=dtype).grads
                exact[backend, dtype] = max(
                    max_relative_difference(_k_way(model, batch, feat, label, k, m, dtype), ref)
                    for m in ("range", "random", "reg") for k in (2, 3, 7))
        times = {"dgl": [], "pyg": []}
        models = {b: _model(arch, agg, b, torch.float32) for b in times}
        groups = partition_batch(batch, 4, "random", seed=3).groups
        for _ in range(args.repeats):
            for backend, model in models.items():
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                accumulate_gradients(model, batch, groups, feat, label, k=4, dropout_key=KEY,
                                     dtype=torch.float32)
                times[backend].append(time.perf_counter() - start)
        t_d, t_p = statistics.median(times["dgl"]), statistics.median(times["pyg"])
        exact_cols = " ".join(f"{exact[b, dt]:14.1e}" for b in ("dgl", "pyg")
                              for dt in (torch.float64, torch.float32))
        print(f"{name:10} {parity_out:11.1e} {parity_grad:12.1e} {exact_cols} "
              f"{t_d:11.4f} {t_p:11.4f} {t_p / t_d:8.2f}")


if __name__ == "__main__":
    main()
