"""The framework-neutral graph every part of betty's core works on.

A :class:`Graph` is a homogeneous directed graph on N nodes whose edge ``e`` goes
``src[e] -> dst[e]`` (a node aggregates over its **in**-edges, so ``src[e]`` is a
neighbour of ``dst[e]``). It is held in one of two forms: as the two ``(E,)`` int64 CPU
tensors ``src`` and ``dst`` (:class:`Graph`'s constructor; edge IDs are positions in
them), or as its in-edge CSR alone (:meth:`Graph.from_csr`, what the dataset store
memory-maps), in which case ``src``/``dst`` are derived from the CSR only when a
consumer asks for them (building a backend's whole-graph object). Nothing here imports DGL or PyG: a backend turns a graph
(or a sampled block) into its own object at the last moment (:meth:`Graph.to_dgl`,
:meth:`Graph.edge_index`).

The in-edge CSR (``indptr (N+1,)``, neighbour ``indices (E,)``, ``eid (E,)`` or
``None``), which the sampler and the partitioners read, is built once on first use and
cached (or given to :meth:`Graph.from_csr`): for node
``v`` its in-neighbours are ``indices[indptr[v]:indptr[v+1]]``, listed in the canonical
neighbour order (ascending source ID, parallel edges by ascending edge ID), and ``eid``
holds those edges' IDs (``None`` when edge IDs are CSR positions, ``eid[p] = p``). In
the COO form all three are int64; a stored CSR keeps ``indptr`` int64 and may hold
``indices`` / ``eid`` as int32 (node / edge counts below 2^31): a consumer casts the
entries it gathers. Any subset of a row taken in row order is therefore already in
canonical order, which is what lets the sampler skip a sort per batch.

The method names of the small read API (``num_nodes()``, ``num_edges()``, ``edges()``,
``in_degrees()``) follow DGL's, so code written against a ``dgl.DGLGraph`` reads the
same on both.
"""

from __future__ import annotations

from functools import cached_property

import torch

__all__ = ["Graph", "as_graph"]

_CHUNK = 1 << 24  # CSR entries per step where a pass over all edges is chunked


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

    @classmethod
    def from_csr(cls, indptr: torch.Tensor, indices: torch.Tensor, eid: torch.Tensor | None,
                 num_nodes: int) -> "Graph":
        """The graph given by its in-edge CSR alone (no COO copy is made).

        Args:
            indptr: ``(N+1,)`` int64, ``indptr[0] = 0``, non-decreasing.
            indices: ``(E,)`` int32 or int64 source IDs in canonical row order.
            eid: ``(E,)`` int32 or int64 edge IDs of the CSR entries, or ``None`` when
                edge ``p`` is CSR entry ``p``.
            num_nodes: N.

        Only O(1) checks run (shapes, dtypes, ``indptr``'s ends): the tensors may be
        memory-mapped and are not read here."""
        num_nodes = int(num_nodes)
        if indptr.dim() != 1 or indptr.numel() != num_nodes + 1 or indptr.dtype != torch.int64:
            raise ValueError(f"indptr must be ({num_nodes + 1},) int64, got {tuple(indptr.shape)} {indptr.dtype}")
        num_edges = int(indices.numel())
        if int(indptr[0]) != 0 or int(indptr[-1]) != num_edges:
            raise ValueError(f"indptr must run from 0 to len(indices) = {num_edges}")
        for name, t in (("indices", indices), ("eid", eid)):
            if t is not None and (t.dim() != 1 or t.numel() != num_edges
                                  or t.dtype not in (torch.int32, torch.int64)):
                raise ValueError(f"{name} must be ({num_edges},) int32 or int64, got "
                                 f"{tuple(t.shape)} {t.dtype}")
        graph = cls.__new__(cls)
        graph._num_nodes = num_nodes
        graph.__dict__["in_csr"] = (indptr, indices, eid)
        return graph

    def _coo_from_csr(self) -> None:
        """Derive and cache ``src``/``dst`` (int64, edge-ID order) from the CSR."""
        indptr, indices, eid = self.in_csr
        row = torch.repeat_interleave(torch.arange(self._num_nodes), torch.diff(indptr))
        if eid is None:
            src, dst = indices.to(torch.int64), row
        else:
            at = eid.to(torch.int64)
            src = torch.empty(row.numel(), dtype=torch.int64)
            dst = torch.empty(row.numel(), dtype=torch.int64)
            src[at] = indices.to(torch.int64)
            dst[at] = row
        self.__dict__["src"], self.__dict__["dst"] = src, dst

    @cached_property
    def src(self) -> torch.Tensor:
        """``(E,)`` int64 edge sources (derived from the CSR for a :meth:`from_csr` graph)."""
        self._coo_from_csr()
        return self.__dict__["src"]

    @cached_property
    def dst(self) -> torch.Tensor:
        """``(E,)`` int64 edge destinations (derived from the CSR for a :meth:`from_csr` graph)."""
        self._coo_from_csr()
        return self.__dict__["dst"]

    # -- the DGL-shaped read API ------------------------------------------------------
    idtype = torch.int64
    device = torch.device("cpu")
    is_homogeneous = True

    def num_nodes(self) -> int:
        return self._num_nodes

    def num_edges(self) -> int:
        if "src" in self.__dict__:
            return int(self.__dict__["src"].numel())
        return int(self.in_csr[1].numel())

    def edges(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(src, dst)``: the ``(E,)`` endpoints in edge-ID order."""
        return self.src, self.dst

    def in_degrees(self) -> torch.Tensor:
        """``(N,)`` int64 number of in-edges of every node."""
        return torch.diff(self.in_csr[0]).to(torch.int64)

    def out_degrees(self) -> torch.Tensor:
        """``(N,)`` int64 number of out-edges of every node (built once and cached)."""
        cached = self.__dict__.get("_out_degrees")
        if cached is None:
            if "src" in self.__dict__:
                cached = torch.bincount(self.src, minlength=self._num_nodes)
            else:  # from the CSR's sources, in chunks (no (E,) int64 temporary)
                indices = self.in_csr[1]
                cached = torch.zeros(self._num_nodes, dtype=torch.int64)
                for lo in range(0, indices.numel(), _CHUNK):
                    cached += torch.bincount(indices[lo:lo + _CHUNK], minlength=self._num_nodes)
            self.__dict__["_out_degrees"] = cached
        return cached

    def in_csr_on(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:attr:`in_csr` on ``device`` (dtypes kept), copied there once and cached; on
        the CPU it is :attr:`in_csr` itself (no copy)."""
        return self._cached_on(device, "in_csr", lambda: self.in_csr)

    def out_degrees_on(self, device: torch.device | str) -> torch.Tensor:
        """:meth:`out_degrees` on ``device``, copied there once and cached."""
        return self._cached_on(device, "out_degrees", lambda: (self.out_degrees(),))[0]

    def _cached_on(self, device: torch.device | str, name: str, tensors) -> tuple:
        """``tensors()`` (a tuple of CPU tensors or ``None``) moved to ``device``, kept
        per resolved device (``"cuda"`` and ``"cuda:0"`` share one copy)."""
        device = torch.empty(0, device=device).device  # resolves "cuda" to "cuda:<current>"
        cache = self.__dict__.setdefault("_on_device", {})
        key = (name, device)
        if key not in cache:
            cache[key] = tuple(None if t is None else t.to(device) for t in tensors())
        return cache[key]

    def csr_edge_chunks(self, max_edges: int | None = None):
        """Yield ``(src, dst)`` int64 chunks covering every edge once, in CSR order
        (whole rows, about ``max_edges`` edges a chunk): a pass over all edges without
        materializing the ``(E,)`` COO arrays."""
        max_edges = _CHUNK if max_edges is None else int(max_edges)
        indptr, indices, _ = self.in_csr
        n, a = self._num_nodes, 0
        while a < n:
            b = int(torch.searchsorted(indptr, int(indptr[a]) + max_edges, right=True)) - 1
            b = min(max(b, a + 1), n)
            lo, hi = int(indptr[a]), int(indptr[b])
            dst = torch.repeat_interleave(torch.arange(a, b), torch.diff(indptr[a:b + 1]))
            yield indices[lo:hi].to(torch.int64), dst
            a = b

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
