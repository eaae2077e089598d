"""The one call into KaMinPar in betty: a K-way cut of a symmetric sparse graph.

KaMinPar (``kaminpar`` on PyPI, the KaMinPar shared-memory multilevel partitioner) is a
multi-threaded alternative to METIS for the REG cut (``partition.partitioner:
kaminpar``). Its Python binding reads graphs only from files, so :func:`kaminpar_cut`
writes the CSR in KaMinPar's binary ParHiP format (a 24-byte header ``version, n, m``,
then ``n + 1`` byte offsets of the adjacency lists, the ``m`` neighbour IDs, ``n``
vertex weights, ``m`` edge weights; 32-bit IDs and weights where they fit, else 64-bit)
to a temporary file (in ``/dev/shm`` where it exists) and loads it back.

Balance: each part's vertex weight is at most ``(1 + epsilon) · ⌈W / k⌉`` (``W`` the
total weight), ``epsilon = 0.03`` as METIS's default ``ufactor`` of 30.

Reproducibility: a fixed seed (``kaminpar.reseed``) on **one** thread gives the same
partition every time; on several threads the result varies from run to run (measured:
4 runs on 2 threads gave 4 different partitions). :func:`cut_threads` therefore
returns 1 when ``deterministic`` is set.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import scipy.sparse as sp

from betty.partition.base import c_int_seed
from betty.workers import spare_cores

__all__ = ["KAMINPAR_EPSILON", "cut_threads", "kaminpar_available", "kaminpar_cut",
           "write_parhip"]

#: Allowed imbalance: parts weigh at most ``(1 + KAMINPAR_EPSILON) · ⌈W / k⌉``.
KAMINPAR_EPSILON = 0.03

_U32 = np.iinfo(np.uint32).max
_I32 = np.iinfo(np.int32).max


def kaminpar_available() -> bool:
    """Whether the ``kaminpar`` package imports."""
    try:
        import kaminpar  # noqa: F401
    except ImportError:
        return False
    return True


def cut_threads(trainer_threads: int | None = None, *, deterministic: bool = False,
                cores: int | None = None) -> int:
    """Threads for the cut: the cores the trainer threads leave
    (:func:`betty.workers.spare_cores`: ``cores - trainer_threads``, shared among this
    machine's ranks, at least 1); exactly 1 when ``deterministic`` (KaMinPar is
    reproducible for a seed only on one thread)."""
    if deterministic:
        return 1
    return spare_cores(trainer_threads, cores)


def write_parhip(path: str, adj: sp.csr_matrix, vweights: np.ndarray,
                 eweights: np.ndarray) -> None:
    """Write ``adj`` (``(n, n)`` CSR) with ``vweights`` ``(n,)`` and ``eweights``
    ``(nnz,)`` (positive integers) to ``path`` in KaMinPar's binary ParHiP format.

    ``version`` bits (LSB first): no edge weights, no vertex weights, 32-bit edge
    offsets, 32-bit vertex IDs, 32-bit vertex weights, 32-bit edge weights; here both
    weights are present and each field is 32-bit when its values fit.
    """
    n, m = adj.shape[0], int(adj.nnz)
    vid32 = n <= _U32
    vw32 = vweights.size == 0 or int(vweights.max()) <= _I32
    ew32 = eweights.size == 0 or int(eweights.max()) <= _I32
    vid_bytes = 4 if vid32 else 8
    header = 24 + (n + 1) * 8  # offsets stay 64-bit: they are byte addresses in the file
    version = (vid32 << 3) | (vw32 << 4) | (ew32 << 5)
    offsets = header + adj.indptr.astype(np.uint64) * np.uint64(vid_bytes)
    with open(path, "wb") as f:
        np.array([version, n, m], dtype=np.uint64).tofile(f)
        offsets.astype(np.uint64).tofile(f)
        adj.indices.astype(np.uint32 if vid32 else np.uint64, copy=False).tofile(f)
        vweights.astype(np.int32 if vw32 else np.int64, copy=False).tofile(f)
        eweights.astype(np.int32 if ew32 else np.int64, copy=False).tofile(f)


def kaminpar_cut(
    adj: sp.csr_matrix,
    k: int,
    *,
    vweights: np.ndarray | None = None,
    use_edge_weights: bool,
    seed: int = 0,
    threads: int = 1,
    epsilon: float = KAMINPAR_EPSILON,
    preset: str = "default",
) -> tuple[np.ndarray, int]:
    """K-way KaMinPar partition of a symmetric graph (the counterpart of
    :func:`betty.partition.metis_cut.metis_cut`).

    Args:
        adj: ``(n, n)`` symmetric CSR, zero diagonal, positive integer entries (the
            edge weights when ``use_edge_weights``).
        k: number of parts, ``2 <= k <= n``.
        vweights: ``(n,)`` positive integer vertex weights to balance (``None``: all 1).
        use_edge_weights: use ``adj.data`` as edge weights; otherwise every edge weighs 1.
        seed: KaMinPar's random seed.
        threads: KaMinPar's threads, ``>= 1`` (only 1 is reproducible).
        epsilon: allowed imbalance (see the module docstring).
        preset: a KaMinPar context name (``kaminpar.context_names()``).

    Returns:
        ``(groups (n,) int64, edge cut of the graph as given)``. Parts may be empty;
        the caller repairs them.

    Raises:
        ImportError: ``kaminpar`` is not installed (``pip install 'betty[kaminpar]'``).
        ValueError: ``threads < 1``, a vertex-weight shape mismatch or an unknown preset.
    """
    try:
        import kaminpar
    except ImportError as err:
        raise ImportError("partition.partitioner: kaminpar needs the kaminpar package "
                          "(pip install 'betty[kaminpar]')") from err
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    n = adj.shape[0]
    vw = (np.ones(n, dtype=np.int64) if vweights is None
          else np.asarray(vweights, dtype=np.int64))
    if vw.shape != (n,):
        raise ValueError(f"vweights must have shape ({n},), got {vw.shape}")
    if use_edge_weights:
        ew = np.asarray(adj.data, dtype=np.int64)
    else:
        ew = np.ones(adj.nnz, dtype=np.int64)
    if preset not in kaminpar.context_names():
        raise ValueError(f"unknown KaMinPar preset {preset!r}; allowed: "
                         f"{sorted(kaminpar.context_names())}")
    folder = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    fd, path = tempfile.mkstemp(suffix=".parhip", prefix="betty-kaminpar-", dir=folder)
    os.close(fd)
    try:
        write_parhip(path, sp.csr_matrix(adj), vw, ew)
        graph = kaminpar.load_graph(path, kaminpar.GraphFileFormat.PARHIP)
    finally:
        os.unlink(path)
    kaminpar.reseed(c_int_seed(seed))
    solver = kaminpar.KaMinPar(int(threads), kaminpar.context_by_name(preset))
    part = solver.compute_partition(graph, int(k), float(epsilon))
    groups = np.asarray(part, dtype=np.int64)
    if groups.shape != (n,):
        raise RuntimeError(f"KaMinPar returned {groups.shape} assignments for {n} vertices")
    return groups, int(kaminpar.edge_cut(graph, part))
