"""The framework-neutral graph every part of betty's core works on.

A :class:`Graph` is a homogeneous directed graph held as two ``(E,)`` int64 CPU tensors
``src`` and ``dst`` (edge ``e`` goes ``src[e] -> dst[e]``; a node aggregates over its
**in**-edges, so ``src[e]`` is a neighbour of ``dst[e]``) and a node count. Edge IDs are
positions in those tensors. Nothing here imports DGL or PyG: a backend turns a graph
(or a sampled block) into its own object at the last moment (:meth:`Graph.to_dgl`,
:meth:`Graph.edge_index`).

The in-edge CSR (``indptr (N+1,)``, neighbour ``indices (E,)``, ``eid (E,)``), which
the sampler and the partitioners read, is built once on first use and cached: for node
``v`` its in-neighbours are ``indices[indptr[v]:indptr[v+1]]``, listed in the canonical
neighbour order (ascending source ID, parallel edges by ascending edge ID), and ``eid``
holds those edges' IDs. Any subset of a row taken in row order is therefore already in
canonical order, which is what lets the sampler skip a sort per batch.

The method names of the small read API (``num_nodes()``, ``num_edges()``, ``edges()``,
``in_degrees()``) follow DGL's, so code written against a ``dgl.DGLGraph`` reads the
same on both.
"""

from __future__ import annotations

from functools import cached_property

import torch

__all__ = ["Graph", "as_graph"]


class Graph:
    """A homogeneous int64 CPU graph, edges ``src -> dst``.

    Args:
        src, dst: ``(E,)`` integer endpoints; stored as contiguous int64.
        num_nodes: N; every endpoint must lie in ``[0, N)``.
    """

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, num_nodes: int) -> None:
        src = torch.as_tensor(src, dtype=torch.int64).contiguous()
        dst = torch.as_tensor(dst, dtype=torch.int64).contiguous()
        if src.dim() != 1 or src.shape != dst.shape:
            raise ValueError(f"src and dst must be (E,) tensors of one length, got "
                             f"{tuple(src.shape)} and {tuple(dst.shape)}")
        num_nodes = int(num_nodes)
        if num_nodes < 0:
            raise ValueError(f"num_nodes must be >= 0, got {num_nodes}")
        if src.numel() and (int(torch.minimum(src.min(), dst.min())) < 0
                            or int(torch.maximum(src.max(), dst.max())) >= num_nodes):
            raise ValueError(f"edge endpoints must lie in [0, {num_nodes})")
        self.src, self.dst, self._num_nodes = src, dst, num_nodes

    # -- the DGL-shaped read API ------------------------------------------------------
    idtype = torch.int64
    device = torch.device("cpu")
    is_homogeneous = True

    def num_nodes(self) -> int:
        return self._num_nodes

    def num_edges(self) -> int:
        return int(self.src.numel())

    def edges(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(src, dst)``: the ``(E,)`` endpoints in edge-ID order."""
        return self.src, self.dst

    def in_degrees(self) -> torch.Tensor:
        """``(N,)`` int64 number of in-edges of every node."""
        return torch.diff(self.in_csr[0])

    def out_degrees(self) -> torch.Tensor:
        """``(N,)`` int64 number of out-edges of every node (built once and cached)."""
        cached = self.__dict__.get("_out_degrees")
        if cached is None:
            cached = torch.bincount(self.src, minlength=self._num_nodes)
            self.__dict__["_out_degrees"] = cached
        return cached

    def long(self) -> "Graph":
        return self

    def with_self_loops(self) -> "Graph":
        """This graph with one edge ``v -> v`` appended for every node that has none
        (idempotent: a node with a self-loop, or several, keeps exactly what it has).
        The existing edges keep their IDs; the new loops get IDs ``E, E+1, ...`` in
        ascending node order. Returns ``self`` when every node already has a loop."""
        has_loop = torch.zeros(self._num_nodes, dtype=torch.bool)
        has_loop[self.src[self.src == self.dst]] = True
        missing = torch.nonzero(~has_loop).view(-1)
        if missing.numel() == 0:
            return self
        return Graph(torch.cat([self.src, missing]), torch.cat([self.dst, missing]), self._num_nodes)

    # -- derived structure ------------------------------------------------------------
    @cached_property
    def in_csr(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(indptr (N+1,), indices (E,), eid (E,))``: in-neighbours of each node by
        ascending source ID, ties (parallel edges) by ascending edge ID (a stable sort of
        the edges by ``dst * N + src``)."""
        if self._num_nodes < 3_037_000_499:  # dst * N + src fits in int64
            eid = torch.argsort(self.dst * max(self._num_nodes, 1) + self.src, stable=True)
        else:
            by_src = torch.argsort(self.src, stable=True)
            eid = by_src[torch.argsort(self.dst[by_src], stable=True)]
        counts = torch.bincount(self.dst, minlength=self._num_nodes)
        indptr = torch.zeros(self._num_nodes + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=indptr[1:])
        return indptr, self.src[eid], eid

    def edge_index(self) -> torch.Tensor:
        """``(2, E)`` ``[src; dst]``: PyG's edge layout."""
        return torch.stack([self.src, self.dst])

    def to_dgl(self):
        """The same graph as an int64 CPU ``dgl.DGLGraph`` (imports DGL). Built once and
        cached (a ``Graph`` never changes); treat the result as read-only."""
        cached = self.__dict__.get("_dgl")
        if cached is None:
            import dgl

            cached = dgl.graph((self.src, self.dst), num_nodes=self._num_nodes,
                               idtype=torch.int64, device="cpu")
            self.__dict__["_dgl"] = cached
        return cached

    def __repr__(self) -> str:
        return f"Graph(num_nodes={self._num_nodes}, num_edges={self.num_edges()})"


def as_graph(graph) -> Graph:
    """A :class:`Graph` from a :class:`Graph` (returned as is) or any object with DGL's
    ``edges()`` / ``num_nodes()`` (a ``dgl.DGLGraph``)."""
    if isinstance(graph, Graph):
        return graph
    if hasattr(graph, "edges") and hasattr(graph, "num_nodes"):
        src, dst = graph.edges()
        return Graph(src, dst, graph.num_nodes())
    raise TypeError(f"expected a betty.graph.Graph or a dgl.DGLGraph, got {type(graph).__name__}")
