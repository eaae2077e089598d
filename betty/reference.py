"""An independent full-batch reference for the exactness checks.

K-way accumulation (:func:`betty.train.accumulate_gradients`) partitions the outputs,
carves one micro-batch per group of the partition (:class:`betty.microbatch.Carver`) and sums
``Σ_k ∇L_k``. Comparing it with its own K=1 run would let a bug shared by partitioning,
carving, ID maps, dropout keys or loss scaling cancel out. The reference here shares
none of that code: the model runs once on the sampler's own per-layer edges
(``batch.layers`` turned into blocks as they are, no partition, no Carver), with

- the same node-keyed dropout: layer ``l``'s rows are keyed by
  ``batch.layers[l].src_nid`` (and GAT's attention dropout by ``layers[l].edge_id``);
- the canonical neighbour order, *asserted* on every layer: edges sorted by
  (destination, source global ID). For order-sensitive aggregators (LSTM) the reference
  is therefore the canonical-order full batch, not any other neighbour order;
- its own loss normalisation: ``mean`` over the N outputs of the per-node loss
  (cross-entropy, or the mean over T tasks of binary cross-entropy), computed with
  torch's own ``reduction="mean"``, not betty's ``Σ / N``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from betty.batch import LayerEdges, SampledBatch, layer_to_block
from betty.precision import Precision, input_dtype, parameter_dtype

__all__ = ["ReferenceResult", "full_batch_reference", "assert_canonical_order"]


@dataclass
class ReferenceResult:
    """The full-batch loss and a detached copy of every parameter gradient."""

    loss: float
    grads: dict[str, torch.Tensor]


def assert_canonical_order(layer: LayerEdges, index: int = 0) -> None:
    """Raise ``AssertionError`` unless the edges are sorted by (destination, source
    global ID): ``edge_dst`` non-decreasing and, within one destination,
    ``src_nid[edge_src]`` non-decreasing."""
    dst = layer.edge_dst
    if dst.numel() < 2:
        return
    gid = layer.src_nid[layer.edge_src]
    dst_step = dst[1:] - dst[:-1]
    same_dst = dst_step == 0
    ok = bool((dst_step >= 0).all()) and bool((gid[1:] >= gid[:-1])[same_dst].all())
    if not ok:
        raise AssertionError(f"layer {index}: edges are not in canonical neighbour order "
                             "(destination, then source global ID)")


def _mean_loss(logits: torch.Tensor, target: torch.Tensor, multilabel: bool) -> torch.Tensor:
    """Mean over the ``(N,)`` outputs of the per-node loss (for multi-label, every node
    has T tasks, so the mean over nodes of the mean over tasks is the mean over all
    ``N·T`` entries)."""
    if multilabel:
        return F.binary_cross_entropy_with_logits(logits, target.to(logits.dtype), reduction="mean")
    return F.cross_entropy(logits, target, reduction="mean")


def full_batch_reference(model: torch.nn.Module, batch: SampledBatch, feat: torch.Tensor,
                         label: torch.Tensor, *, dropout_key: int | None = None,
                         device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                         multilabel: bool = False, precision=None) -> ReferenceResult:
    """One forward and backward pass of ``model`` on the whole sampled batch.

    Args:
        model: a :class:`betty.models.BlockGNN` on ``device``; its mode (train/eval) is
            used as is and its gradients are overwritten.
        batch: the full sampled batch; every layer must be in canonical order.
        feat: ``(N_graph, F)`` host features; rows ``batch.input_nid`` are read.
        label: ``(N_graph,)`` int64 labels or ``(N_graph, T)`` multi-label targets.
        dropout_key: the step's key for node-keyed (and edge-keyed) dropout.
        device: where to run.
        dtype: cast the features to this dtype (default: the model's parameters' dtype).
        multilabel: use the multi-label loss.
        precision: a :class:`betty.precision.Precision` or its name (default ``32``):
            forward and loss under its autocast when mixed, loss taken in float32.

    Returns:
        The loss ``(1/N) Σ_v ℓ(v)`` and ``∇`` of it for every parameter (zeros where a
        parameter got no gradient).
    """
    for l, layer in enumerate(batch.layers):
        assert_canonical_order(layer, l)
    model.zero_grad(set_to_none=True)
    prec = Precision.parse(precision if precision is not None else "32")
    x = feat[batch.input_nid].to(device)
    cast = input_dtype(x.dtype, prec, dtype if dtype is not None else parameter_dtype(model))
    if cast is not None:
        x = x.to(cast)
    src_nids = [layer.src_nid.to(device) for layer in batch.layers]
    edge_ids = [layer.edge_id.to(device) for layer in batch.layers]
    backend = getattr(model, "backend_name", "auto")  # the model's backend (betty.backends)
    degrees = getattr(model, "needs_degrees", False)  # the sampler's whole-graph degrees
    blocks = [layer_to_block(layer, device, backend, degrees=degrees)
              for layer in batch.layers]  # edge order kept
    with prec.autocast(torch.device(device).type):
        logits = model(blocks, x, src_nids=src_nids, edge_ids=edge_ids,
                       dropout_key=dropout_key)
        loss = _mean_loss(logits, label[batch.output_nid].to(device), multilabel)
        if prec.mixed:
            loss = loss.float()
    loss.backward()
    grads = {name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return ReferenceResult(loss=float(loss.detach()), grads=grads)
