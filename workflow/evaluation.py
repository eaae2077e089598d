"""Score a trained model on the validation and test splits: accuracy, or for multi-label
data the mean ROC-AUC over tasks (OGB's ``Evaluator`` for OGB datasets), after ``full``,
``sampled`` or, for ``revgnn``, ``multiview`` inference (:func:`rev_predictions`).

``evaluate.*`` keys: docs/workflow.md, *Specs* and *Reversible deep GNNs*.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from workflow.components import torch_dtype
from workflow.specfile import ResolvedSpec

__all__ = ["metric_suffix", "split_nodes", "rev_predictions", "evaluate_model"]


def metric_suffix(dataset) -> str:
    """``"rocauc"`` for multi-label datasets, else ``"acc"``."""
    return "rocauc" if dataset.multilabel else "acc"


def split_nodes(dataset, split: str) -> torch.Tensor:
    return {"train": dataset.train_idx, "valid": dataset.valid_idx, "test": dataset.test_idx}[split]


def rev_predictions(model, dataset, rspec: ResolvedSpec, device, *, train_k: int | None = None) -> torch.Tensor:
    """``(N, C)`` host scores of a RevGNN for every node: logits (``full``) or averaged
    probabilities (``multiview``, ``evaluate.parts`` or else ``train_k`` parts)."""
    from betty.rev.training import backend_graph, full_graph_inference, multiview_inference

    ev = rspec.spec.evaluate
    feat = dataset.feat.to(torch_dtype(rspec))
    if ev.inference == "full":
        return full_graph_inference(model, backend_graph(model, dataset.graph), feat, device=device).cpu()
    k = ev.parts or train_k
    if k is None:
        p = rspec.spec.partition
        if p.k == "auto":
            raise ValueError("evaluate.inference multiview with partition.k auto needs evaluate.parts "
                             "(or the K the training run chose)")
        k = int(p.k)
    k = min(int(k), dataset.num_nodes)
    transform = torch.sigmoid if dataset.multilabel else (lambda out: torch.softmax(out, dim=1))
    return multiview_inference(model, backend_graph(model, dataset.graph), feat, k, ev.views, method="random",
                               seed=rspec.spec.sampling.seed, device=device, transform=transform).cpu()


def evaluate_model(model, dataset, rspec: ResolvedSpec, device, *,
                   splits: Sequence[str] = ("valid", "test"),
                   progress: Callable[[int, int, int], None] | None = None,
                   train_k: int | None = None) -> dict[str, float]:
    """``{"valid_acc": ..., "test_acc": ...}`` (splits without nodes are left out).
    ``train_k``: the number of parts training used (``revgnn`` multi-view default)."""
    from betty.inference import evaluate_predictions, layerwise_inference, sampled_inference

    from workflow.components import uses_revgnn

    ev = rspec.spec.evaluate
    dtype = torch_dtype(rspec)
    ogb_name = dataset.ogb_name if dataset.is_ogb else None
    suffix = metric_suffix(dataset)
    wanted = {s: split_nodes(dataset, s) for s in splits}
    wanted = {s: idx for s, idx in wanted.items() if idx.numel() > 0}
    if not wanted:
        return {}
    logits_all = None
    if uses_revgnn(rspec):
        logits_all = rev_predictions(model, dataset, rspec, device, train_k=train_k)
    elif ev.inference == "full":
        logits_all = layerwise_inference(model, dataset.graph, dataset.feat, device=device,
                                         chunk_size=ev.chunk_size, dtype=dtype, progress=progress)
    out = {}
    for split, idx in wanted.items():
        if logits_all is not None:
            logits = logits_all[idx]
        else:
            fanouts = ev.fanouts or rspec.spec.sampling.fanouts
            logits = sampled_inference(model, dataset.graph, dataset.feat, idx, fanouts, device=device,
                                       chunk_size=ev.chunk_size, seed=rspec.spec.train.seed, dtype=dtype)
        scores = evaluate_predictions(logits, dataset.label[idx], multilabel=dataset.multilabel,
                                      ogb_name=ogb_name)
        out[f"{split}_{suffix}"] = scores[suffix]
    return out
