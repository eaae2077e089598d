"""Betty's redundancy-embedded graph (REG) over the output nodes, cut with METIS
or KaMinPar.

Let ``B`` be a 0/1 incidence ``(n_src, n_out)``: ``B[s, j] = 1`` iff output ``j`` needs
source ``s``. The REG is

    C = Bᵀ B  with its diagonal removed,   C[i, j] = |sources(i) ∩ sources(j)|,

the number of sources outputs ``i`` and ``j`` share: putting ``i`` and ``j`` in
different micro-batches loads each of them twice. It is built over the outputs only
(``n_out × n_out``), never as the ``n_src × n_src`` product.

Methods registered here:

* ``reg``: ``B`` = the output layer's incidence (:func:`~betty.partition.incidence.
  output_layer_incidence`, an output's own row and its sampled neighbours), ``C``'s
  counts as METIS edge weights (the paper's method).
* ``reg-unweighted``: the same graph with unit edge weights (what Betty's artifact ran:
  DGL's METIS wrapper drops edge weights).
* ``reg-all``: ``B`` = the L-hop output -> layer-0 input incidence
  (:func:`~betty.partition.incidence.multi_hop_incidence`), weighted, with its own
  default hub cap (:data:`DEFAULT_MAX_HUB_DEGREE_ALL`).

**The cut.** ``partitioner`` (``partition.partitioner``) picks the graph partitioner:
``metis`` (pymetis, one thread, :func:`~betty.partition.metis_cut.metis_cut`) or
``kaminpar`` (:func:`~betty.partition.kaminpar_cut.kaminpar_cut`, on the cores the
trainer's ``trainer_threads`` leave, one thread when ``deterministic``). Both balance the
outputs' weights within 3% and are reproducible for a seed (KaMinPar only on one thread).

**Hub cap.** Source ``s`` needed by ``d_s`` outputs adds a ``d_s``-clique
(``d_s(d_s - 1)`` ordered pairs) to ``C``, so a power-law batch's few hubs would
dominate memory. Sources with ``d_s <= max_hub_degree`` contribute their exact clique
(through one sparse product); a *hub* source (``d_s > max_hub_degree``) instead links
its outputs in a ring: in a seeded random order, each output is joined to the next
``hub_links`` outputs (circularly), weight 1 per link. The ring keeps all of a hub's
outputs connected (cutting it costs at least 2 links per extra micro-batch it spans) while
adding ``2 · hub_links · d_s`` ordered pairs instead of ``d_s(d_s - 1)``. So the pairs
built are at most ``nnz(B) · max(max_hub_degree, 2 · hub_links)``.
"""

from __future__ import annotations

import time

import numpy as np
import scipy.sparse as sp

from betty.batch import SampledBatch
from betty.catalog import DEFAULT_REG_PARTITIONER, REG_PARTITIONERS
from betty.partition.balance import fill_empty_micro_batches, integer_vertex_weights
from betty.partition.base import PartitionResult, register
from betty.partition.incidence import (
    index_dtype,
    multi_hop_incidence,
    output_layer_incidence,
)
from betty.partition.kaminpar_cut import cut_threads, kaminpar_cut
from betty.partition.metis_cut import metis_cut, metis_index_dtype

__all__ = [
    "redundancy_graph",
    "reg_partition",
    "reg_unweighted_partition",
    "reg_all_partition",
    "DEFAULT_MAX_HUB_DEGREE",
    "DEFAULT_HUB_LINKS",
    "DEFAULT_MAX_HUB_DEGREE_ALL",
    "DEFAULT_PARTITIONER",
    "PARTITIONER_CHOICES",
]

#: The graph partitioners that can cut the REG (``partition.partitioner``).
PARTITIONER_CHOICES = REG_PARTITIONERS
#: The default one (docs/partitioning.md compares them on the products-scale batch).
DEFAULT_PARTITIONER = DEFAULT_REG_PARTITIONER

#: Sources needed by more outputs than this are hubs (ring instead of clique). On the
#: products-scale synthetic batch (196,615 outputs, K = 8), redundancy with no cap /
#: 64 / 16: 1.2513 / 1.2220 / 1.1779 with one layer, 2.7200 / 2.6278 / 2.6134 with two,
#: and 16 keeps a quarter of the uncapped C's entries
#: (``benchmarks/partition.py --hub-caps none 64 16``, with ``--fanouts 10`` for one
#: layer): hub cliques dominate the edge weights.
DEFAULT_MAX_HUB_DEGREE = 16
#: The same cap for ``reg-all``, whose L-hop rows are far denser (at products scale,
#: 2 hops, the exact BᵀB has ~100x the output layer's pairs).
DEFAULT_MAX_HUB_DEGREE_ALL = 16
#: Ring links per output of a hub source (each output gets 2 · hub_links ring edges).
DEFAULT_HUB_LINKS = 2
#: Largest number of (output, output) pairs expanded at once while building ``C``
#: (one chunk of rows); bounds the transient memory to about 12 bytes per pair.
DEFAULT_CHUNK_PAIRS = 1 << 24


def _hub_ring_layout(
    hub_rows: sp.csr_matrix, hub_links: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, int]:
    """The hub rings: each pin's output and its ring neighbours' outputs.

    The members of each hub row are laid out in a seeded random order: pin ``p``
    (``nnz_hub`` pins in all, rows contiguous as in ``hub_rows``) sits in row ``r`` at
    offset ``o``. Its ring neighbours are the pins at offsets ``(o ± t) mod d_r``,
    ``t = 1..hub_links``.

    Returns:
        ``(members (nnz_hub,) int32, partners (nnz_hub, 2 · hub_links) int32,
        off_diagonal)``: ``members[p]`` is pin ``p``'s output, ``partners[p]`` its ring
        neighbours' outputs; ``off_diagonal`` counts the (pin, neighbour) pairs on two
        different outputs (a ring shorter than ``2 · hub_links + 1`` wraps onto the
        pin itself, ``t ≡ 0 mod d_r``).
    """
    deg = np.diff(hub_rows.indptr).astype(np.int64)
    nnz = int(deg.sum())
    it = index_dtype(nnz)
    pin_row = np.repeat(np.arange(deg.size, dtype=it), deg)
    # a seeded random order of the pins, then a stable counting sort by row: the rows
    # stay contiguous (as in hub_rows) and each row's members come out shuffled
    perm = rng.permutation(nnz).astype(it)
    by_row = sp.csr_matrix(
        (perm, pin_row[perm], np.arange(nnz + 1, dtype=np.int64)), shape=(nnz, deg.size)
    ).tocsc()
    members = hub_rows.indices[by_row.data].astype(np.int32)
    del perm, by_row
    start = hub_rows.indptr[:-1].astype(np.int64)[pin_row]
    d = deg[pin_row]
    del pin_row
    offset = np.arange(nnz, dtype=np.int64) - start
    partners = np.empty((nnz, 2 * hub_links), dtype=np.int32)
    for t in range(1, hub_links + 1):  # hub_links (a small constant) iterations
        partners[:, 2 * t - 2] = members[start + (offset + t) % d]
        partners[:, 2 * t - 1] = members[start + (offset - t) % d]
    t = np.arange(1, hub_links + 1)
    off_diagonal = int((2 * deg[:, None] * (t[None, :] % deg[:, None] != 0)).sum())
    return members, partners, off_diagonal


def _stack_rows(top: sp.csr_matrix, cols: np.ndarray, n_cols: int) -> sp.csr_matrix:
    """``[top; X]`` as 0/1 int32 CSR, where row ``p`` of ``X`` has ones at ``cols[p]``
    (``cols`` ``(rows, w)``: ``w`` entries per row)."""
    rows, width = cols.shape
    indptr = np.concatenate([
        top.indptr.astype(np.int64),
        top.nnz + width * np.arange(1, rows + 1, dtype=np.int64),
    ])
    indices = np.concatenate([top.indices.astype(np.int32, copy=False), cols.ravel()])
    data = np.ones(indices.size, dtype=np.int32)
    return sp.csr_matrix((data, indices, indptr), shape=(top.shape[0] + rows, n_cols),
                         copy=False)


def _chunk_bounds(work: np.ndarray, chunk_pairs: int) -> np.ndarray:
    """Row boundaries ``[0, ..., n]`` of consecutive chunks of about ``chunk_pairs`` work
    each (a row heavier than ``chunk_pairs`` is a chunk of its own)."""
    n = work.size
    if n == 0:
        return np.zeros(2, dtype=np.int64)  # one empty chunk: C is 0 x 0
    cum = np.cumsum(work, dtype=np.int64)
    if cum[-1] <= chunk_pairs:
        return np.array([0, n], dtype=np.int64)
    targets = np.arange(chunk_pairs, int(cum[-1]) + chunk_pairs, chunk_pairs, dtype=np.int64)
    ends = np.searchsorted(cum, targets, side="right")
    ends = np.unique(np.clip(ends, 1, n))
    return np.concatenate([[0], ends if ends[-1] == n else np.append(ends, n)]).astype(np.int64)


def _assemble_rows(blocks: list[sp.csr_matrix], n_cols: int, dtype: np.dtype) -> sp.csr_matrix:
    """``vstack(blocks)`` as CSR with ``dtype`` ``indptr``, ``indices`` and ``data``,
    entries in the blocks' order. Each block is copied into the preallocated result and
    released (``blocks`` is emptied), so the peak is the result plus one block, not twice
    the result as with a concatenation."""
    nnz = sum(block.nnz for block in blocks)
    rows = sum(block.shape[0] for block in blocks)
    indptr = np.empty(rows + 1, dtype=np.promote_types(dtype, index_dtype(nnz + 1)))
    indices = np.empty(nnz, dtype=dtype)
    data = np.empty(nnz, dtype=dtype)
    indptr[0] = 0
    row, pos = 0, 0
    blocks.reverse()  # pop from the end: the first block first
    while blocks:
        block = blocks.pop()
        n_rows, end = block.shape[0], pos + block.nnz
        indptr[row + 1:row + n_rows + 1] = block.indptr[1:].astype(np.int64) + pos
        indices[pos:end] = block.indices
        data[pos:end] = block.data
        row, pos = row + n_rows, end
        del block
    out = sp.csr_matrix((rows, n_cols), dtype=dtype)
    # assigned, not passed to the constructor: scipy narrows int64 index arrays whose
    # values fit int32, which would copy them
    out.indptr, out.indices, out.data = indptr, indices, data
    out.check_format(full_check=False)
    return out


def redundancy_graph(
    incidence: sp.spmatrix,
    *,
    max_hub_degree: int | None = DEFAULT_MAX_HUB_DEGREE,
    hub_links: int = DEFAULT_HUB_LINKS,
    seed: int = 0,
    chunk_pairs: int = DEFAULT_CHUNK_PAIRS,
    dtype: np.dtype | type = np.int32,
) -> tuple[sp.csr_matrix, dict]:
    """The REG ``C`` over the columns (outputs) of ``incidence``, hub-capped, built in
    row chunks.

    ``C`` is assembled ``[lo, hi)`` rows at a time: ``C[lo:hi] = (Sᵀ)[lo:hi] @ S`` (``S``
    = the non-hub rows of ``B``; scipy's product sums the shared-source counts row by
    row) plus the chunk's ring links, diagonal dropped. The rows of a chunk expand at
    most ``chunk_pairs`` (output, output) pairs (a single heavier row excepted), so the
    transient memory is one chunk's pairs. The chunks are copied one at a time into
    ``C``'s arrays and freed, so the peak is about the final ``C`` (indices + counts,
    ``2 · itemsize(dtype)`` bytes per entry) plus one chunk, plus the ring layout (about
    12 bytes per hub pin). The result does not depend on ``chunk_pairs`` or ``dtype``.

    Args:
        incidence: ``B`` ``(n_src, n_out)`` 0/1 sparse.
        max_hub_degree: sources with more outputs than this are hubs (ring, not
            clique). ``None`` disables the cap (exact ``BᵀB``).
        hub_links: ring links per output of a hub source, ``>= 1``.
        seed: seeds the ring order of the hub sources.
        chunk_pairs: pairs expanded per chunk of rows, ``>= 1``.
        dtype: integer type of ``C``'s ``indices``, ``data`` and ``indptr`` (``indptr``
            int64 when ``C``'s entries outnumber int32): ``int32``, or METIS's ``idx_t``
            (:func:`~betty.partition.metis_cut.metis_index_dtype`) so that METIS reads
            ``C``'s own arrays instead of widened copies held beside them.

    Returns:
        ``(C, stats)``: ``C`` ``(n_out, n_out)`` ``dtype`` CSR, symmetric,
        zero diagonal, ``C[i, j]`` = shared non-hub sources + ring links between ``i``
        and ``j``; ``stats`` has ``hub_sources``, ``hub_pin_fraction`` (share of ``B``'s
        entries in hub rows), ``pairs_exact`` (ordered pairs an uncapped ``BᵀB`` would
        add, with repeats), ``pairs_built``, ``reg_nnz`` and ``chunks``.
    """
    if max_hub_degree is not None and max_hub_degree < 1:
        raise ValueError(f"max_hub_degree must be >= 1 or None, got {max_hub_degree}")
    if hub_links < 1:
        raise ValueError(f"hub_links must be >= 1, got {hub_links}")
    if chunk_pairs < 1:
        raise ValueError(f"chunk_pairs must be >= 1, got {chunk_pairs}")
    if np.dtype(dtype) not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise ValueError(f"dtype must be int32 or int64, got {np.dtype(dtype)}")
    b = sp.csr_matrix(incidence, dtype=np.int32)
    n_out = b.shape[1]
    deg = np.diff(b.indptr).astype(np.int64)
    hub = deg > max_hub_degree if max_hub_degree is not None else np.zeros(deg.size, bool)

    small = b[~hub] if hub.any() else b
    small_deg = deg[~hub]
    pairs_built = int((small_deg * (small_deg - 1)).sum())
    # C = Sᵀ S + Hᵀ Q = Lᵀ R with L = [S; H], R = [S; Q] (S = the non-hub rows of B)
    left, right = small, small
    if hub.any():
        members, partners, ring_pairs = _hub_ring_layout(
            b[hub], hub_links, np.random.default_rng(seed)
        )
        pairs_built += ring_pairs
        left = _stack_rows(small, members[:, None], n_out)
        del members
        right = _stack_rows(small, partners, n_out)
        del partners
    left_t = left.T.tocsr()  # (n_out, rows of L): row j = the rows of L holding j
    del left
    # pairs expanded by row j of Lᵀ R: Σ over L's rows holding j of R's row length
    work = left_t @ np.diff(right.indptr).astype(np.int64)
    bounds = _chunk_bounds(work, chunk_pairs)

    blocks = []
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):  # one pass per chunk
        block = sp.csr_matrix(left_t[lo:hi] @ right)  # exact sums, no repeated entries
        block.setdiag(0, k=lo)  # C's diagonal: block entry (i - lo, i)
        block.eliminate_zeros()
        blocks.append(block)
        del block
    del left_t, right
    c = _assemble_rows(blocks, n_out, np.dtype(dtype))
    stats = {
        "hub_sources": int(hub.sum()),
        "hub_pin_fraction": float(deg[hub].sum() / max(int(deg.sum()), 1)),
        "pairs_exact": int((deg * (deg - 1)).sum()),
        "pairs_built": pairs_built,
        "reg_nnz": int(c.nnz),
        "chunks": int(bounds.size - 1),
    }
    return c, stats


def _cut_reg(
    batch: SampledBatch,
    k: int,
    incidence_fn,
    method: str,
    *,
    weighted: bool,
    seed: int,
    weights,
    max_hub_degree: int | None,
    hub_links: int,
    partitioner: str = DEFAULT_PARTITIONER,
    deterministic: bool = False,
    trainer_threads: int | None = None,
) -> PartitionResult:
    if partitioner not in PARTITIONER_CHOICES:
        raise ValueError(f"partition.partitioner must be one of {list(PARTITIONER_CHOICES)}, "
                         f"got {partitioner!r}")
    start = time.perf_counter()
    # C does not depend on K: a K search builds it once per batch. For METIS it is built
    # in METIS's idx_t, so that METIS reads C's arrays, not widened copies held beside it
    dtype = metis_index_dtype() if partitioner == "metis" else np.dtype(np.int32)
    reg, stats = batch.derived(
        ("redundancy_graph", incidence_fn.__name__, max_hub_degree, hub_links, seed, dtype.name),
        lambda: redundancy_graph(incidence_fn(batch), max_hub_degree=max_hub_degree,
                                 hub_links=hub_links, seed=seed, dtype=dtype),
        slot="redundancy_graph")
    vweights = integer_vertex_weights(weights, batch.num_outputs)
    built = time.perf_counter()
    threads = 1
    if partitioner == "kaminpar":
        threads = cut_threads(trainer_threads, deterministic=deterministic)
        groups, cut = kaminpar_cut(reg, k, vweights=vweights, use_edge_weights=weighted,
                                   seed=seed, threads=threads)
    else:
        groups, cut = metis_cut(reg, k, vweights=vweights, use_edge_weights=weighted, seed=seed)
    done = time.perf_counter()
    groups, moved = fill_empty_micro_batches(groups, k)
    info = dict(stats, edge_cut=cut, moved_to_empty=moved, max_hub_degree=max_hub_degree,
                hub_links=hub_links, partitioner=partitioner, cut_threads=threads)
    return PartitionResult(groups, k, method, built - start, done - built, info)


#: the ``options`` of :func:`~betty.partition.partition_batch` the REG methods take
REG_OPTIONS = ("partitioner", "deterministic", "trainer_threads", "max_hub_degree", "hub_links")


def _reg_method(name: str, incidence_fn, *, weighted: bool, max_hub_degree: int | None, doc: str):
    """Register the REG partitioner ``name``: :func:`_cut_reg` with ``incidence_fn``,
    edge weights on or off and its default hub cap."""
    default_hub = max_hub_degree

    def partition(batch: SampledBatch, k: int, *, seed: int = 0, weights=None, graph=None,
                  max_hub_degree: int | None = default_hub,
                  hub_links: int = DEFAULT_HUB_LINKS,
                  partitioner: str = DEFAULT_PARTITIONER, deterministic: bool = False,
                  trainer_threads: int | None = None) -> PartitionResult:
        return _cut_reg(batch, k, incidence_fn, name, weighted=weighted, seed=seed,
                        weights=weights, max_hub_degree=max_hub_degree, hub_links=hub_links,
                        partitioner=partitioner, deterministic=deterministic,
                        trainer_threads=trainer_threads)

    partition.__name__ = partition.__qualname__ = name.replace("-", "_") + "_partition"
    partition.__doc__ = doc
    return register(name, options=REG_OPTIONS)(partition)


reg_partition = _reg_method(
    "reg", output_layer_incidence, weighted=True, max_hub_degree=DEFAULT_MAX_HUB_DEGREE,
    doc="METIS on the output-layer REG with shared-source counts as edge weights.")
reg_unweighted_partition = _reg_method(
    "reg-unweighted", output_layer_incidence, weighted=False,
    max_hub_degree=DEFAULT_MAX_HUB_DEGREE,
    doc="METIS on the output-layer REG's pattern (unit edge weights), as Betty's artifact.")
reg_all_partition = _reg_method(
    "reg-all", multi_hop_incidence, weighted=True, max_hub_degree=DEFAULT_MAX_HUB_DEGREE_ALL,
    doc="METIS on the weighted REG of the L-hop output -> input incidence.")
