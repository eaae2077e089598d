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

import threading

import torch

from betty.checks import integer_ids
from betty.batch import LayerEdges, MicroBatch, SampledBatch
from betty.indexing import argsort_runs, put, take

__all__ = ["Carver", "carve", "split", "validate_groups", "SCAN_RATIO"]

#: A micro-batch whose layer has at most this many sources per micro-batch edge finds its distinct
#: sources by scanning the layer's sources (cheaper than sorting when the micro-batch touches
#: a large share of them); smaller micro-batches sort only their own sources.
SCAN_RATIO = 8


class Carver:
    """Carves any number of micro-batches out of one full batch.

    Built once per full batch (O(full batch)): per layer, a CSR pointer over the
    destination-sorted edges, each source's rank in ascending global-ID order, a
    reusable ``-1``-filled position buffer and scratch buffers. Carving a micro-batch with
    ``m_l`` edges and ``u_l <= m_l`` distinct sources at layer ``l`` (``n_l`` sources in
    the full layer) costs O(m_l + min(n_l, u_l log u_l)): a small micro-batch
    (``n_l > SCAN_RATIO · m_l``) de-duplicates its sources through a scratch buffer and
    sorts only those (never touching the other sources); a large one marks its sources
    and scans the layer's sources in global-ID order, which then costs at most
    ``SCAN_RATIO · m_l``. So K micro-batches cost O(full batch) once plus O(Σ micro-batches · log).

    Edges of a carved block are grouped by destination (in the micro-batch's destination
    order) and, within a destination, keep the full batch's canonical order (ascending
    source global ID).
    """

    def __init__(self, full: SampledBatch, *, torch_ops: bool | None = None) -> None:
        self.full = full
        self.device = full.layers[0].src_nid.device
        #: torch ops for the index work (``None``: off the CPU); on the CPU the same
        #: micro-batches as NumPy's, bit for bit
        self.torch_ops = self.device.type != "cpu" if torch_ops is None else bool(torch_ops)
        self._edge_order: list[torch.Tensor | None] = []
        self._indptr: list[torch.Tensor] = []
        self._by_gid: list[torch.Tensor] = []
        self._rank: list[torch.Tensor] = []
        on = self.device
        for layer in full.layers:
            dst = layer.edge_dst
            order = None
            if dst.numel() > 1 and bool((dst[1:] < dst[:-1]).any()):
                order = torch.argsort(dst, stable=True)  # keeps the order within a destination
            self._edge_order.append(order)
            counts = torch.bincount(dst, minlength=layer.num_dst)
            indptr = torch.zeros(layer.num_dst + 1, dtype=torch.int64, device=on)
            torch.cumsum(counts, 0, out=indptr[1:])
            self._indptr.append(indptr)
            by_gid = argsort_runs(layer.src_nid, torch_ops=self.torch_ops)  # ascending global ID
            rank = torch.empty_like(by_gid)
            rank[by_gid] = torch.arange(by_gid.numel(), dtype=torch.int64, device=on)
            self._by_gid.append(by_gid)
            self._rank.append(rank)
        self._local = threading.local()  # each carving thread's scratch buffers
        self._scratch()

    @staticmethod
    def state_bytes(full: SampledBatch, granule: int = 1) -> int:
        """Bytes a Carver of ``full`` holds on ``full``'s device with one carving
        thread (:meth:`nbytes` of a new Carver), from the batch's sizes: per layer with
        ``n`` sources, ``d`` destinations and ``E`` edges, ``8 (d + 1)`` (the CSR
        pointer), ``8 n`` twice (sources by global ID, their ranks), ``8 E`` for the edge
        order when the edges are not destination-sorted, and the scratch ``8 n + 8 n +
        n`` (positions, last writes, marks); each tensor rounded up to ``granule`` bytes
        (CUDA's caching allocator: 512)."""
        def rounded(nbytes: int) -> int:
            return -(-nbytes // granule) * granule

        total = 0
        for layer in full.layers:
            dst, n = layer.edge_dst, layer.num_src
            if dst.numel() > 1 and bool((dst[1:] < dst[:-1]).any()):
                total += rounded(8 * dst.numel())
            total += rounded(8 * (layer.num_dst + 1)) + 4 * rounded(8 * n) + rounded(n)
        return total

    def nbytes(self, granule: int = 1) -> int:
        """Bytes of the tensors this Carver holds (this thread's scratch included), each
        rounded up to ``granule`` bytes."""
        pos, last, seen = self._scratch()
        tensors = [t for group in (self._edge_order, self._indptr, self._by_gid, self._rank,
                                   pos, last, seen) for t in group if t is not None]
        return sum(-(-t.untyped_storage().nbytes() // granule) * granule for t in tensors)

    def _scratch(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """This thread's per-layer scratch ``(pos, last, seen)``: ``pos`` all -1, ``seen``
        all False between carves; made on a thread's first carve, so that micro-batches can be
        carved on several threads at once (:func:`betty.train.carve_all`)."""
        local = self._local
        if not hasattr(local, "pos"):
            sizes = [layer.num_src for layer in self.full.layers]
            on = self.device
            local.pos = [torch.full((n,), -1, dtype=torch.int64, device=on) for n in sizes]
            local.last = [torch.zeros(n, dtype=torch.int64, device=on) for n in sizes]
            local.seen = [torch.zeros(n, dtype=torch.bool, device=on) for n in sizes]
        return local.pos, local.last, local.seen

    def carve(self, output_index: torch.Tensor) -> MicroBatch:
        """The micro-batch computing the outputs at ``output_index`` (positions into
        ``full.output_nid``, distinct), its tensors on the full batch's device.

        Raises:
            ValueError: ``output_index`` is not a 1-D integer tensor of distinct positions
                in ``[0, num_outputs)`` (a negative one named another node, a repeated
                one counted its output twice).
        """
        full, on = self.full, self.device
        ops = {"torch_ops": self.torch_ops}
        output_index = _checked_positions(output_index, full.num_outputs).to(on)
        n_layers = full.num_layers
        layers: list[LayerEdges | None] = [None] * n_layers
        full_src_index: list[torch.Tensor | None] = [None] * n_layers

        positions, _, _ = self._scratch()
        dst_full = output_index  # positions among full layer-l destinations
        for l in reversed(range(n_layers)):
            fl, indptr, pos = full.layers[l], self._indptr[l], positions[l]
            n_dst = dst_full.numel()

            # the edges of the needed destinations, destination by destination
            starts = take(indptr, dst_full, **ops)
            counts = take(indptr, dst_full + 1, **ops) - starts
            total = int(counts.sum())
            offsets = torch.cumsum(counts, 0) - counts
            edge = torch.repeat_interleave(starts - offsets, counts) + torch.arange(total, device=on)
            if self._edge_order[l] is not None:
                edge = take(self._edge_order[l], edge, **ops)
            e_src = take(fl.edge_src, edge, **ops)
            e_dst = torch.repeat_interleave(torch.arange(n_dst, dtype=torch.int64, device=on), counts)

            # sources: the destinations first, then the others by ascending global ID
            touched = self._sources_by_gid(l, e_src)
            put(pos, dst_full, torch.arange(n_dst, dtype=torch.int64, device=on), **ops)
            extra = touched[take(pos, touched, **ops) < 0]
            put(pos, extra, torch.arange(n_dst, n_dst + extra.numel(), dtype=torch.int64, device=on), **ops)
            src_full = torch.cat([dst_full, extra])
            e_src_local = take(pos, e_src, **ops)
            put(pos, src_full, -1, **ops)  # leave the buffer clean for the next micro-batch

            layers[l] = LayerEdges(
                src_nid=take(fl.src_nid, src_full, **ops),
                num_dst=n_dst,
                edge_src=e_src_local,
                edge_dst=e_dst,
                edge_id=take(fl.edge_id, edge, **ops),
                src_out_degree=(None if fl.src_out_degree is None
                                else take(fl.src_out_degree, src_full, **ops)),
            )
            full_src_index[l] = src_full
            dst_full = src_full  # layer l's sources are layer l-1's destinations

        return MicroBatch(layers=layers, output_index=output_index, full_src_index=full_src_index)

    def _sources_by_gid(self, l: int, e_src: torch.Tensor) -> torch.Tensor:
        """The distinct entries of ``e_src`` (layer-``l`` source positions), in ascending
        global-ID order; O(m + min(n_src, u log u)) for ``m`` edges, ``u`` distinct."""
        by_gid, m = self._by_gid[l], e_src.numel()
        ops = {"torch_ops": self.torch_ops}
        _, lasts, seens = self._scratch()
        if by_gid.numel() <= SCAN_RATIO * m:  # large micro-batch: a scan costs <= SCAN_RATIO * m
            seen = seens[l]
            put(seen, e_src, True, **ops)
            touched = by_gid[take(seen, by_gid, **ops)]
            put(seen, touched, False, **ops)  # leave the buffer clean for the next micro-batch
            return touched
        # small micro-batch: write each edge's position at its source (one write per source
        # survives, whichever); the edges reading back their own position are one per
        # distinct source. Stale entries of earlier micro-batches are never read (every source
        # read here was just written). Then sort only the distinct sources' ranks.
        last, span = lasts[l], torch.arange(m, dtype=torch.int64, device=self.device)
        put(last, e_src, span, **ops)
        distinct = e_src[take(last, e_src, **ops) == span]
        return take(by_gid, torch.sort(take(self._rank[l], distinct, **ops)).values, **ops)


def carve(full: SampledBatch, output_index: torch.Tensor) -> MicroBatch:
    """The micro-batch that computes the outputs at ``output_index``.

    Args:
        full: the full sampled batch.
        output_index: ``(m,)`` positions into ``full.output_nid`` (distinct).

    Returns:
        A :class:`MicroBatch` with its own L blocks. To carve several micro-batches of the same
        batch, build one :class:`Carver` and reuse it.
    """
    return Carver(full).carve(output_index)


def _checked_positions(output_index, num_outputs: int) -> torch.Tensor:
    """``output_index`` as int64 after :meth:`Carver.carve`'s checks."""
    idx = integer_ids(torch.as_tensor(output_index), "output_index", "output positions", upper=num_outputs)
    if idx.numel() > 1:
        ordered = idx.sort().values
        if bool((ordered[1:] == ordered[:-1]).any()):
            raise ValueError("output_index must name each output once (a repeated one would count "
                             "its loss twice)")
    return idx


def validate_groups(groups: torch.Tensor, num_outputs: int, k: int) -> torch.Tensor:
    """Check a partition vector: ``(num_outputs,)`` ints in ``[0, k)``, no empty micro-batch;
    returned as int64 (floats are refused, not truncated: ``0.5`` names no micro-batch)."""
    groups = torch.as_tensor(groups)
    if groups.is_floating_point() or groups.is_complex() or groups.dtype == torch.bool:
        raise ValueError(f"partition must give each output node an integer micro-batch index, got dtype {groups.dtype}")
    groups = groups.to(torch.int64)
    if groups.shape != (num_outputs,):
        raise ValueError(
            f"partition must assign each of the {num_outputs} output nodes a micro-batch, "
            f"got shape {tuple(groups.shape)}"
        )
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if groups.numel() and (groups.min() < 0 or groups.max() >= k):
        raise ValueError(f"micro-batch indices must lie in [0, {k}), got "
                         f"[{int(groups.min())}, {int(groups.max())}]")
    sizes = torch.bincount(groups, minlength=k)
    if (sizes == 0).any():
        empty = torch.nonzero(sizes == 0).flatten().tolist()
        raise ValueError(f"micro-batches {empty} of {k} are empty")
    return groups


def split(full: SampledBatch, groups: torch.Tensor, k: int | None = None) -> list[MicroBatch]:
    """Carve one micro-batch per group of ``groups``.

    Args:
        full: the full sampled batch.
        groups: ``(n_out,)`` micro-batch index of each output node (in ``full.output_nid``
            order).
        k: number of micro-batches (default: ``groups.max() + 1``).
    """
    groups = torch.as_tensor(groups)  # validated as given: a float or bool partition is refused
    if k is None:
        k = int(groups.max()) + 1 if groups.numel() else 1
    groups = validate_groups(groups, full.num_outputs, k)
    order = torch.argsort(groups, stable=True)
    sizes = torch.bincount(groups, minlength=k).tolist()
    carver = Carver(full)
    return [carver.carve(idx) for idx in torch.split(order, sizes)]
