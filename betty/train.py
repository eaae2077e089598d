"""Exact gradient accumulation over the micro-batches of one sampled batch.

For a full batch with output nodes V (|V| = N) split into pieces V_1..V_K, the
full-batch loss is ``L = (1/N) Σ_{v in V} ℓ(v)``. Micro-batch k contributes

    L_k = (1/N) Σ_{v in V_k} ℓ(v),        Σ_k L_k = L,

and because every node of V_k sees exactly its full-batch sampled neighbourhood (and,
with deterministic dropout, its full-batch dropout masks), ``Σ_k ∇L_k = ∇L``: K
backward passes followed by one optimizer step give the full-batch update to
floating-point tolerance. For multi-label targets ``ℓ(v)`` is the mean binary
cross-entropy over the T tasks.

Only one micro-batch's blocks, features and activations are on the device at a time:
its input features are gathered from the host feature matrix and moved per micro-batch,
and everything is released before the next one starts.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from betty.batch import MicroBatch, SampledBatch
from betty.microbatch import Carver, validate_groups

__all__ = [
    "MicroBatchRecord",
    "StepResult",
    "train_step",
    "accumulate_gradients",
    "node_loss_sum",
    "build_optimizer",
    "OPTIMIZERS",
]

OPTIMIZERS = ("adam", "sgd")


def build_optimizer(name: str, params: Iterable, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """``"adam"`` or ``"sgd"`` over ``params``."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def node_loss_sum(logits: torch.Tensor, target: torch.Tensor, multilabel: bool = False) -> torch.Tensor:
    """Σ over nodes of the per-node loss.

    Single-label: cross-entropy, ``logits (n, C)``, ``target (n,)`` int64.
    Multi-label: mean over T tasks of binary cross-entropy with logits,
    ``logits, target (n, T)``.
    """
    if multilabel:
        per_elem = F.binary_cross_entropy_with_logits(logits, target.to(logits.dtype), reduction="none")
        return per_elem.mean(1).sum()
    return F.cross_entropy(logits, target, reduction="sum")


def _correct(logits: torch.Tensor, target: torch.Tensor, multilabel: bool) -> float:
    if multilabel:  # fraction of correct task predictions, summed over nodes
        return float(((logits > 0) == (target > 0.5)).float().mean(1).sum())
    return float((logits.argmax(1) == target).sum())


@dataclass
class MicroBatchRecord:
    """What happened in one micro-batch."""

    index: int
    num_outputs: int
    num_inputs: int
    num_edges: int
    loss: float
    time_block_s: float
    time_compute_s: float
    peak_bytes: int | None = None


@dataclass
class StepResult:
    """One optimizer step over K micro-batches.

    Attributes:
        loss: the full-batch loss ``Σ_k L_k``.
        train_acc: accuracy over the batch's output nodes (fraction of correct tasks
            for multi-label).
        micro: one record per micro-batch.
    """

    loss: float
    train_acc: float
    micro: list[MicroBatchRecord] = field(default_factory=list)

    @property
    def k(self) -> int:
        return len(self.micro)

    @property
    def time_block_s(self) -> float:
        return sum(m.time_block_s for m in self.micro)

    @property
    def time_compute_s(self) -> float:
        return sum(m.time_compute_s for m in self.micro)

    @property
    def peak_bytes(self) -> int | None:
        peaks = [m.peak_bytes for m in self.micro if m.peak_bytes is not None]
        return max(peaks) if peaks else None


def _device_ids(model, mb: MicroBatch, device):
    """Global node/edge IDs on the device, only when the model's dropout needs them."""
    src = eid = None
    if model.training and getattr(model, "needs_node_ids", True):
        src = [layer.src_nid.to(device, copy=True) for layer in mb.layers]
    if model.training and getattr(model, "needs_edge_ids", True):
        eid = [layer.edge_id.to(device, copy=True) for layer in mb.layers]
    return src, eid


def _to_device_blocks(mb: MicroBatch, device, model=None) -> list:
    """Blocks of ``model``'s backend (``auto`` without a model) on ``device``; index
    tensors are always copied (counted per micro-batch)."""
    from betty.backends import backend_of

    return backend_of(model).make_blocks(mb.layers, device, copy=True)


def _micro_batches(batch: SampledBatch, groups: torch.Tensor, k: int,
                   pieces: Collection[int] | None = None) -> Iterable[tuple[int, MicroBatch, float]]:
    """Yield (piece index, micro-batch, seconds to carve it) lazily, one piece at a
    time, for the pieces in ``pieces`` (default: all K)."""
    start = time.perf_counter()
    carver = Carver(batch)
    order = torch.argsort(groups, stable=True)
    sizes = torch.bincount(groups, minlength=k).tolist()
    setup = time.perf_counter() - start
    for piece, idx in enumerate(torch.split(order, sizes)):
        if pieces is not None and piece not in pieces:
            continue
        start = time.perf_counter()
        mb = carver.carve(idx)
        yield piece, mb, time.perf_counter() - start + setup
        setup = 0.0


def accumulate_gradients(
    model: torch.nn.Module,
    batch: SampledBatch,
    groups: torch.Tensor,
    feat: torch.Tensor,
    label: torch.Tensor,
    *,
    k: int | None = None,
    device: torch.device | str = "cpu",
    dropout_key: int | None = None,
    multilabel: bool = False,
    meter=None,
    dtype: torch.dtype | None = None,
    pieces: Collection[int] | None = None,
) -> StepResult:
    """Forward and backward every micro-batch, accumulating into ``.grad``.

    Does not zero gradients and does not step: see :func:`train_step`.

    Args:
        model: a :class:`betty.models.BlockGNN` (already on ``device``).
        batch: the full sampled batch.
        groups: ``(n_out,)`` piece of each output node (``batch.output_nid`` order).
        feat: ``(N, F)`` host feature matrix of the whole graph.
        label: ``(N,)`` int64 labels or ``(N, T)`` multi-label targets.
        k: number of pieces (default ``groups.max() + 1``).
        device: where micro-batches run.
        dropout_key: key for deterministic dropout masks.
        multilabel: use the multi-label loss.
        meter: optional :class:`betty.memory.meter.MemoryMeter`; one region per
            micro-batch (carving, which happens on the host, is outside it).
        dtype: cast features to this dtype on the device (default: keep).
        pieces: run only these piece indices (default: all K); the normalisation stays
            the global ``1/|outputs|``, so the loss, accuracy and gradients returned are
            those pieces' shares of the full-batch ones (data parallelism,
            :mod:`betty.distributed`).
    """
    groups = torch.as_tensor(groups, dtype=torch.int64)
    if k is None:
        k = int(groups.max()) + 1
    groups = validate_groups(groups, batch.num_outputs, k)
    n_total = batch.num_outputs
    total_loss, total_correct = 0.0, 0.0
    records: list[MicroBatchRecord] = []
    if pieces is not None:
        pieces = frozenset(int(p) for p in pieces)
    for index, mb, t_carve in _micro_batches(batch, groups, k, pieces):
        region = meter.measure() if meter is not None else nullcontext()
        with region as reading:
            start = time.perf_counter()
            blocks = _to_device_blocks(mb, device, model)
            src_nids, edge_ids = _device_ids(model, mb, device)
            t_block = t_carve + time.perf_counter() - start

            start = time.perf_counter()
            x = feat[mb.input_nid].to(device)
            if dtype is not None:
                x = x.to(dtype)
            y = label[mb.output_nid].to(device)
            logits = model(blocks, x, src_nids=src_nids, edge_ids=edge_ids, dropout_key=dropout_key)
            loss = node_loss_sum(logits, y, multilabel) / n_total
            loss.backward()
            piece_loss = float(loss.detach())
            total_loss += piece_loss
            total_correct += _correct(logits.detach(), y, multilabel)
            del blocks, src_nids, edge_ids, x, y, logits, loss
            t_compute = time.perf_counter() - start
        records.append(
            MicroBatchRecord(
                index=index,
                num_outputs=mb.num_outputs,
                num_inputs=mb.layers[0].num_src,
                num_edges=sum(layer.num_edges for layer in mb.layers),
                loss=piece_loss,
                time_block_s=t_block,
                time_compute_s=t_compute,
                peak_bytes=None if reading is None else reading.peak_bytes,
            )
        )
    return StepResult(loss=total_loss, train_acc=total_correct / n_total, micro=records)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: SampledBatch,
    groups: torch.Tensor,
    feat: torch.Tensor,
    label: torch.Tensor,
    **kwargs,
) -> StepResult:
    """Zero gradients, accumulate over all micro-batches, take one optimizer step.

    Keyword arguments are those of :func:`accumulate_gradients`.
    """
    model.train()
    optimizer.zero_grad(set_to_none=True)
    result = accumulate_gradients(model, batch, groups, feat, label, **kwargs)
    optimizer.step()
    return result


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every parameter gradient (zeros where none was produced)."""
    return {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
    }


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``max over parameters of ||a - b|| / max(||b||, tiny)`` (Frobenius norms)."""
    worst = 0.0
    for name, ref in b.items():
        denom = max(float(ref.norm()), torch.finfo(ref.dtype).tiny)
        worst = max(worst, float((a[name] - ref).norm()) / denom)
    return worst


__all__ += ["gradients", "max_relative_difference"]
