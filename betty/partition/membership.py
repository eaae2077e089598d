"""Which sources each micro-batch of a split needs, computed without carving any block.

Micro-batch membership is propagated down the layers with sparse products, micro-batch by micro-batch.
With ``G`` ``(K, n_out)`` the micro-batch matrix (``G[k, j] = 1`` iff output ``j`` is in micro-batch
``k``) and ``N_l`` ``(n_dst[l], n_src[l])`` the sources each destination needs
(:func:`betty.partition.incidence.needed_sources`, the transpose of ``A_l``),

    M_{L-1} = bool(G @ N_{L-1}),   M_l = bool(M_{l+1} @ N_l)      (shape (K, n_src[l])),

``M_l[k, s] = 1`` iff source ``s`` of layer ``l`` belongs to micro-batch ``k`` at
that layer (exactly the sources :func:`betty.microbatch.carve` keeps); row ``k`` of
``M_l`` is micro-batch ``k``'s layer-``l`` source set, and ``M_l``'s columns below ``n_dst[l-1]``
are layer ``l - 1``'s destinations. The memory model's micro-batch sizes
(:func:`betty.memory.sizes.split_sizes`) are read off these matrices. Cost: one product
per layer, O(edges × micro-batches per node), no per-micro-batch loop and no transpose.
"""

from __future__ import annotations

import hashlib

import numpy as np
import scipy.sparse as sp
import torch

from betty.batch import SampledBatch
from betty.microbatch import validate_groups
from betty.partition.incidence import batch_needed_sources
from betty.workers import parallel_map, prep_workers

__all__ = ["micro_batch_membership", "split_digest"]


def split_digest(groups: torch.Tensor) -> str:
    """A 32-hex-digit digest of a split's ``(n_out,)`` micro-batch indices: with ``k``, the key
    under which a batch keeps what it derives from that split
    (:meth:`betty.batch.SampledBatch.derived`)."""
    values = np.ascontiguousarray(torch.as_tensor(groups).numpy(), dtype=np.int64)
    return hashlib.blake2b(values.tobytes(), digest_size=16).hexdigest()


def micro_batch_membership(batch: SampledBatch, groups, k: int) -> list[sp.csr_matrix]:
    """Per layer ``l``, ``M_l`` ``(k, n_src[l])`` 0/1 CSR: row ``p`` marks the layer-``l``
    sources of micro-batch ``p`` (see the module docstring; column indices unsorted).

    Kept on the batch for the latest split (:meth:`betty.batch.SampledBatch.derived`,
    keyed by a digest of ``groups``), so the memory estimate and :func:`split_metrics`
    of one split build it once."""
    groups = validate_groups(groups, batch.num_outputs, k)

    def compute() -> list[sp.csr_matrix]:
        n_out = batch.num_outputs
        member = sp.csr_matrix(
            (np.ones(n_out, dtype=np.int32), (groups.numpy(), np.arange(n_out))), shape=(k, n_out)
        )
        out: list[sp.csr_matrix | None] = [None] * batch.num_layers
        for l in reversed(range(batch.num_layers)):
            member = _rows_times(member, batch_needed_sources(batch, l))
            member.data[:] = 1  # a product of 0/1 matrices has no explicit zeros
            out[l] = member
        return out  # type: ignore[return-value]

    return batch.derived(("micro_batch_membership", k, split_digest(groups)), compute, slot="micro_batch_membership")


def _rows_times(member: sp.csr_matrix, needed: sp.csr_matrix) -> sp.csr_matrix:
    """``member @ needed``, one block of ``member``'s rows (micro-batches) per preparation
    thread (:func:`betty.workers.parallel_map`). A CSR product computes each row on
    its own, so the stacked blocks are the one-thread product entry for entry, in the
    same order."""
    k = member.shape[0]
    workers = min(prep_workers(), k)
    if workers <= 1:
        return member @ needed
    bounds = np.linspace(0, k, workers + 1).round().astype(int)
    blocks = parallel_map(lambda ab: member[ab[0]:ab[1]] @ needed, list(zip(bounds[:-1], bounds[1:])))
    return sp.vstack(blocks, format="csr")
