"""The sizes the memory model reads: per layer, per micro-batch node and edge counts.

For P micro-batches (pieces) of an L-layer batch, :class:`PieceSizes` holds, per layer
``l`` (``0`` = input layer), vectors of length P:

* ``n_src[l]``, ``n_dst[l]``: source and destination nodes of the piece's block;
* ``num_edges[l]``: its sampled edges;
* ``degrees[l]`` ``(D_l,)`` and ``degree_counts[l]`` ``(P, D_l)``: the distinct in-degrees
  found in layer ``l`` of any piece and how many destinations of each piece have each
  (the LSTM aggregator runs once per distinct in-degree, see :mod:`betty.memory.replay`).

:func:`piece_sizes` computes them for a whole split without carving any block, from the
piece-membership matrices of :func:`betty.partition.membership.piece_membership`: with
``M_l`` ``(K, n_src[l])`` the 0/1 matrix "source s of layer l belongs to piece k's
micro-batch" and ``M_L`` ``(K, n_out)`` the piece matrix of the outputs,

    n_src[l]    = M_l 1,
    n_dst[l]    = M_{l+1} 1                        (layer l's destinations are layer l+1's sources),
    num_edges[l] = M_{l+1} deg_l,                  deg_l = in-degrees of the full batch's layer l,
    degree_counts[l][:, j] = M_{l+1} 1[deg_l == d_j],

which is exactly what :func:`betty.microbatch.carve` keeps (a piece's destination keeps all
its sampled in-edges). :func:`micro_batch_sizes` reads the same numbers off carved
micro-batches (or a full :class:`~betty.batch.SampledBatch`); when a split's pieces are
carved anyway, :func:`carved_piece_sizes` reads them off the carved pieces and keeps
them on the batch as that split's :func:`piece_sizes`, so that neither the memory
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

__all__ = ["PieceSizes", "piece_sizes", "carved_piece_sizes", "stack_sizes", "micro_batch_sizes",
           "layer_sizes"]


@dataclass
class PieceSizes:
    """Per-layer sizes of P micro-batches (see the module docstring)."""

    n_src: list[np.ndarray]
    n_dst: list[np.ndarray]
    num_edges: list[np.ndarray]
    degrees: list[np.ndarray]
    degree_counts: list[np.ndarray]

    @property
    def num_pieces(self) -> int:
        return int(self.n_src[0].shape[0])

    @property
    def num_layers(self) -> int:
        return len(self.n_src)

    @property
    def num_outputs(self) -> np.ndarray:
        return self.n_dst[-1]

    def piece(self, p: int) -> "PieceSizes":
        """The sizes of piece ``p`` alone (P = 1)."""
        return PieceSizes(
            [a[p:p + 1] for a in self.n_src], [a[p:p + 1] for a in self.n_dst],
            [a[p:p + 1] for a in self.num_edges], list(self.degrees),
            [c[p:p + 1] for c in self.degree_counts],
        )

    def as_dict(self, p: int = 0) -> dict:
        """JSON-ready sizes of piece ``p``."""
        return {
            "n_src": [int(a[p]) for a in self.n_src],
            "n_dst": [int(a[p]) for a in self.n_dst],
            "num_edges": [int(a[p]) for a in self.num_edges],
            "distinct_in_degrees": [int((c[p] > 0).sum()) for c in self.degree_counts],
        }


def layer_sizes(layers: Sequence[LayerEdges]) -> PieceSizes:
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
    return PieceSizes(n_src, n_dst, n_e, degs, counts)


def stack_sizes(parts: Sequence[PieceSizes]) -> PieceSizes:
    """The sizes of several pieces as one :class:`PieceSizes` (P = Σ parts' P), in
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
        stacked = np.zeros((sum(part.num_pieces for part in parts), union.size), dtype=np.float64)
        row = 0
        for part in parts:
            rows = slice(row, row + part.num_pieces)
            stacked[rows, np.searchsorted(union, part.degrees[l])] = part.degree_counts[l]
            row += part.num_pieces
        degs.append(union.astype(np.int64))
        counts.append(stacked)

    def cat(name: str) -> list[np.ndarray]:
        return [np.concatenate([getattr(part, name)[l] for part in parts]) for l in range(n_layers)]

    return PieceSizes(cat("n_src"), cat("n_dst"), cat("num_edges"), degs, counts)


def micro_batch_sizes(mb: MicroBatch | SampledBatch | PieceSizes | Sequence[LayerEdges]) -> PieceSizes:
    """Sizes of one (micro-)batch; a :class:`PieceSizes` is returned unchanged."""
    if isinstance(mb, PieceSizes):
        return mb
    if isinstance(mb, (MicroBatch, SampledBatch)):
        return layer_sizes(mb.layers)
    return layer_sizes(list(mb))


def piece_sizes(batch: SampledBatch, groups, k: int) -> PieceSizes:
    """Sizes of every piece of the split ``groups`` of ``batch`` (no carving), piece
    ``p`` in row ``p``. Kept on the batch for the latest split
    (:meth:`~betty.batch.SampledBatch.derived`), so the memory estimate and the split
    metrics of one split compute them once (or read what :func:`carved_piece_sizes`
    recorded).

    Args:
        batch: the full sampled batch.
        groups: ``(n_out,)`` piece of each output node, in ``[0, k)``, no empty piece.
        k: number of pieces.
    """
    groups = validate_groups(groups, batch.num_outputs, k)
    return batch.derived(_sizes_key(groups, k), lambda: _membership_sizes(batch, groups, k),
                         slot="piece_sizes")


def carved_piece_sizes(batch: SampledBatch, groups, k: int, micro_batches: Sequence[MicroBatch]) -> PieceSizes:
    """The sizes of the split ``groups`` of ``batch`` read off its carved pieces
    (``micro_batches[p]`` carved for piece ``p``'s outputs, all ``k``), equal to
    :func:`piece_sizes`' and kept on the batch as its value for this split.

    Raises:
        ValueError: the micro-batches are not the split's ``k`` pieces in order.
    """
    groups = validate_groups(groups, batch.num_outputs, k)
    if len(micro_batches) != k:
        raise ValueError(f"carved_piece_sizes needs all {k} pieces, got {len(micro_batches)}")
    outputs = torch.bincount(groups, minlength=k)
    for p, mb in enumerate(micro_batches):
        index = mb.output_index
        if index.numel() != int(outputs[p]) or bool((groups[index] != p).any()):
            raise ValueError(f"micro-batch {p} does not hold the outputs of piece {p}")
    sizes = stack_sizes([layer_sizes(mb.layers) for mb in micro_batches])
    return batch.derived(_sizes_key(groups, k), lambda: sizes, slot="piece_sizes")


def _sizes_key(groups: torch.Tensor, k: int) -> tuple:
    from betty.partition.membership import split_digest

    return ("piece_sizes", k, split_digest(groups))


def _membership_sizes(batch: SampledBatch, groups: torch.Tensor, k: int) -> PieceSizes:
    """:func:`piece_sizes` from the piece-membership matrices (see the module docstring)."""
    from betty.partition.membership import piece_membership

    members = piece_membership(batch, groups, k)  # M_0 .. M_{L-1}, (k, n_src[l]) each
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
    return PieceSizes(n_src, n_dst, n_e, degs, counts)


def _degree_counts(dst_m: sp.csr_matrix, deg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct in-degrees ``d_j`` that some piece's destinations have, ascending, and
    ``(k, D)`` float64 counts: ``[p, j]`` = destinations of piece ``p`` with in-degree
    ``d_j``. ``dst_m`` ``(k, n_dst)`` marks each piece's destinations, ``deg``
    ``(n_dst,)`` their in-degrees. One bincount over ``(piece, degree)`` pairs: O(nnz +
    max degree), no sort."""
    k = dst_m.shape[0]
    degree_of_entry = deg[dst_m.indices]
    present = np.flatnonzero(np.bincount(degree_of_entry, minlength=1))
    slot = np.zeros(int(present[-1]) + 1 if present.size else 1, dtype=np.int64)
    slot[present] = np.arange(present.size)
    piece = np.repeat(np.arange(k, dtype=np.int64), np.diff(dst_m.indptr))
    cnt = np.bincount(piece * present.size + slot[degree_of_entry], minlength=k * present.size)
    return present.astype(np.int64), cnt.reshape(k, present.size).astype(np.float64)
