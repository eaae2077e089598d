"""A quick planted-community, heavy-tailed graph for testing and benchmarking the
partitioners without any dataset.

Model (Chung-Lu with planted communities): node ``i`` gets a popularity
``w_i = 1 + Pareto(γ - 1)`` and a uniformly random community (so node IDs carry no
structure). Each of ``round(n · avg_degree / 2)`` candidate edges picks ``u ∝ w``; with
probability ``intra_fraction`` its other end ``v`` is drawn ``∝ w`` inside ``u``'s
community, otherwise ``∝ w`` over all nodes. Self-loops and duplicate pairs are dropped
and both directions are stored, so in-degree = degree, with a power-law tail.
"""

from __future__ import annotations

import numpy as np
import torch

from betty.graph import Graph

__all__ = ["planted_community_graph"]


def planted_community_graph(
    num_nodes: int,
    num_communities: int,
    *,
    avg_degree: float = 10.0,
    intra_fraction: float = 0.9,
    exponent: float = 2.5,
    seed: int = 0,
):
    """Returns ``(graph, community)``: a :class:`betty.graph.Graph` (symmetric) and the
    ``(num_nodes,)`` int64 community of each node."""

    if num_nodes < 2 or not 1 <= num_communities <= num_nodes:
        raise ValueError(
            f"need num_nodes >= 2 and 1 <= num_communities <= num_nodes, got "
            f"num_nodes={num_nodes}, num_communities={num_communities}"
        )
    if not 0.0 <= intra_fraction <= 1.0:
        raise ValueError(f"intra_fraction must lie in [0, 1], got {intra_fraction}")
    if exponent <= 1.0:
        raise ValueError(f"exponent must be > 1, got {exponent}")
    rng = np.random.default_rng(seed)
    w = rng.pareto(exponent - 1.0, num_nodes) + 1.0
    community = rng.integers(0, num_communities, num_nodes)

    by_comm = np.argsort(community, kind="stable")
    cum = np.cumsum(w[by_comm])
    total = cum[-1]
    bounds = np.searchsorted(community[by_comm], np.arange(num_communities + 1))
    before = np.concatenate([[0.0], cum])  # weight preceding each sorted position

    m = int(round(num_nodes * avg_degree / 2))
    u_pos = np.minimum(np.searchsorted(cum, rng.random(m) * total, side="right"), num_nodes - 1)
    u = by_comm[u_pos]
    c = community[u]
    lo, hi = before[bounds[c]], before[bounds[c + 1]]
    intra = rng.random(m) < intra_fraction
    target = np.where(intra, lo + rng.random(m) * (hi - lo), rng.random(m) * total)
    v = by_comm[np.minimum(np.searchsorted(cum, target, side="right"), num_nodes - 1)]

    keep = u != v
    a, b = np.minimum(u[keep], v[keep]), np.maximum(u[keep], v[keep])
    pairs = np.unique(a * num_nodes + b)
    a, b = pairs // num_nodes, pairs % num_nodes
    src = torch.from_numpy(np.concatenate([a, b]))
    dst = torch.from_numpy(np.concatenate([b, a]))
    graph = Graph(src, dst, num_nodes)
    return graph, torch.from_numpy(community.astype(np.int64))
