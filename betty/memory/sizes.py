"""The sizes the memory model reads: per layer, per micro-batch node and edge counts.

For P micro-batches of an L-layer batch, :class:`MicroBatchSizes` holds, per layer
``l`` (``0`` = input layer), vectors of length P:

* ``n_src[l]``, ``n_dst[l]``: source and destination nodes of the micro-batch's block;
* ``num_edges[l]``: its sampled edges;
* ``degrees[l]`` ``(D_l,)`` and ``degree_counts[l]`` ``(P, D_l)``: the distinct in-degrees
  found in layer ``l`` of any micro-batch and how many destinations of each micro-batch have each
  (the LSTM aggregator runs once per distinct in-degree, see :mod:`betty.memory.replay`).

:func:`split_sizes` computes them for a whole split without carving any block, from the
micro-batch-membership matrices of :func:`betty.partition.membership.micro_batch_membership`: with
``M_l`` ``(K, n_src[l])`` the 0/1 matrix "source s of layer l belongs to micro-batch k"
and ``M_L`` ``(K, n_out)`` the micro-batch matrix of the outputs,

    n_src[l]    = M_l 1,
    n_dst[l]    = M_{l+1} 1                        (layer l's destinations are layer l+1's sources),
    num_edges[l] = M_{l+1} deg_l,                  deg_l = in-degrees of the full batch's layer l,
    degree_counts[l][:, j] = M_{l+1} 1[deg_l == d_j],

which is exactly what :func:`betty.microbatch.carve` keeps (a micro-batch's destination keeps all
its sampled in-edges). :func:`micro_batch_sizes` reads the same numbers off carved
micro-batches (or a full :class:`~betty.batch.SampledBatch`); when a split's micro-batches are
carved anyway, :func:`carved_split_sizes` reads them off the carved micro-batches and keeps
them on the batch as that split's :func:`split_sizes`, so that neither the memory
estimate nor the split's redundancy (:func:`betty.partition.metrics.split_metrics`)
builds the membership matrices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch

from betty.batch import LayerEdges, MicroBatch, SampledBatch
from betty.microbatch import validate_groups

__all__ = ["MicroBatchSizes", "split_sizes", "carved_split_sizes", "stack_sizes", "micro_batch_sizes",
           "layer_sizes"]


@dataclass
class MicroBatchSizes:
    """Per-layer sizes of P micro-batches (see the module docstring)."""

    n_src: list[np.ndarray]
    n_dst: list[np.ndarray]
    num_edges: list[np.ndarray]
    degrees: list[np.ndarray]
    degree_counts: list[np.ndarray]

    @property
    def num_micro_batches(self) -> int:
        return int(self.n_src[0].shape[0])

    @property
    def num_layers(self) -> int:
        return len(self.n_src)

    @property
    def num_outputs(self) -> np.ndarray:
        return self.n_dst[-1]

    def micro_batch(self, p: int) -> "MicroBatchSizes":
        """The sizes of micro-batch ``p`` alone (P = 1)."""
        return MicroBatchSizes(
            [a[p:p + 1] for a in self.n_src], [a[p:p + 1] for a in self.n_dst],
            [a[p:p + 1] for a in self.num_edges], list(self.degrees),
            [c[p:p + 1] for c in self.degree_counts],
        )

    def as_dict(self, p: int = 0) -> dict:
        """JSON-ready sizes of micro-batch ``p``."""
        return {
            "n_src": [int(a[p]) for a in self.n_src],
            "n_dst": [int(a[p]) for a in self.n_dst],
            "num_edges": [int(a[p]) for a in self.num_edges],
            "distinct_in_degrees": [int((c[p] > 0).sum()) for c in self.degree_counts],
        }


def layer_sizes(layers: Sequence[LayerEdges]) -> MicroBatchSizes:
    """Sizes of one block chain (P = 1). The in-degree histogram is one bincount over
    the destinations' degrees, O(n_dst + max degree)."""
    n_src, n_dst, n_e, degs, counts = [], [], [], [], []
    for layer in layers:
        n_src.append(np.array([layer.num_src], dtype=np.float64))
        n_dst.append(np.array([layer.num_dst], dtype=np.float64))
        n_e.append(np.array([layer.num_edges], dtype=np.float64))
        histogram = np.bincount(layer.in_degrees().numpy(), minlength=1)
        present = np.flatnonzero(histogram)
        degs.append(present.astype(np.int64))
        counts.append(histogram[present].astype(np.float64)[None, :])
    return MicroBatchSizes(n_src, n_dst, n_e, degs, counts)


def stack_sizes(parts: Sequence[MicroBatchSizes]) -> MicroBatchSizes:
    """The sizes of several micro-batches as one :class:`MicroBatchSizes` (P = Σ parts' P), in
    order. Per layer the distinct in-degrees are the union of the parts' (ascending),
    and each part's counts move to those columns (zero where it has none)."""
    if not parts:
        raise ValueError("stack_sizes needs at least one part")
    layers = {part.num_layers for part in parts}
    if len(layers) != 1:
        raise ValueError(f"parts have different numbers of layers: {sorted(layers)}")
    n_layers = layers.pop()
    degs, counts = [], []
    for l in range(n_layers):
        union = np.unique(np.concatenate([part.degrees[l] for part in parts]))
        stacked = np.zeros((sum(part.num_micro_batches for part in parts), union.size), dtype=np.float64)
        row = 0
        for part in parts:
            rows = slice(row, row + part.num_micro_batches)
            stacked[rows, np.searchsorted(union, part.degrees[l])] = part.degree_counts[l]
            row += part.num_micro_batches
        degs.append(union.astype(np.int64))
        counts.append(stacked)

    def cat(name: str) -> list[np.ndarray]:
        return [np.concatenate([getattr(part, name)[l] for part in parts]) for l in range(n_layers)]

    return MicroBatchSizes(cat("n_src"), cat("n_dst"), cat("num_edges"), degs, counts)


def micro_batch_sizes(mb: MicroBatch | SampledBatch | MicroBatchSizes | Sequence[LayerEdges]) -> MicroBatchSizes:
    """Sizes of one (micro-)batch; a :class:`MicroBatchSizes` is returned unchanged."""
    if isinstance(mb, MicroBatchSizes):
        return mb
    if isinstance(mb, (MicroBatch, SampledBatch)):
        return layer_sizes(mb.layers)
    return layer_sizes(list(mb))


def split_sizes(batch: SampledBatch, groups, k: int) -> MicroBatchSizes:
    """Sizes of every micro-batch of the split ``groups`` of ``batch`` (no carving), micro-batch
    ``p`` in row ``p``. Kept on the batch for the latest split
    (:meth:`~betty.batch.SampledBatch.derived`), so the memory estimate and the split
    metrics of one split compute them once (or read what :func:`carved_split_sizes`
    recorded).

    Args:
        batch: the full sampled batch.
        groups: ``(n_out,)`` micro-batch of each output node, in ``[0, k)``, no empty micro-batch.
        k: number of micro-batches.
    """
    groups = validate_groups(groups, batch.num_outputs, k)
    return batch.derived(_sizes_key(groups, k), lambda: _membership_sizes(batch, groups, k),
                         slot="split_sizes")


def carved_split_sizes(batch: SampledBatch, groups, k: int, micro_batches: Sequence[MicroBatch]) -> MicroBatchSizes:
    """The sizes of the split ``groups`` of ``batch`` read off its carved micro-batches
    (``micro_batches[p]`` carved for micro-batch ``p``'s outputs, all ``k``), equal to
    :func:`split_sizes`' and kept on the batch as its value for this split.

    Raises:
        ValueError: the micro-batches are not the split's ``k`` micro-batches in order.
    """
    groups = validate_groups(groups, batch.num_outputs, k)
    if len(micro_batches) != k:
        raise ValueError(f"carved_split_sizes needs all {k} micro-batches, got {len(micro_batches)}")
    outputs = torch.bincount(groups, minlength=k)
    for p, mb in enumerate(micro_batches):
        index = mb.output_index
        if index.numel() != int(outputs[p]) or bool((groups[index] != p).any()):
            raise ValueError(f"micro_batches[{p}] does not hold the outputs of group {p} of the split")
    sizes = stack_sizes([layer_sizes(mb.layers) for mb in micro_batches])
    return batch.derived(_sizes_key(groups, k), lambda: sizes, slot="split_sizes")


def _sizes_key(groups: torch.Tensor, k: int) -> tuple:
    from betty.partition.membership import split_digest

    return ("split_sizes", k, split_digest(groups))


def _membership_sizes(batch: SampledBatch, groups: torch.Tensor, k: int) -> MicroBatchSizes:
    """:func:`split_sizes` from the micro-batch-membership matrices (see the module docstring)."""
    from betty.partition.membership import micro_batch_membership

    members = micro_batch_membership(batch, groups, k)  # M_0 .. M_{L-1}, (k, n_src[l]) each
    g = groups.numpy()
    n_out = batch.num_outputs
    out_member = sp.csr_matrix((np.ones(n_out), (g, np.arange(n_out))), shape=(k, n_out))
    n_src, n_dst, n_e, degs, counts = [], [], [], [], []
    for l, layer in enumerate(batch.layers):
        dst_m = members[l + 1] if l + 1 < batch.num_layers else out_member
        n_src.append(np.diff(members[l].indptr).astype(np.float64))
        n_dst.append(np.diff(dst_m.indptr).astype(np.float64))
        deg = layer.in_degrees().numpy()
        n_e.append(np.asarray(dst_m @ deg.astype(np.float64), dtype=np.float64).ravel())
        values, cnt = _degree_counts(dst_m, deg)
        degs.append(values)
        counts.append(cnt)
    return MicroBatchSizes(n_src, n_dst, n_e, degs, counts)


def _degree_counts(dst_m: sp.csr_matrix, deg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct in-degrees ``d_j`` that some micro-batch's destinations have, ascending, and
    ``(k, D)`` float64 counts: ``[p, j]`` = destinations of micro-batch ``p`` with in-degree
    ``d_j``. ``dst_m`` ``(k, n_dst)`` marks each micro-batch's destinations, ``deg``
    ``(n_dst,)`` their in-degrees. One bincount over ``(micro-batch, degree)`` pairs: O(nnz +
    max degree), no sort."""
    k = dst_m.shape[0]
    degree_of_entry = deg[dst_m.indices]
    present = np.flatnonzero(np.bincount(degree_of_entry, minlength=1))
    slot = np.zeros(int(present[-1]) + 1 if present.size else 1, dtype=np.int64)
    slot[present] = np.arange(present.size)
    group_of_entry = np.repeat(np.arange(k, dtype=np.int64), np.diff(dst_m.indptr))
    cnt = np.bincount(group_of_entry * present.size + slot[degree_of_entry], minlength=k * present.size)
    return present.astype(np.int64), cnt.reshape(k, present.size).astype(np.float64)
