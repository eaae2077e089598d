"""Small graphs for tests: heavy-tailed in-degrees and some zero-in-degree nodes."""

from __future__ import annotations

import numpy as np
import torch


def power_law_arrays(num_nodes: int = 600, avg_degree: float = 8.0, *, exponent: float = 2.1,
                     isolated_frac: float = 0.05, num_feats: int = 12, num_classes: int = 5,
                     seed: int = 0):
    """A Chung-Lu style directed graph with Pareto node weights, without any GNN framework.

    Returns ``(src, dst, feat, label, train_idx)`` (int64 edge lists sorted by (src, dst),
    no duplicates or self loops). ``isolated_frac`` of the nodes get no in-edges (they
    are still training nodes), so blocks contain destinations without neighbours.
    """
    rng = np.random.default_rng(seed)
    w = rng.pareto(exponent - 1.0, num_nodes) + 1.0
    prob = w / w.sum()
    num_edges = int(avg_degree * num_nodes)
    src = rng.choice(num_nodes, num_edges, p=prob)
    dst = rng.choice(num_nodes, num_edges, p=prob)
    isolated = rng.random(num_nodes) < isolated_frac
    keep = (src != dst) & ~isolated[dst]
    pairs = np.unique(np.stack([src[keep], dst[keep]], 1), axis=0)
    gen = torch.Generator().manual_seed(seed)
    label = torch.randint(0, num_classes, (num_nodes,), generator=gen)
    feat = torch.randn(num_nodes, num_feats, generator=gen) + 0.5 * torch.nn.functional.one_hot(
        label % num_feats, num_feats).float()
    train_idx = torch.from_numpy(np.sort(rng.choice(num_nodes, num_nodes // 2, replace=False)))
    # make sure some isolated nodes are outputs
    iso = torch.from_numpy(np.flatnonzero(isolated))
    train_idx = torch.unique(torch.cat([train_idx, iso[:10]]))
    return torch.from_numpy(pairs[:, 0]), torch.from_numpy(pairs[:, 1]), feat, label, train_idx


def power_law_graph(num_nodes: int = 600, avg_degree: float = 8.0, **kwargs):
    """:func:`power_law_arrays` as a DGL graph: ``(graph, feat, label, train_idx)``."""
    import dgl

    src, dst, feat, label, train_idx = power_law_arrays(num_nodes, avg_degree, **kwargs)
    g = dgl.graph((src, dst), num_nodes=num_nodes, idtype=torch.int64)
    return g, feat, label, train_idx


def sample_batch_torch(src: torch.Tensor, dst: torch.Tensor, num_nodes: int,
                       outputs: torch.Tensor, fanouts: list[int], seed: int = 0):
    """A :class:`betty.batch.SampledBatch` sampled with plain torch (no DGL), for tests of
    the PyG backend: per layer, each destination keeps ``min(fanout, in-degree)`` in-edges
    drawn without replacement; sources are the destinations, then new nodes by ascending
    ID; edges in canonical order. Edge IDs are positions in ``src``/``dst``."""
    from betty.batch import LayerEdges, SampledBatch
    from betty.sampling import canonical_edge_order

    gen = torch.Generator().manual_seed(seed)
    local = torch.full((num_nodes,), -1, dtype=torch.int64)
    layers = []
    dst_nid = torch.as_tensor(outputs, dtype=torch.int64)
    for fanout in reversed(fanouts):
        local[dst_nid] = torch.arange(dst_nid.numel())
        eid = torch.nonzero(local[dst] >= 0).squeeze(1)
        key = torch.rand(eid.numel(), generator=gen, dtype=torch.float64)
        order = torch.argsort(key)
        order = order[torch.argsort(dst[eid][order], stable=True)]  # random order per dst
        eid = eid[order]
        d = dst[eid]
        first = torch.ones_like(d, dtype=torch.bool)
        first[1:] = d[1:] != d[:-1]
        group_start = torch.cummax(torch.where(first, torch.arange(d.numel()), 0), 0).values
        if fanout != -1:
            eid = eid[torch.arange(d.numel()) - group_start < fanout]
        u = src[eid]
        extra = torch.unique(u[local[u] < 0])
        src_nid = torch.cat([dst_nid, extra])
        local[extra] = dst_nid.numel() + torch.arange(extra.numel())
        edge_src, edge_dst = local[u], local[dst[eid]]
        perm = canonical_edge_order(edge_dst, u)
        layers.append(LayerEdges(src_nid=src_nid, num_dst=dst_nid.numel(), edge_src=edge_src[perm],
                                 edge_dst=edge_dst[perm], edge_id=eid[perm]))
        local[src_nid] = -1
        dst_nid = src_nid
    return SampledBatch(layers=layers[::-1], fanouts=list(fanouts))


def planetoid_dir():
    """Where the real Planetoid raw files (``ind.cora.x`` ...) are: ``$BETTY_PLANETOID_DIR``,
    ``shared/data/planetoid`` beside the repository, or ``/work/shared/data/planetoid``
    (the development machine's read-only copy); ``None`` when none has them."""
    import os
    from pathlib import Path

    candidates = [os.environ.get("BETTY_PLANETOID_DIR"),
                  Path(__file__).resolve().parents[2] / "shared" / "data" / "planetoid",
                  "/work/shared/data/planetoid"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "ind.cora.graph").is_file():
            return Path(candidate)
    return None
