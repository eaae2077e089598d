"""Full-batch neighbour sampling.

The full batch is sampled **once** per epoch with DGL's ``MultiLayerNeighborSampler``;
micro-batches are carved out of it afterwards (:mod:`betty.microbatch`), so a node shared
by two micro-batches keeps the same sampled neighbours in both.

Fanout convention (DGL's): ``fanouts[0]`` is the fanout of the input layer (the block
that reads raw features), ``fanouts[-1]`` that of the output layer. ``-1`` takes every
in-neighbour.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch

from betty.batch import LayerEdges, SampledBatch

__all__ = ["sample_full_batch", "select_outputs", "canonical_edge_order"]


def select_outputs(
    train_idx: torch.Tensor, batch_size: int | None, *, seed: int = 0
) -> torch.Tensor:
    """The output nodes of one full batch.

    Args:
        train_idx: ``(n_train,)`` global IDs of the training nodes.
        batch_size: ``None`` for all of them (Betty's "full batch"), otherwise a
            seeded random subset of that size.
        seed: seed of the subset draw.

    Returns:
        ``(n_out,)`` int64 global IDs in ascending order.
    """
    train_idx = torch.as_tensor(train_idx, dtype=torch.int64)
    if batch_size is None or batch_size >= train_idx.numel():
        return torch.sort(train_idx).values
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randperm(train_idx.numel(), generator=gen)[:batch_size]
    return torch.sort(train_idx[pick]).values


def canonical_edge_order(
    edge_dst: torch.Tensor, edge_src_gid: torch.Tensor
) -> torch.Tensor:
    """Permutation sorting edges by (destination, source global ID).

    Any subset of edges kept in this order still lists each destination's neighbours by
    ascending global ID, which is the order DGL's degree-bucketed reducers (LSTM) see
    them in (DGL orders a mailbox by edge ID).
    """
    if edge_dst.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    order = torch.argsort(edge_src_gid, stable=True)
    return order[torch.argsort(edge_dst[order], stable=True)]


@contextmanager
def _single_threaded():
    from dgl.utils import get_num_threads, set_num_threads

    before = get_num_threads()
    set_num_threads(1)
    try:
        yield
    finally:
        set_num_threads(before)


def sample_full_batch(
    graph,
    outputs: torch.Tensor,
    fanouts: Sequence[int],
    *,
    seed: int = 0,
) -> SampledBatch:
    """Sample the L-hop neighbourhood of ``outputs`` once.

    Args:
        graph: a homogeneous ``dgl.DGLGraph`` on the CPU (edges point src -> dst; the
            in-edges of a node are its neighbours).
        outputs: ``(n_out,)`` global IDs of the output nodes.
        fanouts: per-layer fanouts, input layer first; ``-1`` means all neighbours.
        seed: seeds DGL's sampler; the same seed gives the same batch.

    Returns:
        A :class:`SampledBatch` whose edges are in canonical order.
    """
    import dgl

    fanouts = [int(f) for f in fanouts]
    if not fanouts:
        raise ValueError("fanouts must list at least one layer")
    if any(f == 0 or f < -1 for f in fanouts):
        raise ValueError(f"each fanout must be a positive int or -1, got {fanouts}")
    outputs = torch.as_tensor(outputs, dtype=torch.int64)
    if outputs.numel() == 0:
        raise ValueError("a batch needs at least one output node")
    if graph.idtype != torch.int64:
        graph = graph.long()

    sampler = dgl.dataloading.MultiLayerNeighborSampler(fanouts)
    with _single_threaded():
        # DGL's multi-threaded sampler draws from per-thread RNGs, so with more than
        # one OpenMP thread the same seed gives different batches (checked on 2.1.0).
        dgl.seed(seed)
        _, _, blocks = sampler.sample_blocks(graph, outputs)

    layers = []
    for block in blocks:
        src_nid = block.srcdata[dgl.NID].to(torch.int64)
        u, v = block.edges()
        u, v = u.to(torch.int64), v.to(torch.int64)
        eid = block.edata[dgl.EID].to(torch.int64)
        order = canonical_edge_order(v, src_nid[u])
        layers.append(
            LayerEdges(
                src_nid=src_nid,
                num_dst=block.num_dst_nodes(),
                edge_src=u[order],
                edge_dst=v[order],
                edge_id=eid[order],
            )
        )
    if not torch.equal(layers[-1].dst_nid, outputs):
        raise RuntimeError("DGL's sampler reordered the output nodes")
    return SampledBatch(layers=layers, fanouts=fanouts)
