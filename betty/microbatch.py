"""Carve micro-batches out of an already-sampled full batch.

Given a group of output nodes, walk the full batch's blocks top-down and keep, at each
layer, exactly the edges whose destination is needed by the layer above. Nothing is
re-sampled, so every node in a micro-batch has the same sampled in-neighbours (in the
same canonical order) as in the full batch; this is what makes K-way gradient
accumulation equal to the full-batch gradient.

Source-node order of a carved block: the destination nodes first (DGL's block
convention), then the remaining sources by ascending global ID. It is built
explicitly, never left to ``dgl.to_block``.
"""

from __future__ import annotations

import torch

from betty.batch import LayerEdges, MicroBatch, SampledBatch

__all__ = ["carve", "split", "validate_groups"]


def carve(full: SampledBatch, output_index: torch.Tensor) -> MicroBatch:
    """The micro-batch that computes the outputs at ``output_index``.

    Args:
        full: the full sampled batch.
        output_index: ``(m,)`` positions into ``full.output_nid`` (distinct).

    Returns:
        A :class:`MicroBatch` with its own L blocks; cost is O(full-batch nodes + edges
        of each layer), all vectorized.
    """
    output_index = torch.as_tensor(output_index, dtype=torch.int64)
    n_layers = full.num_layers
    layers: list[LayerEdges | None] = [None] * n_layers
    full_src_index: list[torch.Tensor | None] = [None] * n_layers

    dst_full = output_index  # positions among full layer-l destinations
    for l in reversed(range(n_layers)):
        fl = full.layers[l]
        n_dst = dst_full.numel()
        local = torch.arange(n_dst, dtype=torch.int64)

        # position of each full-batch source node in this micro-batch's source list
        src_pos = torch.full((fl.num_src,), -1, dtype=torch.int64)
        src_pos[dst_full] = local
        dst_pos = src_pos[: fl.num_dst]

        keep = dst_pos[fl.edge_dst] >= 0
        e_src = fl.edge_src[keep]
        e_dst = dst_pos[fl.edge_dst[keep]]
        e_id = fl.edge_id[keep]

        extra = e_src[src_pos[e_src] < 0].unique()
        extra = extra[torch.argsort(fl.src_nid[extra])]
        src_pos[extra] = torch.arange(n_dst, n_dst + extra.numel(), dtype=torch.int64)
        src_full = torch.cat([dst_full, extra])

        layers[l] = LayerEdges(
            src_nid=fl.src_nid[src_full],
            num_dst=n_dst,
            edge_src=src_pos[e_src],
            edge_dst=e_dst,
            edge_id=e_id,
        )
        full_src_index[l] = src_full
        dst_full = src_full  # layer l's sources are layer l-1's destinations

    return MicroBatch(layers=layers, output_index=output_index, full_src_index=full_src_index)


def validate_groups(groups: torch.Tensor, num_outputs: int, k: int) -> torch.Tensor:
    """Check a partition vector: ``(num_outputs,)`` ints in ``[0, k)``, no empty piece."""
    groups = torch.as_tensor(groups, dtype=torch.int64)
    if groups.shape != (num_outputs,):
        raise ValueError(
            f"partition must assign each of the {num_outputs} output nodes a piece, "
            f"got shape {tuple(groups.shape)}"
        )
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if groups.numel() and (groups.min() < 0 or groups.max() >= k):
        raise ValueError(f"piece indices must lie in [0, {k}), got "
                         f"[{int(groups.min())}, {int(groups.max())}]")
    sizes = torch.bincount(groups, minlength=k)
    if (sizes == 0).any():
        empty = torch.nonzero(sizes == 0).flatten().tolist()
        raise ValueError(f"pieces {empty} of {k} are empty")
    return groups


def split(full: SampledBatch, groups: torch.Tensor, k: int | None = None) -> list[MicroBatch]:
    """Carve one micro-batch per piece of ``groups``.

    Args:
        full: the full sampled batch.
        groups: ``(n_out,)`` piece index of each output node (in ``full.output_nid``
            order).
        k: number of pieces (default: ``groups.max() + 1``).
    """
    groups = torch.as_tensor(groups, dtype=torch.int64)
    if k is None:
        k = int(groups.max()) + 1 if groups.numel() else 1
    groups = validate_groups(groups, full.num_outputs, k)
    order = torch.argsort(groups, stable=True)
    sizes = torch.bincount(groups, minlength=k).tolist()
    return [carve(full, idx) for idx in torch.split(order, sizes)]
