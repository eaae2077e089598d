"""Full-batch neighbour sampling on betty's own :class:`~betty.graph.Graph` (no DGL).

The full batch is sampled **once** per epoch; micro-batches are carved out of it
afterwards (:mod:`betty.microbatch`), so a node shared by two micro-batches keeps the
same sampled neighbours in both.

Fanout convention (DGL's): ``fanouts[0]`` is the fanout of the input layer (the block
that reads raw features), ``fanouts[-1]`` that of the output layer. ``-1`` takes every
in-neighbour.

Sampling rule (the one of ``dgl.sampling.sample_neighbors`` with ``replace=False``):
a destination ``v`` of in-degree ``d`` keeps all its ``d`` in-edges when ``d <= k``
(the fanout) and otherwise a uniformly random ``k``-subset of them, without
replacement. Edges, not distinct neighbours, are drawn, so parallel edges count
separately. The subsets of all destinations of a layer are drawn at once with a
vectorized form of Floyd's algorithm (:func:`uniform_subsets`), ``k`` array steps over
the destinations whatever their degrees, from one seeded ``torch.Generator``: the
same seed gives the same batch on any thread count.

Two paths run that rule. The host path (``sample_full_batch(..., device=None)``, the
default) does the index work in NumPy on CPU tensors. The device path
(``device="cuda"``, or any torch device) runs the same steps as torch ops
(:func:`sample_neighbors_torch`, :func:`uniform_subsets_torch`) where the graph's CSR
lives: it is copied to the device once per graph and cached
(:meth:`betty.graph.Graph.in_csr_on`), and the batch's tensors stay there, so a GPU
server samples without moving the CSR or the batch across the bus each epoch. Its random
numbers come from a generator on that device seeded with ``seed``: on ``"cpu"`` these are
the host path's draws and the batch is the host path's bit for bit (the host path is the
faster of the two there: NumPy sorts short rows faster than torch); on CUDA the batch is
deterministic per seed but another random stream than the CPU's, so not the same batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from betty.batch import LayerEdges, SampledBatch
from betty.checks import integer_ids, is_integer
from betty.graph import Graph, as_graph
from betty.indexing import put, take
from betty.pages import prefetch_rows, release_pages

__all__ = [
    "check_fanouts",
    "sample_full_batch",
    "sample_neighbors",
    "sample_neighbors_torch",
    "sample_rows",
    "NeighbourSource",
    "sampler_graph",
    "uniform_subsets",
    "uniform_subsets_torch",
]


def uniform_subsets(
    degree: torch.Tensor, k: int, generator: torch.Generator
) -> torch.Tensor:
    """For each row ``i`` a uniform random ``k``-subset of ``{0, ..., degree[i] - 1}``.

    Floyd's algorithm, one array step per drawn element over all rows at once: for
    ``j = d - k, ..., d - 1`` draw ``t`` uniform on ``{0, ..., j}`` and add ``t``, or
    ``j`` if ``t`` was already drawn. Every ``k``-subset comes out with probability
    ``1 / C(d, k)``. The "already drawn" test compares with the row's earlier picks
    (``O(n i)`` at step ``i``, ``O(n k^2)`` in all, independent of the degrees); the
    rows are sorted at the end. ``t = floor(u (j + 1))`` with ``u`` a float64 uniform on
    ``[0, 1)``: each value's probability is off by at most ``(j + 1) / 2^53``. Runs in numpy, whose fancy indexing and short-row sort
    are several times faster than torch's on the CPU (torch 2.2 and 2.13).

    Args:
        degree: ``(n,)`` int64, every entry ``>= k``.
        k: subset size, ``>= 1``.
        generator: the seeded source of randomness (``k * n`` float64 draws).

    Returns:
        ``(n, k)`` int64, each row ascending.
    """
    n = degree.numel()
    d = degree.numpy()
    # all random numbers at once, (k, n): step i reads row i (contiguous)
    uniform = torch.rand(k, n, generator=generator, dtype=torch.float64).numpy()
    # picks in int32 where the degrees allow (the same values: t < d < 2^31), half the
    # memory traffic of the O(n k^2) comparisons and of the row sort
    it = np.int32 if n == 0 or int(d.max()) < np.iinfo(np.int32).max else np.int64
    chosen = np.empty((k, n), dtype=it)
    scaled = np.empty(n, dtype=np.float64)
    hit = np.empty(n, dtype=bool)
    same = np.empty(n, dtype=bool)
    for i in range(k):
        j = (d - (k - i)).astype(it)
        np.multiply(uniform[i], j + 1, out=scaled)  # exact: j + 1 < 2^53
        t = scaled.astype(it)  # floor, as the values are >= 0
        np.minimum(t, j, out=t)
        if i:
            np.equal(chosen[0], t, out=hit)  # t already drawn in this row?
            for r in range(1, i):
                np.equal(chosen[r], t, out=same)
                hit |= same
            np.copyto(t, j, where=hit)
        chosen[i] = t
    out = np.ascontiguousarray(chosen.T)
    out.sort(axis=1)
    return torch.from_numpy(out.astype(np.int64, copy=False))


def uniform_subsets_torch(
    degree: torch.Tensor, k: int, generator: torch.Generator
) -> torch.Tensor:
    """:func:`uniform_subsets` in torch ops, on ``degree``'s device.

    The same Floyd steps, the same ``(k, n)`` float64 draws
    (``torch.rand(k, n, generator=generator, dtype=torch.float64)``) and the same
    ``t = min(floor(u (j + 1)), j)``: on the CPU, from a generator in the same state, the
    result equals :func:`uniform_subsets`'s bit for bit. ``generator`` must live on
    ``degree``'s device; a CUDA generator gives other numbers than a CPU one seeded
    alike (deterministic per device, not across devices).

    Args:
        degree: ``(n,)`` int64, every entry ``>= k``, on the device to run on.
        k: subset size, ``>= 1``.
        generator: the seeded source of randomness (``k * n`` float64 draws).

    Returns:
        ``(n, k)`` int64 on ``degree``'s device, each row ascending.
    """
    n = degree.numel()
    uniform = torch.rand(k, n, generator=generator, dtype=torch.float64, device=degree.device)
    chosen = torch.empty((k, n), dtype=torch.int64, device=degree.device)
    for i in range(k):
        j = degree - (k - i)
        t = (uniform[i] * (j + 1)).to(torch.int64)  # floor (values >= 0); j + 1 < 2^53 exact
        torch.minimum(t, j, out=t)
        if i:
            hit = (chosen[:i] == t).any(dim=0)  # t already drawn in this row?
            t = torch.where(hit, j, t)
        chosen[i] = t
    return torch.sort(chosen, dim=0).values.T.contiguous()


def sample_neighbors_torch(
    graph: Graph, nodes: torch.Tensor, fanout: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_neighbors` in torch ops, on ``nodes``' device.

    Reads :meth:`betty.graph.Graph.in_csr_on` of that device and draws through
    :func:`uniform_subsets_torch` (so ``generator`` must live there too). Same rule,
    same output order, and on the CPU the same ``(row, pos)`` as
    :func:`sample_neighbors` from a generator in the same state.

    Args:
        graph: the graph.
        nodes: ``(n,)`` int64 destination global IDs, on the device to run on.
        fanout: ``k >= 1``, or ``-1`` for every in-edge.
        generator: the seeded source of randomness (unused, may be ``None``, for ``-1``).

    Returns:
        ``(row, pos)``: ``(E',)`` int64 each on ``nodes``' device, as
        :func:`sample_neighbors`'s.
    """
    device = nodes.device
    indptr = graph.in_csr_on(device)[0]
    start = indptr[nodes]
    degree = indptr[nodes + 1] - start
    picked = degree if fanout == -1 else torch.clamp(degree, max=fanout)
    row = torch.repeat_interleave(picked)  # row r repeated picked[r] times
    first = torch.cumsum(picked, 0) - picked  # each row's first output slot
    pos = torch.arange(row.numel(), device=device) + (start - first)[row]  # every in-edge
    if fanout != -1:
        over = torch.nonzero(degree > fanout).view(-1)
        if over.numel():
            picks = uniform_subsets_torch(degree[over], fanout, generator)
            slots = first[over, None] + torch.arange(fanout, device=device)
            pos[slots] = start[over, None] + picks
    return row, pos


def sample_rows(start: np.ndarray, degree: np.ndarray, fanout: int,
                generator: torch.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The sampling rule on CSR rows given by where they start and how long they are.

    Args:
        start: ``(n,)`` int64 position of each row's first entry in its CSR.
        degree: ``(n,)`` int64 row lengths (in-degrees).
        fanout: ``k >= 1``, or ``-1`` for every entry.
        generator: the seeded source of randomness (unused, may be ``None``, for ``-1``).

    Returns:
        ``(row, pos)``: ``(E',)`` int64 NumPy arrays; entry ``e`` is CSR position
        ``pos[e]`` of row ``row[e]``, grouped by row ascending, each row's entries in
        CSR order. The draws depend on ``degree`` and ``generator`` only, so rows laid
        out anywhere (a whole graph's CSR, or rows fetched from a remote store into a
        CSR of their own) give the same picks.
    """
    picked = degree if fanout == -1 else np.minimum(degree, fanout)
    row = np.repeat(np.arange(degree.size), picked)
    first = np.cumsum(picked) - picked  # each row's first output slot
    pos = np.arange(row.size) + (start - first)[row]  # every entry, in CSR order
    if fanout != -1:
        over = np.flatnonzero(degree > fanout)
        if over.size:
            picks = uniform_subsets(torch.from_numpy(degree[over]), fanout, generator).numpy()
            slots = first[over, None] + np.arange(fanout)
            pos[slots] = start[over, None] + picks
    return row, pos


def sample_neighbors(
    graph: Graph, nodes: torch.Tensor, fanout: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled in-edges of ``nodes`` (see the module docstring for the rule).

    Args:
        graph: the graph (its cached in-CSR is read).
        nodes: ``(n,)`` int64 destination global IDs.
        fanout: ``k >= 1``, or ``-1`` for every in-edge.
        generator: the seeded source of randomness (unused, may be ``None``, for ``-1``).

    Returns:
        ``(row, pos)``: ``(E',)`` int64 each; edge ``e`` ends at ``nodes[row[e]]`` and is
        CSR entry ``pos[e]`` (source ``indices[pos]``, edge ID ``eid[pos]``, or ``pos``
        itself when ``eid`` is ``None``). Edges are
        grouped by ``row`` ascending, each row's in CSR order: the canonical neighbour
        order (ascending source ID, see :attr:`betty.graph.Graph.in_csr`).
    """
    indptr = graph.in_csr[0].numpy()
    v = nodes.numpy()
    start = indptr[v].astype(np.int64, copy=False)
    row, pos = sample_rows(start, indptr[v + 1] - start, fanout, generator)
    return torch.from_numpy(row), torch.from_numpy(pos)


class NeighbourSource(Protocol):
    """What :func:`sample_full_batch` reads of a graph that is not a local
    :class:`~betty.graph.Graph` (a remote graph store, say).

    IDs are the graph's global node and edge IDs; every tensor is int64 on the CPU.
    """

    def num_nodes(self) -> int:
        """N."""

    def sample_in_edges(self, nodes: torch.Tensor, fanout: int,
                        generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(row, src, eid)`` of the sampled in-edges of ``nodes`` by the module's rule
        (:func:`sample_rows` on each node's in-edges in canonical order): edge ``e`` goes
        ``src[e] -> nodes[row[e]]`` and has ID ``eid[e]``, grouped by row ascending."""

    def out_degrees_of(self, nodes: torch.Tensor) -> torch.Tensor:
        """``(n,)`` out-degrees of ``nodes`` in the whole graph."""


def sampler_graph(graph) -> "Graph | NeighbourSource":
    """What :func:`sample_full_batch` reads ``graph`` as: a :class:`NeighbourSource` as
    it is, anything else as a :class:`~betty.graph.Graph` (:func:`betty.graph.as_graph`)."""
    return graph if hasattr(graph, "sample_in_edges") else as_graph(graph)


class _LocalCSR:
    """:class:`NeighbourSource` of a local :class:`~betty.graph.Graph`: its in-CSR on
    the host (NumPy index work) or on a torch device (torch ops, the CSR copied there
    once)."""

    def __init__(self, graph: Graph, device: torch.device | None) -> None:
        self.graph, self.host = graph, device is None
        if self.host:
            _, self.indices, self.eid = graph.in_csr
            self.out_degree = graph.out_degrees()
        else:
            _, self.indices, self.eid = graph.in_csr_on(device)
            self.out_degree = graph.out_degrees_on(device)

    def num_nodes(self) -> int:
        return self.graph.num_nodes()

    def sample_in_edges(self, nodes, fanout, generator):
        pick = sample_neighbors if self.host else sample_neighbors_torch
        row, pos = pick(self.graph, nodes, fanout, generator)
        if self.host:  # a CSR read out of core: the entries' pages, not the kernel's guesses around them
            prefetch_rows(self.indices, pos)
            if self.eid is not None:
                prefetch_rows(self.eid, pos)
        src = take(self.indices, pos).to(torch.int64)  # a stored CSR may hold int32
        return row, src, pos if self.eid is None else take(self.eid, pos).to(torch.int64)

    def out_degrees_of(self, nodes):
        return take(self.out_degree, nodes)

    def release(self) -> None:
        """Hand the pages of a memory-mapped CSR read on the host back to the page
        cache: the partition and the step that follow do not read them, and the next
        batch maps them again from there."""
        if self.host:
            release_pages((self.indices, self.eid))


def check_fanouts(fanouts: Sequence[int]) -> list[int]:
    """``fanouts`` as a list of ints, after checking that each is an integer >= 1 or -1
    (every neighbour) and that there is at least one.

    Raises:
        ValueError: an empty list, or a fanout that is not such an integer (a float is
            refused, not truncated).
    """
    fanouts = list(fanouts)
    if not fanouts:
        raise ValueError("fanouts must list at least one layer")
    if any(not is_integer(f) or f == 0 or f < -1 for f in fanouts):
        raise ValueError(f"each fanout must be a positive int or -1, got {fanouts}")
    return [int(f) for f in fanouts]


def sample_full_batch(
    graph,
    outputs: torch.Tensor,
    fanouts: Sequence[int],
    *,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> SampledBatch:
    """Sample the L-hop neighbourhood of ``outputs`` once.

    Layer ``L-1`` samples the in-edges of the outputs, layer ``l`` those of layer
    ``l+1``'s sources. A block's sources are its destinations (in order) followed by the
    other sampled neighbours by ascending global ID.

    Args:
        graph: a :class:`betty.graph.Graph` (or a ``dgl.DGLGraph``, converted; pass a
            ``Graph`` to reuse its cached CSR across calls), or a
            :class:`NeighbourSource` (host path only: a remote graph store).
        outputs: ``(n_out,)`` distinct global IDs of the output nodes.
        fanouts: per-layer fanouts, input layer first; ``-1`` means all neighbours.
        seed: seeds the sampler; the same seed gives the same batch.
        device: ``None``: the host path (NumPy index work, CPU tensors). A device: the
            torch-op path on that device (:func:`sample_neighbors_torch`; the graph's
            CSR and out-degrees are copied there once and cached) with a generator on
            that device seeded with ``seed``. On ``"cpu"`` the batch equals the host
            path's bit for bit; on CUDA it is deterministic per seed but not the CPU's
            batch (another random stream).

    Returns:
        A :class:`SampledBatch` whose edges are in canonical order, its tensors on
        ``device`` (on the CPU for ``None``). The host path then hands the pages of a
        memory-mapped CSR that it read back to the page cache
        (:func:`betty.pages.release_pages`): the partition and the step that follow
        do not read them, and the next batch maps them again from the page cache.
    """
    fanouts = check_fanouts(fanouts)
    on = torch.device("cpu") if device is None else torch.device(device)
    outputs = integer_ids(torch.as_tensor(outputs), "outputs", "node IDs").to(on)
    if outputs.numel() == 0:
        raise ValueError("a batch needs at least one output node")
    source = sampler_graph(graph)
    if isinstance(source, Graph):
        source = _LocalCSR(source, None if device is None else on)
    elif device is not None:
        raise ValueError("a NeighbourSource is sampled on the host: pass device=None")
    n = source.num_nodes()
    if int(outputs.min()) < 0 or int(outputs.max()) >= n:
        raise ValueError(f"output node IDs must lie in [0, {n})")
    mark = torch.zeros(n, dtype=torch.bool, device=on)  # scratch node set, cleared after each use
    mark[outputs] = True
    if int(mark.sum()) != outputs.numel():
        raise ValueError("output node IDs must be distinct")
    mark[outputs] = False

    gen = torch.Generator(device=on).manual_seed(int(seed))
    local = torch.empty(n, dtype=torch.int64, device=on)  # global -> local source index, per layer
    layers: list[LayerEdges] = []
    dst_nid = outputs
    for fanout in reversed(fanouts):
        # rows ascending, each row's picks in CSR order: already canonical order
        row, src_gid, edge_id = source.sample_in_edges(dst_nid, fanout, gen)
        put(mark, src_gid, True)
        mark[dst_nid] = False
        extra = torch.nonzero(mark).view(-1)  # the other sources, ascending
        mark[extra] = False
        src_nid = torch.cat([dst_nid, extra])
        local[src_nid] = torch.arange(src_nid.numel(), device=on)
        layers.append(
            LayerEdges(
                src_nid=src_nid,
                num_dst=int(dst_nid.numel()),
                edge_src=take(local, src_gid),
                edge_dst=row,
                edge_id=edge_id,
                src_out_degree=source.out_degrees_of(src_nid),
            )
        )
        dst_nid = src_nid
    layers.reverse()
    if isinstance(source, _LocalCSR):
        source.release()
    return SampledBatch(layers=layers, fanouts=fanouts)
