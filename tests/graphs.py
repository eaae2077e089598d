"""Small graphs for tests: heavy-tailed in-degrees and some zero-in-degree nodes."""

from __future__ import annotations

import numpy as np
import torch


def power_law_graph(num_nodes: int = 600, avg_degree: float = 8.0, *, exponent: float = 2.1,
                    isolated_frac: float = 0.05, num_feats: int = 12, num_classes: int = 5,
                    seed: int = 0):
    """A Chung-Lu style directed graph with Pareto node weights.

    Returns ``(graph, feat, label, train_idx)``; ``graph`` is a :class:`betty.graph.Graph`. ``isolated_frac`` of the nodes get no
    in-edges (they are still training nodes), so blocks contain destinations without
    neighbours.
    """
    from betty.graph import Graph

    rng = np.random.default_rng(seed)
    w = rng.pareto(exponent - 1.0, num_nodes) + 1.0
    prob = w / w.sum()
    num_edges = int(avg_degree * num_nodes)
    src = rng.choice(num_nodes, num_edges, p=prob)
    dst = rng.choice(num_nodes, num_edges, p=prob)
    isolated = rng.random(num_nodes) < isolated_frac
    keep = (src != dst) & ~isolated[dst]
    pairs = np.unique(np.stack([src[keep], dst[keep]], 1), axis=0)
    g = Graph(torch.from_numpy(pairs[:, 0]), torch.from_numpy(pairs[:, 1]), num_nodes)
    gen = torch.Generator().manual_seed(seed)
    label = torch.randint(0, num_classes, (num_nodes,), generator=gen)
    feat = torch.randn(num_nodes, num_feats, generator=gen) + 0.5 * torch.nn.functional.one_hot(
        label % num_feats, num_feats).float()
    train_idx = torch.from_numpy(np.sort(rng.choice(num_nodes, num_nodes // 2, replace=False)))
    # make sure some isolated nodes are outputs
    iso = torch.from_numpy(np.flatnonzero(isolated))
    train_idx = torch.unique(torch.cat([train_idx, iso[:10]]))
    return g, feat, label, train_idx


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


def backend_params():
    """``pytest.param("dgl")``, ``pytest.param("pyg")``: each marked with its framework's
    marker (so ``-m "not dgl"`` deselects the DGL half) and skipped where it does not import."""
    import pytest

    from betty.backends import BACKENDS, available

    return [pytest.param(name, id=name, marks=[getattr(pytest.mark, name),
                                               pytest.mark.skipif(not available(name),
                                                                  reason=f"{name} not installed")])
            for name in BACKENDS]


def whole_graph(src, dst, num_nodes: int, backend: str, *, self_loops: bool = True):
    """The backend's whole graph of edges ``src -> dst`` plus, with ``self_loops``, one
    loop per node appended in node order (the edge order of
    ``dgl.add_self_loop(dgl.graph((src, dst)))``)."""
    from betty.backends import get_backend
    from betty.graph import Graph

    if self_loops:
        loops = torch.arange(num_nodes)
        src, dst = torch.cat([src, loops]), torch.cat([dst, loops])
    return get_backend(backend).full_graph(Graph(src, dst, num_nodes))


def rand_whole_graph(num_nodes: int, num_edges: int, backend: str):
    """``num_edges`` random edges from torch's global RNG (src drawn first), plus self-loops."""
    src, dst = torch.randint(num_nodes, (num_edges,)), torch.randint(num_nodes, (num_edges,))
    return whole_graph(src, dst, num_nodes, backend)


def components_graph(sizes, edges_per_node: int = 4, seed: int = 0):
    """Disjoint random clusters of ``sizes`` nodes (a ring plus ``edges_per_node`` random
    edges per node each, so each is connected), then one self-loop per node:
    ``(betty.graph.Graph, offsets)``, cluster ``c`` the nodes ``offsets[c]`` to
    ``offsets[c + 1] - 1``."""
    from betty.graph import Graph

    gen = torch.Generator().manual_seed(seed)
    offsets = np.cumsum([0] + list(sizes))
    src, dst = [], []
    for start, size in zip(offsets[:-1], sizes):
        ring = torch.arange(size)
        src += [ring + int(start), torch.randint(size, (edges_per_node * size,), generator=gen) + int(start)]
        dst += [(ring + 1) % size + int(start), torch.randint(size, (edges_per_node * size,), generator=gen) + int(start)]
    n = int(offsets[-1])
    loops = torch.arange(n)
    return Graph(torch.cat(src + [loops]), torch.cat(dst + [loops]), n), offsets
