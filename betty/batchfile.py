"""A sampled batch as an ``.npz`` file (what ``betty partition --save`` writes and the
workflow's sample stage logs as ``batch.npz``), read back exactly by :func:`load_batch`.

The arrays (all ``int64``; ``l = 0`` is the input layer, as in
:class:`betty.batch.SampledBatch`):

* ``outputs`` ``(n_out,)``: global IDs of the output nodes;
* ``block{l}_src``, ``block{l}_dst`` ``(E_l,)``: global IDs of each sampled edge's source
  and destination, in the batch's canonical edge order;
* ``block{l}_src_nid`` ``(n_src_l,)``: the block's source nodes in local order
  (destinations first) and ``block{l}_eid`` ``(E_l,)``: raw-graph edge IDs. With these
  the batch is rebuilt exactly by :func:`load_batch`;
* ``block{l}_src_out_degree`` ``(n_src_l,)`` (when the sampler recorded it): each
  source's out-degree in the whole graph (the symmetric GCN's normalisation);
* ``fanouts`` ``(L,)``;
* ``groups`` ``(n_out,)`` (optional): micro-batch of each output node.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

__all__ = ["batch_arrays", "save_batch", "load_batch"]


def batch_arrays(batch, groups: torch.Tensor | None = None) -> dict[str, np.ndarray]:
    """The arrays of ``batch.npz`` (see the module docstring)."""
    arrays = {"outputs": batch.output_nid.numpy().astype(np.int64),
              "fanouts": np.asarray(batch.fanouts, dtype=np.int64)}
    for l, layer in enumerate(batch.layers):
        arrays[f"block{l}_src"] = layer.src_nid[layer.edge_src].numpy().astype(np.int64)
        arrays[f"block{l}_dst"] = layer.src_nid[layer.edge_dst].numpy().astype(np.int64)
        arrays[f"block{l}_src_nid"] = layer.src_nid.numpy().astype(np.int64)
        arrays[f"block{l}_eid"] = layer.edge_id.numpy().astype(np.int64)
        if layer.src_out_degree is not None:
            arrays[f"block{l}_src_out_degree"] = layer.src_out_degree.numpy().astype(np.int64)
    if groups is not None:
        arrays["groups"] = torch.as_tensor(groups).numpy().astype(np.int64)
    return arrays


def save_batch(path: str | Path, batch, groups: torch.Tensor | None = None) -> Path:
    """Write ``batch`` (and optionally its ``groups``) to ``path`` (``.npz`` added when it
    lacks that suffix, as NumPy does), through a temporary file moved into place: a
    reader never sees half a file. Returns the path written."""
    path = Path(path)
    if path.suffix != ".npz":
        path = path.with_name(path.name + ".npz")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
    try:
        np.savez_compressed(tmp, **batch_arrays(batch, groups))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _local(global_ids: torch.Tensor, nid: torch.Tensor, what: str) -> torch.Tensor:
    """Positions of ``global_ids`` in ``nid`` (distinct IDs), vectorized."""
    order = torch.argsort(nid)
    sorted_nid = nid[order]
    pos = torch.searchsorted(sorted_nid, global_ids).clamp(max=max(nid.numel() - 1, 0))
    if global_ids.numel() and not torch.equal(sorted_nid[pos], global_ids):
        raise ValueError(f"batch file is inconsistent: an edge {what} is not among the block's nodes")
    return order[pos]


def load_batch(path: str | Path):
    """``(SampledBatch, groups or None)`` from a file written by :func:`save_batch`."""
    from betty.batch import LayerEdges, SampledBatch

    with np.load(path) as z:
        arrays = {k: torch.from_numpy(z[k].astype(np.int64)) for k in z.files}
    n_layers = sum(1 for k in arrays if k.endswith("_src_nid"))
    if n_layers == 0:
        raise ValueError(f"{path} has no block*_src_nid arrays; was it written by betty.batchfile.save_batch?")
    layers = []
    for l in range(n_layers):
        src_nid = arrays[f"block{l}_src_nid"]
        num_dst = (arrays[f"block{l + 1}_src_nid"].numel() if l + 1 < n_layers
                   else arrays["outputs"].numel())
        layers.append(LayerEdges(
            src_nid=src_nid, num_dst=num_dst,
            edge_src=_local(arrays[f"block{l}_src"], src_nid, "source"),
            edge_dst=_local(arrays[f"block{l}_dst"], src_nid[:num_dst], "destination"),
            edge_id=arrays[f"block{l}_eid"],
            src_out_degree=arrays.get(f"block{l}_src_out_degree")))
    batch = SampledBatch(layers=layers, fanouts=arrays.get("fanouts", torch.zeros(0)).tolist())
    return batch, arrays.get("groups")
