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
import zipfile
import zlib
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


def _read_arrays(path: str | Path) -> dict[str, torch.Tensor]:
    """The file's arrays as int64 tensors, after checking it is an ``.npz`` of integer arrays."""
    unreadable = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)
    try:
        data = np.load(path, allow_pickle=False)
    except unreadable as err:
        raise ValueError(f"{path} is not a readable batch file (.npz) written by "
                         f"betty.batchfile.save_batch: {err}") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ValueError(f"{path} is a single .npy array, not a batch file (.npz) written by "
                         "betty.batchfile.save_batch")
    with data as z:
        try:
            arrays = {k: z[k] for k in z.files}
        except unreadable as err:  # a damaged member of the archive
            raise ValueError(f"{path} is damaged: {err}") from None
    wrong = sorted(k for k, a in arrays.items() if not np.issubdtype(a.dtype, np.integer) or a.ndim != 1)
    if wrong:
        raise ValueError(f"{path}: arrays {wrong} are not 1-D integer arrays; a batch file holds node "
                         "and edge IDs only")
    return {k: torch.from_numpy(a.astype(np.int64)) for k, a in arrays.items()}


def _check_batch_file(arrays: dict[str, torch.Tensor], n_layers: int, path) -> None:
    """The file's arrays describe one batch: every array a layer needs, of matching
    lengths, distinct source IDs, each block's destinations the next block's sources (the
    last's the outputs), and ``groups`` one per output."""
    def bad(why: str) -> ValueError:
        return ValueError(f"{path} is damaged or not a betty batch file: {why}")

    missing = [key for l in range(n_layers) for key in (f"block{l}_src", f"block{l}_dst", f"block{l}_eid")
               if key not in arrays] + (["outputs"] if "outputs" not in arrays else [])
    if missing:
        raise bad(f"arrays {missing} are missing")
    for l in range(n_layers):
        src_nid, n_edges = arrays[f"block{l}_src_nid"], arrays[f"block{l}_src"].numel()
        if torch.unique(src_nid).numel() != src_nid.numel():
            raise bad(f"block {l} lists a source node twice")
        if arrays[f"block{l}_dst"].numel() != n_edges or arrays[f"block{l}_eid"].numel() != n_edges:
            raise bad(f"block {l} has {n_edges} edge sources but {arrays[f'block{l}_dst'].numel()} "
                      f"destinations and {arrays[f'block{l}_eid'].numel()} edge IDs")
        degree = arrays.get(f"block{l}_src_out_degree")
        if degree is not None and degree.numel() != src_nid.numel():
            raise bad(f"block {l} has {src_nid.numel()} sources but {degree.numel()} out-degrees")
        dst = arrays[f"block{l + 1}_src_nid"] if l + 1 < n_layers else arrays["outputs"]
        if not torch.equal(src_nid[: dst.numel()], dst):
            what = f"block {l + 1}'s sources" if l + 1 < n_layers else "the outputs"
            raise bad(f"block {l}'s destinations (its first sources) are not {what}")
    groups = arrays.get("groups")
    if groups is not None and groups.numel() != arrays["outputs"].numel():
        raise bad(f"{groups.numel()} groups for {arrays['outputs'].numel()} outputs")


def load_batch(path: str | Path):
    """``(SampledBatch, groups or None)`` from a file written by :func:`save_batch`.

    Raises:
        ValueError: naming the file, when it is not an ``.npz`` of integer arrays or its
            arrays do not describe one batch (a missing array, mismatched lengths, a
            repeated source, blocks that do not chain, groups not one per output).
    """
    from betty.batch import LayerEdges, SampledBatch

    arrays = _read_arrays(path)
    n_layers = sum(1 for k in arrays if k.endswith("_src_nid"))
    if n_layers == 0 or any(f"block{l}_src_nid" not in arrays for l in range(n_layers)):
        raise ValueError(f"{path} has no block0_src_nid ... block{{L-1}}_src_nid arrays; was it written "
                         "by betty.batchfile.save_batch?")
    _check_batch_file(arrays, n_layers, path)
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
