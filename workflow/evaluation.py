"""The spec's ``evaluate`` section as the arguments of :func:`betty.evaluation.evaluate_model`,
which scores a model on the validation and test splits (``full``, ``sampled`` or, for
``revgnn``, ``multiview`` inference; accuracy or the mean ROC-AUC).

``evaluate.*`` keys: docs/workflow.md, *Specs* and *Reversible deep GNNs*.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from betty import evaluation

from workflow.components import torch_dtype
from workflow.specfile import ResolvedSpec

__all__ = ["evaluation_options", "evaluate_model"]


def evaluation_options(rspec: ResolvedSpec, *, train_k: int | None = None) -> dict[str, Any]:
    """The keyword arguments of :func:`betty.evaluation.evaluate_model` the spec gives:
    ``evaluate.inference`` and ``evaluate.chunk_size``, ``train.dtype``; for ``sampled``
    the fanouts (``evaluate.fanouts``, else the training fanouts) seeded by ``train.seed``;
    for ``multiview`` ``evaluate.views`` and ``evaluate.parts``, else ``train_k`` (the K of
    the training run), else an integer ``partition.k``, seeded by ``sampling.seed``."""
    spec = rspec.spec
    ev = spec.evaluate
    options: dict[str, Any] = {"inference": ev.inference, "chunk_size": ev.chunk_size,
                               "dtype": torch_dtype(rspec), "seed": spec.train.seed}
    if ev.inference == "sampled":
        options["fanouts"] = ev.fanouts or spec.sampling.fanouts
    elif ev.inference == "multiview":
        if ev.parts is None and train_k is None:
            if spec.partition.k == "auto":
                raise ValueError("evaluate.inference multiview with partition.k auto needs evaluate.parts "
                                 "(or the K the training run chose)")
            train_k = int(spec.partition.k)
        options.update(views=ev.views, parts=ev.parts, train_k=train_k, seed=spec.sampling.seed)
    return options


def evaluate_model(model, dataset, rspec: ResolvedSpec, device, *,
                   splits: Sequence[str] = ("valid", "test"),
                   train_k: int | None = None) -> dict[str, float]:
    """``{"valid_acc": ..., "test_acc": ...}`` (splits without nodes are left out) with the
    spec's options (:func:`evaluation_options`). ``train_k``: the number of parts training
    used (``revgnn`` multi-view default)."""
    return evaluation.evaluate_model(model, dataset, splits=splits, device=device,
                                     **evaluation_options(rspec, train_k=train_k))
