"""Small vectorized helpers that turn edge lists and masks into the dataset conventions."""

from __future__ import annotations

import torch

from betty.graph import Graph

__all__ = ["bare_graph", "canonical_edges", "mask_to_index"]


def canonical_edges(
    src: torch.Tensor,
    dst: torch.Tensor,
    num_nodes: int,
    *,
    remove_self_loops: bool = True,
    to_bidirected: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clean an edge list.

    Args:
        src, dst: ``(E,)`` integer endpoints of the edges ``src -> dst``.
        num_nodes: N, so that ``src * N + dst`` is a unique key per ordered pair.
        remove_self_loops: drop every edge ``v -> v``.
        to_bidirected: add ``dst -> src`` for every edge and drop duplicate pairs, so
            the result is the symmetric simple graph ``{(u,v)} ∪ {(v,u)}``; the result
            is then sorted by (src, dst).

    Returns:
        ``(src, dst)``: int64 tensors; without ``to_bidirected`` the input order and
        multiplicity of the kept edges are preserved.
    """
    src = torch.as_tensor(src, dtype=torch.int64)
    dst = torch.as_tensor(dst, dtype=torch.int64)
    if remove_self_loops:
        keep = src != dst
        if not bool(keep.all()):
            src, dst = src[keep], dst[keep]
    if to_bidirected:
        key = torch.unique(torch.cat([src * num_nodes + dst, dst * num_nodes + src]))
        src, dst = key // num_nodes, key % num_nodes
    return src, dst


def bare_graph(src: torch.Tensor, dst: torch.Tensor, num_nodes: int) -> Graph:
    """A :class:`betty.graph.Graph` with edges ``src[i] -> dst[i]`` (int64, CPU)."""
    return Graph(src, dst, num_nodes)


def mask_to_index(mask: torch.Tensor) -> torch.Tensor:
    """``(N,)`` boolean/0-1 mask -> ``(n,)`` int64 ascending IDs of the set entries."""
    return torch.nonzero(torch.as_tensor(mask).to(torch.bool), as_tuple=False).view(-1).to(
        torch.int64
    )
