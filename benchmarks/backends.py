"""Cross-backend parity, PyG exactness and DGL-vs-PyG step time, measured side by side.

    python benchmarks/backends.py [--nodes 600] [--repeats 5]

Needs both DGL and PyTorch Geometric (``.venv``). On one sampled batch of the
``tests/graphs.py`` power-law graph (12 features, 5 classes, 2 layers, fanouts 5,8,
hidden 16, 2 GAT heads, dropout 0.5, attention dropout 0.25), prints per model:

1. parity: the same weights on the same blocks, DGL vs PyG, float64: max relative
   difference of the outputs and of the gradients (``betty.train.max_relative_difference``);
2. exactness on the PyG backend: the worst relative gradient error of K-way
   accumulation (K in 2, 3, 7; range, random, reg) against
   ``betty.reference.full_batch_reference``, float64 and float32;
3. step time: median over ``--repeats`` of one K=4 accumulation step (float32) on each
   backend, and the PyG/DGL ratio (same process, alternating backends).
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g, feat, label, train = power_law_graph(num_nodes=args.nodes, avg_degree=8, seed=0)
    batch = sample_full_batch(g, train, [5, 8], seed=0)
    print(f"batch: {batch.num_outputs} outputs, {batch.layers[0].num_src} inputs, "
          f"{sum(l.num_edges for l in batch.layers)} edges")
    print(f"{'model':10} {'parity out':>11} {'parity grad':>12} {'pyg exact f64':>14} "
          f"{'pyg exact f32':>14} {'dgl step s':>11} {'pyg step s':>11} {'pyg/dgl':>8}")
    for arch, agg in MODELS:
        name = f"{arch}-{agg}" if agg else arch
        d, p = _model(arch, agg, "dgl", torch.float64), _model(arch, agg, "pyg", torch.float64)
        p.load_state_dict(d.state_dict())
        out_d, grad_d = _full(d, batch, feat, label, torch.float64)
        out_p, grad_p = _full(p, batch, feat, label, torch.float64)
        parity_out = float((out_p - out_d).abs().max() / out_d.abs().max())
        parity_grad = max_relative_difference(grad_p, grad_d)
        exact = {}
        for dtype in (torch.float64, torch.float32):
            model = _model(arch, agg, "pyg", dtype)
            ref = full_batch_reference(model, batch, feat, label, dropout_key=KEY, dtype=dtype).grads
            exact[dtype] = max(max_relative_difference(_k_way(model, batch, feat, label, k, m, dtype), ref)
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
        print(f"{name:10} {parity_out:11.1e} {parity_grad:12.1e} {exact[torch.float64]:14.1e} "
              f"{exact[torch.float32]:14.1e} {t_d:11.4f} {t_p:11.4f} {t_p / t_d:8.2f}")


if __name__ == "__main__":
    main()
