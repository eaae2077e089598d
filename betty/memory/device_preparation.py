"""Device memory that preparation on the device keeps beside a micro-batch's step.

With the sampler, carving and the feature gather on the training device
(:class:`betty.engine.Trainer` ``sample_device`` on CUDA), three things live there while
micro-batch ``i`` trains, besides what its step allocates (:mod:`betty.memory.replay`):

* the **store** ``S``: the graph's in-CSR and out-degrees, the features and the labels,
  copied to the device once (:func:`store_bytes`);
* the **batch** ``B``: the full sampled batch's blocks and the
  :class:`~betty.microbatch.Carver` built over them (:func:`batch_bytes`), kept until
  the batch's last micro-batch has run;
* the **carved micro-batch** ``C_i``: micro-batch ``i``'s own tensors, carved before its step
  and freed after it (:func:`carved_bytes`). The step copies the index tensors it
  uses, as on the host path, so these stay beside the step's own.

Each micro-batch's peak is then its step's peak plus ``S + B + C_i``: the estimate's
``device_store`` (``S + B``, the same for every K) and ``carved`` components. Every
tensor is rounded up to the allocator's granule (CUDA: 512 bytes), as
``torch.cuda.memory_allocated`` counts it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from betty.batch import SampledBatch
from betty.memory.sizes import MicroBatchSizes
from betty.microbatch import Carver

__all__ = ["store_bytes", "batch_bytes", "fixed_bytes", "carved_bytes", "tensor_bytes"]


def _rounded(nbytes, granule: int):
    return -(-nbytes // granule) * granule


def tensor_bytes(tensors: Iterable[torch.Tensor | None], granule: int = 1) -> int:
    """Bytes of the distinct storages of ``tensors`` (``None`` skipped), each rounded up
    to ``granule``."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += _rounded(storage.nbytes(), granule)
    return total


def store_bytes(graph, feat: torch.Tensor, label: torch.Tensor, granule: int = 1) -> int:
    """``S``: the in-CSR (pointer, indices, edge IDs where stored), the out-degrees, the
    features and the labels as copied to a device (the host tensors' sizes)."""
    indptr, indices, eid = graph.in_csr
    out_degrees = graph.out_degrees()
    return tensor_bytes((indptr, indices, eid, out_degrees, feat, label), granule)


def batch_bytes(batch: SampledBatch, granule: int = 1) -> int:
    """``B``: the blocks of ``batch`` (on the device, as sampled there) and a
    :class:`~betty.microbatch.Carver` over them (:meth:`~betty.microbatch.Carver.state_bytes`)."""
    blocks = [t for layer in batch.layers for t in (layer.src_nid, layer.edge_src, layer.edge_dst,
                                                     layer.edge_id, layer.src_out_degree)]
    return tensor_bytes(blocks, granule) + Carver.state_bytes(batch, granule)


def fixed_bytes(batch: SampledBatch, store: int, granule: int = 1) -> int:
    """``S + B``: what stays on the device through every micro-batch of ``batch``, whatever K
    (``store``: :func:`store_bytes`)."""
    return int(store) + batch_bytes(batch, granule)


def carved_bytes(sizes: MicroBatchSizes, out_degrees: bool, granule: int = 1) -> np.ndarray:
    """``C_i`` per micro-batch ``(P,)``: per layer with ``n`` sources and ``E`` edges,
    ``src_nid`` and ``full_src_index`` (``8 n`` each), ``edge_src``, ``edge_dst`` and
    ``edge_id`` (``8 E`` each) and, where the batch records them (``out_degrees``),
    ``src_out_degree`` (``8 n``); and the micro-batch's ``output_index`` (8 bytes an output)."""
    total = _rounded(8 * sizes.num_outputs.astype(np.int64), granule)
    per_source = 3 if out_degrees else 2
    for n_src, n_edges in zip(sizes.n_src, sizes.num_edges):
        total = total + per_source * _rounded(8 * n_src.astype(np.int64), granule)
        total = total + 3 * _rounded(8 * n_edges.astype(np.int64), granule)
    return total.astype(np.float64)
