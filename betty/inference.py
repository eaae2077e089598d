"""Layer-wise inference and evaluation metrics.

Full-neighbour inference computes layer l for *every* node of the graph before moving
to layer l+1, in chunks of destination nodes, so each node's representation is computed
once per layer (no L-hop neighbourhood explosion) and memory stays bounded by one chunk's
in-edges. This is the standard way to evaluate sampled GNNs (DGL's and OGB's examples).

Neighbours are listed in canonical order (ascending global ID), as in training. A model
scored on a dataset's splits in one call (the inference chosen from the model and
options): :func:`betty.evaluation.evaluate_model`.
"""

from __future__ import annotations

import numpy as np
import torch

from betty.batch import LayerEdges, layer_to_block
from betty.precision import parameter_dtype
from betty.sampling import sample_full_batch, sampler_graph

__all__ = ["in_edge_block", "layerwise_inference", "sampled_inference", "evaluate_predictions"]


def in_edge_block(graph, dst_nid: torch.Tensor, fanout: int = -1, *, seed: int = 0) -> LayerEdges:
    """The one-layer block of ``dst_nid``'s in-edges (all of them, or ``fanout`` sampled
    with ``seed``): layer 0 of :func:`betty.sampling.sample_full_batch` on ``dst_nid``.

    Source order: the destinations, then the other sources by ascending global ID; edges
    in canonical order.
    """
    return sample_full_batch(graph, dst_nid, [fanout], seed=seed).layers[0]


@torch.no_grad()
def layerwise_inference(model, graph, feat: torch.Tensor, *, device="cpu",
                        chunk_size: int = 16384, dtype: torch.dtype | None = None,
                        progress=None) -> torch.Tensor:
    """Full-neighbour inference for every node: ``(N, out_feats)`` logits on the host.

    Args:
        model: a :class:`betty.models.BlockGNN` with ``widths`` (its layer widths).
        graph: the whole graph (or a :class:`~betty.sampling.NeighbourSource`).
        feat: ``(N, F)`` host features (or rows read by node ID, ``feat[ids]``).
        device: where each chunk runs.
        chunk_size: destination nodes per chunk.
        dtype: compute dtype (default: the model's parameters' dtype).
        progress: optional callable ``(layer, done, total)`` for progress displays.
    """
    dtype = parameter_dtype(model) if dtype is None else dtype
    graph = sampler_graph(graph)  # once: a Graph's CSR then serves every chunk
    was_training = model.training
    model.eval()
    n = graph.num_nodes()
    h = feat
    try:
        for l in range(model.num_layers):
            out = None
            for start in range(0, n, chunk_size):
                dst = torch.arange(start, min(n, start + chunk_size), dtype=torch.int64)
                layer = in_edge_block(graph, dst)
                x = h[layer.src_nid].to(device)
                x = x.to(dtype)
                block = layer_to_block(layer, device, model.backend_name,
                                       degrees=getattr(model, "needs_degrees", False))
                y = model.forward_layer(l, block, x)
                if out is None:
                    out = torch.empty(n, y.shape[1], dtype=y.dtype)
                out[start:start + dst.numel()] = y.cpu()
                if progress is not None:
                    progress(l, start + dst.numel(), n)
            h = out
    finally:
        model.train(was_training)
    return h


@torch.no_grad()
def sampled_inference(model, graph, feat: torch.Tensor, nodes: torch.Tensor, fanouts,
                      *, device="cpu", chunk_size: int = 16384, seed: int = 0,
                      dtype: torch.dtype | None = None) -> torch.Tensor:
    """Logits ``(len(nodes), out)`` from sampled neighbourhoods (cheaper than full
    inference on huge graphs; stochastic, seeded); features cast to ``dtype`` (default: the
    model's parameters' dtype)."""
    from betty.microbatch import carve

    dtype = parameter_dtype(model) if dtype is None else dtype
    graph = sampler_graph(graph)  # once: a Graph's CSR then serves every chunk
    was_training = model.training
    model.eval()
    nodes = torch.as_tensor(nodes, dtype=torch.int64)
    outs = []
    try:
        for start in range(0, nodes.numel(), chunk_size):
            chunk = nodes[start:start + chunk_size]
            order = torch.argsort(chunk)
            batch = sample_full_batch(graph, chunk[order], fanouts, seed=seed + start)
            mb = carve(batch, torch.arange(batch.num_outputs))
            x = feat[mb.input_nid].to(device)
            x = x.to(dtype)
            y = model(model.make_blocks(mb.layers, device), x).cpu()
            res = torch.empty_like(y)
            res[order] = y
            outs.append(res)
    finally:
        model.train(was_training)
    return torch.cat(outs)


def evaluate_predictions(logits: torch.Tensor, label: torch.Tensor, *, multilabel: bool = False,
                         ogb_name: str | None = None) -> dict[str, float]:
    """Score predictions.

    Single-label: ``{"acc": ...}`` (through OGB's ``Evaluator`` when ``ogb_name`` is
    given). Multi-label: ``{"rocauc": ...}`` (mean ROC-AUC over tasks, OGB's definition).
    Scores with a NaN or infinite entry (a diverged model) score NaN, which never counts
    as an improvement (:class:`betty.selection.BestValidation`): an argmax over NaN
    would name a class, and the accuracy would look like the share of that class.

    Args:
        logits: ``(n, C)`` or ``(n, T)`` scores.
        label: ``(n,)`` (or OGB's ``(n, 1)``) int64, or ``(n, T)`` 0/1.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be (n, C), got shape {tuple(logits.shape)}")
    if not multilabel and label.dim() == 2 and label.shape[1] == 1:
        label = label.view(-1)  # OGB's (n, 1) class labels
    if multilabel and label.shape != logits.shape:
        raise ValueError(f"multi-label targets {tuple(label.shape)} and scores {tuple(logits.shape)} "
                         "must have one column per task each")
    if not multilabel and label.dim() != 1:
        raise ValueError(f"class labels must be (n,) or (n, 1), got shape {tuple(label.shape)}")
    if logits.shape[0] != label.shape[0]:
        raise ValueError(f"{logits.shape[0]} predictions for {label.shape[0]} labels")
    if logits.shape[0] == 0:
        raise ValueError("nothing to evaluate: no nodes in this split")
    if not bool(torch.isfinite(logits).all()):
        return {"rocauc" if multilabel else "acc": float("nan")}
    if ogb_name is not None:
        from ogb.nodeproppred import Evaluator

        evaluator = Evaluator(ogb_name)
        if multilabel:
            return {"rocauc": float(evaluator.eval({"y_true": label.numpy(),
                                                     "y_pred": logits.float().numpy()})["rocauc"])}
        return {"acc": float(evaluator.eval({"y_true": label.view(-1, 1).numpy(),
                                              "y_pred": logits.argmax(1).view(-1, 1).numpy()})["acc"])}
    if multilabel:
        return {"rocauc": _mean_rocauc(label.numpy(), logits.float().numpy())}
    return {"acc": float((logits.argmax(1) == label).float().mean())}


def _mean_rocauc(y_true: np.ndarray, y_score: np.ndarray) -> float:
    """Mean over tasks that have both classes of the ROC-AUC (rank formulation)."""
    from scipy.stats import rankdata

    aucs = []
    for t in range(y_true.shape[1]):
        y = y_true[:, t] > 0.5
        pos, neg = int(y.sum()), int((~y).sum())
        if pos == 0 or neg == 0:
            continue
        ranks = rankdata(y_score[:, t])
        aucs.append((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))
    if not aucs:
        raise ValueError("no task has both positive and negative labels")
    return float(np.mean(aucs))
