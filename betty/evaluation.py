"""Score a model on a dataset's splits, in the style of OGB's ``Evaluator.eval``: one call,
keyword arguments in, ``{"valid_acc": ..., "test_acc": ...}`` out.

:func:`evaluate_model` picks the inference from the model and ``inference``:

* a sampled-block model (:class:`betty.models.BlockGNN`: ``sage``/``gat``/``gcn``):
  ``"full"`` layer-wise full-neighbour inference of every node
  (:func:`betty.inference.layerwise_inference`) or ``"sampled"`` inference of each split's
  nodes with ``fanouts`` (:func:`betty.inference.sampled_inference`);
* a reversible model (:class:`betty.rev.model.RevGNN` or :class:`betty.rev.deq.RevGNNDEQ`,
  :func:`is_rev_model`): ``"full"`` whole-graph inference
  (:func:`betty.rev.training.full_graph_inference`) or ``"multiview"``: probabilities
  (softmax, or sigmoid for multi-label data) averaged over ``views`` random splits into
  ``parts`` parts, view ``v`` split with seed ``seed + v``
  (:func:`betty.rev.training.multiview_inference`).

The predictions are then scored by :func:`betty.inference.evaluate_predictions`:
accuracy, or for multi-label data the mean ROC-AUC over tasks (OGB's ``Evaluator`` for
OGB datasets).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch

__all__ = ["INFERENCE_MODES", "SPLITS", "evaluate_model", "is_rev_model", "metric_suffix", "split_nodes"]

INFERENCE_MODES = ("full", "sampled", "multiview")
"""Every ``inference`` :func:`evaluate_model` knows (which apply depends on the model)."""
SPLITS = ("train", "valid", "test")
"""The split names of a dataset (``dataset.train_idx``, ``valid_idx``, ``test_idx``)."""
DEFAULT_VIEWS = 10


def is_rev_model(model) -> bool:
    """Whether ``model`` is a reversible GNN (a :class:`betty.rev.model.RevGNN` or a
    :class:`betty.rev.deq.RevGNNDEQ`: the frame :class:`betty.rev.model.EncodeProcessDecode`
    they share), which runs on whole graphs or induced parts, not on sampled blocks."""
    from betty.rev.model import EncodeProcessDecode

    return isinstance(model, EncodeProcessDecode)


def metric_suffix(dataset) -> str:
    """``"rocauc"`` for multi-label datasets, else ``"acc"``: the metric names are
    ``f"{split}_{suffix}"``."""
    return "rocauc" if dataset.multilabel else "acc"


def split_nodes(dataset, split: str) -> torch.Tensor:
    """The node IDs of ``split`` (one of :data:`SPLITS`) of ``dataset``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    return getattr(dataset, f"{split}_idx")


def _allowed_modes(model) -> tuple[str, ...]:
    return ("full", "multiview") if is_rev_model(model) else ("full", "sampled")


def _is_int(value) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _check_positive(name: str, value, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be an int >= 1{' or None' if optional else ''}, got {value!r}")


def _check_arguments(model, splits, inference, fanouts, chunk_size, seed, dtype, views, parts,
                     train_k, progress) -> None:
    """Refuse what :func:`evaluate_model` cannot run, naming the argument and what is allowed."""
    if isinstance(splits, str):
        raise ValueError(f"splits must be a sequence of split names (e.g. ('valid',)), got the string {splits!r}")
    for split in splits:
        if split not in SPLITS:
            raise ValueError(f"splits: {split!r} is not a split; allowed: {', '.join(SPLITS)}")
    if inference not in INFERENCE_MODES:
        raise ValueError(f"inference must be one of {', '.join(INFERENCE_MODES)}, got {inference!r}")
    allowed = _allowed_modes(model)
    if inference not in allowed:
        raise ValueError(f"inference {inference!r} does not apply to a {type(model).__name__}; "
                         f"allowed: {', '.join(allowed)}")
    if inference == "sampled":
        if fanouts is None or isinstance(fanouts, (str, int)) or len(fanouts) == 0:
            raise ValueError(f"inference 'sampled' needs fanouts: one per layer, each an int >= 1 "
                             f"or -1 (all neighbours), got {fanouts!r}")
        if any(not _is_int(f) or f == 0 or f < -1 for f in fanouts):
            raise ValueError(f"fanouts must be ints >= 1 or -1 (all neighbours), got {list(fanouts)!r}")
        layers = getattr(model, "num_layers", len(fanouts))
        if len(fanouts) != layers:
            raise ValueError(f"fanouts must list one fanout per layer: {layers} for this "
                             f"{type(model).__name__}, got {list(fanouts)!r}")
    elif fanouts is not None:
        raise ValueError(f"fanouts apply to inference 'sampled' only (inference is {inference!r}); "
                         f"allowed here: None")
    if inference != "multiview":
        for name, value in (("views", views), ("parts", parts)):
            if value is not None:
                raise ValueError(f"{name} applies to inference 'multiview' only (inference is "
                                 f"{inference!r}); allowed here: None")
    _check_positive("chunk_size", chunk_size)
    _check_positive("views", views, optional=True)
    _check_positive("parts", parts, optional=True)
    if inference == "multiview":
        _check_positive("train_k", train_k, optional=True)
        if parts is None and train_k is None:
            raise ValueError("inference 'multiview' needs parts (or train_k, the number of parts "
                             "training used); allowed: an int >= 1")
    if not _is_int(seed):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    if progress is not None and not callable(progress):
        raise ValueError(f"progress must be a callable (layer, done, total) or None, got {progress!r}")


def _rev_scores(model, dataset, *, inference: str, views: int, k: int | None, seed: int,
                dtype: torch.dtype | None, device) -> torch.Tensor:
    """``(N, C)`` host scores of a reversible model for every node: logits (``full``) or
    averaged probabilities (``multiview``)."""
    from betty.rev.training import backend_graph, full_graph_inference, multiview_inference

    graph = backend_graph(model, dataset.graph)
    if inference == "full":
        return full_graph_inference(model, graph, dataset.feat, device=device, dtype=dtype).cpu()
    transform = torch.sigmoid if dataset.multilabel else (lambda out: torch.softmax(out, dim=1))
    return multiview_inference(model, graph, dataset.feat, min(int(k), dataset.num_nodes), views, method="random",
                               seed=seed, device=device, transform=transform, dtype=dtype).cpu()


def evaluate_model(model, dataset, *, splits: Sequence[str] = ("valid", "test"), inference: str = "full",
                   fanouts: Sequence[int] | None = None, chunk_size: int = 16384, seed: int = 0,
                   dtype: torch.dtype | None = None, views: int | None = None, parts: int | None = None,
                   train_k: int | None = None, device="cpu",
                   progress: Callable[[int, int, int], None] | None = None) -> dict[str, float]:
    """Score ``model`` on ``dataset``'s ``splits`` (see the module docstring).

    Args:
        model: a :class:`betty.models.BlockGNN` or a reversible model (:func:`is_rev_model`),
            on ``device``; it is put in eval mode (a block model's mode is restored after).
        dataset: a :class:`betty.data.GraphDataset` (``graph``, ``feat``, ``label``, the
            split indices, ``multilabel``, ``is_ogb``/``ogb_name``).
        splits: split names (:data:`SPLITS`); splits without nodes are left out.
        inference: ``"full"`` or ``"sampled"`` for a block model, ``"full"`` or
            ``"multiview"`` for a reversible one.
        fanouts: ``"sampled"`` only (and needed there): one fanout per layer, ``-1`` = all.
        chunk_size: destination nodes per chunk of a block model's inference.
        seed: seeds ``"sampled"`` (chunk ``i`` of a split: ``seed + i * chunk_size``) and
            ``"multiview"`` (view ``v``: ``seed + v``).
        dtype: compute dtype (default: the model's parameters').
        views: ``"multiview"`` only: partitions averaged (default 10).
        parts: ``"multiview"`` only: parts per partition (at most the number of nodes);
            default ``train_k``.
        train_k: the number of parts training used: the default of ``parts`` (ignored by
            the other inferences, so a training loop may always pass its K).
        device: where inference runs.
        progress: ``(layer, done, total)`` callback of ``"full"`` inference of a block model.

    Returns:
        ``{f"{split}_{metric_suffix(dataset)}": score}``: ``valid_acc``, ``test_acc``, or
        ``valid_rocauc``, ``test_rocauc`` for multi-label data.

    Raises:
        ValueError: an argument outside its allowed values (the message names it and them).
    """
    from betty.inference import evaluate_predictions, layerwise_inference, sampled_inference

    _check_arguments(model, splits, inference, fanouts, chunk_size, seed, dtype, views, parts,
                     train_k, progress)
    wanted = {s: split_nodes(dataset, s) for s in splits}
    wanted = {s: idx for s, idx in wanted.items() if idx.numel() > 0}
    if not wanted:
        return {}
    scores_all = None
    if is_rev_model(model):
        scores_all = _rev_scores(model, dataset, inference=inference, views=views or DEFAULT_VIEWS,
                                 k=parts or train_k, seed=seed, dtype=dtype, device=device)
    elif inference == "full":
        scores_all = layerwise_inference(model, dataset.graph, dataset.feat, device=device,
                                         chunk_size=chunk_size, dtype=dtype, progress=progress)
    suffix = metric_suffix(dataset)
    ogb_name = dataset.ogb_name if dataset.is_ogb else None
    out = {}
    for split, idx in wanted.items():
        if scores_all is not None:
            scores = scores_all[idx]
        else:
            scores = sampled_inference(model, dataset.graph, dataset.feat, idx, fanouts, device=device,
                                       chunk_size=chunk_size, seed=seed, dtype=dtype)
        metrics = evaluate_predictions(scores, dataset.label[idx], multilabel=dataset.multilabel,
                                       ogb_name=ogb_name)
        out[f"{split}_{suffix}"] = metrics[suffix]
    return out
