"""Score a trained model on the validation and test splits.

The metric is accuracy for single-label datasets and mean ROC-AUC over tasks for
multi-label ones (ogbn-proteins); OGB datasets are scored by OGB's own ``Evaluator``
(``betty.inference.evaluate_predictions(ogb_name=...)``). Metric names:
``valid_acc``/``test_acc`` or ``valid_rocauc``/``test_rocauc``.

``evaluate.inference: full`` (default) runs layer-wise full-neighbour inference over the
whole graph once and reads every split from it; ``sampled`` samples each split's
neighbourhoods with ``evaluate.fanouts`` (default: the training fanouts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from workflow.components import torch_dtype
from workflow.specfile import ResolvedSpec

__all__ = ["metric_suffix", "split_nodes", "evaluate_model"]


def metric_suffix(dataset) -> str:
    """``"rocauc"`` for multi-label datasets, else ``"acc"``."""
    return "rocauc" if dataset.multilabel else "acc"


def split_nodes(dataset, split: str) -> torch.Tensor:
    return {"train": dataset.train_idx, "valid": dataset.valid_idx, "test": dataset.test_idx}[split]


def evaluate_model(model, dataset, rspec: ResolvedSpec, device, *,
                   splits: Sequence[str] = ("valid", "test"),
                   progress: Callable[[int, int, int], None] | None = None) -> dict[str, float]:
    """``{"valid_acc": ..., "test_acc": ...}`` (splits without nodes are left out)."""
    from betty.inference import evaluate_predictions, layerwise_inference, sampled_inference

    ev = rspec.spec.evaluate
    dtype = torch_dtype(rspec)
    ogb_name = dataset.ogb_name if dataset.is_ogb else None
    suffix = metric_suffix(dataset)
    wanted = {s: split_nodes(dataset, s) for s in splits}
    wanted = {s: idx for s, idx in wanted.items() if idx.numel() > 0}
    if not wanted:
        return {}
    logits_all = None
    if ev.inference == "full":
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
