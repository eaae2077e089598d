"""A dataset split into DistDGL partitions, one per machine, and the layout that reads it.

:func:`write_partitions` runs ``dgl.distributed.partition_graph`` on a loaded
:class:`~betty.data.GraphDataset` and writes, in one folder::

    FOLDER/
      betty.json            betty's own record (LAYOUT_FORMAT, the dataset's shape, the
                            partitioning, the DGL version); written last
      graph.json            DGL's partition configuration (``graph_name = "graph"``)
      part<i>/              DGL's partition i: its nodes' features and labels, its graph
      new_of_orig.npy       (N,) int64: the partitions' node ID of each original node
      orig_of_new.npy       (N,) int64: the original node ID of each partition node ID
      train_idx.npy, valid_idx.npy, test_idx.npy   the split, original IDs

DGL renumbers the nodes so that each partition holds one contiguous range (its
``node_map``) and puts each edge in its destination's partition, renumbered likewise; it
keeps no original IDs. betty keeps them: the two node maps above (memory-mapped by the
trainers), and each edge's original ID as the edge data ``betty_eid``, held by the
server of its partition. With them a trainer samples in original IDs and draws exactly
what one process with the whole graph draws (:mod:`betty.backends.distdgl.store`).

Every machine needs the folder (the servers read their partition from it, the trainers
its maps and split): put it on shared storage or copy it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from betty.owner import Owner, reclaim_stale_folders

__all__ = ["LAYOUT_FORMAT", "GRAPH_NAME", "PartitionLayout", "write_partitions", "read_layout",
           "ensure_partitions", "PARTITION_METHODS"]

LAYOUT_FORMAT = 1
GRAPH_NAME = "graph"
PARTITION_METHODS = ("metis", "random")
_META = "betty.json"
_SPLITS = ("train_idx", "valid_idx", "test_idx")


@dataclass(frozen=True)
class PartitionLayout:
    """What :func:`write_partitions` wrote (read back by :func:`read_layout`).

    Attributes:
        folder: the partition folder.
        num_parts: partitions (one graph server and one machine each).
        dataset: the dataset's name as loaded.
        num_nodes, num_edges, num_features, num_classes, multilabel: its shape.
        feat_dtype, label_dtype: the stored dtypes (names, e.g. ``"float32"``).
        method: DGL's partitioning method (``metis`` or ``random``).
        is_ogb, ogb_name: the dataset's OGB evaluator, as for a loaded dataset.
    """

    folder: Path
    num_parts: int
    dataset: str
    num_nodes: int
    num_edges: int
    num_features: int
    num_classes: int
    multilabel: bool
    feat_dtype: str
    label_dtype: str
    method: str
    is_ogb: bool = False
    ogb_name: str | None = None

    @property
    def config(self) -> Path:
        """DGL's partition configuration file (``DGL_CONF_PATH``)."""
        return self.folder / f"{GRAPH_NAME}.json"

    def node_maps(self) -> tuple[np.ndarray, np.ndarray]:
        """``(new_of_orig, orig_of_new)``, each ``(N,)`` int64, memory-mapped read-only."""
        return (np.load(self.folder / "new_of_orig.npy", mmap_mode="r"),
                np.load(self.folder / "orig_of_new.npy", mmap_mode="r"))

    def split(self, name: str) -> torch.Tensor:
        """``(n,)`` int64 original node IDs of split ``name`` (``train_idx``, ...)."""
        if name not in _SPLITS:
            raise ValueError(f"split must be one of {', '.join(_SPLITS)}, got {name!r}")
        return torch.from_numpy(np.load(self.folder / f"{name}.npy"))


def write_partitions(dataset, folder: str | Path, num_parts: int, *, method: str = "metis") -> PartitionLayout:
    """Partition ``dataset`` for ``num_parts`` machines into ``folder`` (see the module
    docstring for what is written).

    Args:
        dataset: a :class:`~betty.data.GraphDataset` (the whole graph, in memory).
        folder: where to write; must not exist or be empty.
        num_parts: >= 1 partitions.
        method: ``metis`` (DGL's METIS, fewer edges across partitions) or ``random``.

    Raises:
        ValueError: a bad ``num_parts`` or ``method``, or a non-empty ``folder``.
    """
    import dgl

    if isinstance(num_parts, bool) or not isinstance(num_parts, int) or num_parts < 1:
        raise ValueError(f"num_parts must be an integer >= 1, got {num_parts!r}")
    if method not in PARTITION_METHODS:
        raise ValueError(f"method must be one of {', '.join(PARTITION_METHODS)}, got {method!r}")
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise ValueError(f"{folder} is not empty: partitions are written into a new folder")
    folder.mkdir(parents=True, exist_ok=True)
    g = dgl.graph(dataset.graph.edges(), num_nodes=dataset.num_nodes, idtype=torch.int64)
    g.ndata["feat"] = dataset.feat
    g.ndata["label"] = dataset.label
    g.edata["betty_eid"] = torch.arange(g.num_edges(), dtype=torch.int64)
    orig_of_new, _ = dgl.distributed.partition_graph(
        g, GRAPH_NAME, num_parts, str(folder), part_method=method, balance_edges=True,
        return_mapping=True)
    orig_of_new = orig_of_new.numpy().astype(np.int64, copy=False)
    new_of_orig = np.empty_like(orig_of_new)
    new_of_orig[orig_of_new] = np.arange(orig_of_new.size, dtype=np.int64)
    np.save(folder / "orig_of_new.npy", orig_of_new)
    np.save(folder / "new_of_orig.npy", new_of_orig)
    for name in _SPLITS:
        np.save(folder / f"{name}.npy", getattr(dataset, name).numpy().astype(np.int64, copy=False))
    meta = {"format": LAYOUT_FORMAT, "num_parts": num_parts, "dataset": dataset.name,
            "num_nodes": dataset.num_nodes, "num_edges": dataset.num_edges,
            "num_features": dataset.num_features, "num_classes": int(dataset.num_classes),
            "multilabel": bool(dataset.multilabel), "feat_dtype": str(dataset.feat.dtype).removeprefix("torch."),
            "label_dtype": str(dataset.label.dtype).removeprefix("torch."), "method": method,
            "is_ogb": bool(dataset.is_ogb), "ogb_name": dataset.ogb_name, "dgl_version": dgl.__version__}
    tmp = folder / (_META + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1), encoding="utf-8")
    os.replace(tmp, folder / _META)  # last: a folder without it is incomplete
    return read_layout(folder)


def read_layout(folder: str | Path) -> PartitionLayout:
    """The :class:`PartitionLayout` of a folder :func:`write_partitions` completed.

    Raises:
        FileNotFoundError: no such folder, or it lacks ``betty.json`` (not written by
            betty, or the write did not finish).
        ValueError: another layout format.
    """
    folder = Path(folder)
    path = folder / _META
    if not path.is_file():
        raise FileNotFoundError(f"{folder} holds no complete betty partitioning ({_META} missing): "
                                "write it with betty.backends.distdgl.write_partitions")
    meta = json.loads(path.read_text(encoding="utf-8"))
    if meta.get("format") != LAYOUT_FORMAT:
        raise ValueError(f"{path}: layout format {meta.get('format')!r}, this betty reads {LAYOUT_FORMAT}")
    return PartitionLayout(folder=folder, num_parts=int(meta["num_parts"]), dataset=meta["dataset"],
                           num_nodes=int(meta["num_nodes"]), num_edges=int(meta["num_edges"]),
                           num_features=int(meta["num_features"]), num_classes=int(meta["num_classes"]),
                           multilabel=bool(meta["multilabel"]), feat_dtype=meta["feat_dtype"],
                           label_dtype=meta["label_dtype"], method=meta["method"],
                           is_ogb=bool(meta["is_ogb"]), ogb_name=meta["ogb_name"])


def ensure_partitions(load: Callable[[], object], folder: str | Path, num_parts: int, *,
                      method: str = "metis", write: bool = True, dataset: str | None = None,
                      timeout_s: float = 600.0) -> PartitionLayout:
    """The partitioning at ``folder``, written first where it is missing.

    A complete partitioning there is checked and read. Otherwise, with ``write`` (one
    machine, node 0, writes) the dataset ``load()`` returns is partitioned into a new
    sibling folder that is then renamed to ``folder``, so that nobody reads a partial
    one; without ``write`` this waits up to ``timeout_s`` for the writer (on one host
    or shared storage) to finish.

    Raises:
        ValueError: ``folder`` holds a partitioning into another number of parts, or of
            another dataset than ``dataset`` (its name, when given).
        TimeoutError: no complete partitioning appeared within ``timeout_s``.
    """
    folder = Path(folder)
    if not (folder / _META).is_file():
        if write:
            folder.parent.mkdir(parents=True, exist_ok=True)
            reclaim_stale_folders(str(folder.parent), this_boot_only=True)  # killed writers' staging
            staging = Path(tempfile.mkdtemp(prefix=Owner.current().prefix(folder.name), dir=folder.parent))
            try:
                write_partitions(load(), staging / "parts", num_parts, method=method)
                os.replace(staging / "parts", folder)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        else:
            deadline = time.monotonic() + timeout_s
            while not (folder / _META).is_file():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no complete partitioning appeared at {folder} within "
                                       f"{timeout_s:.0f} s: node 0 writes it; on machines without "
                                       "shared storage, copy node 0's folder there")
                time.sleep(0.5)
    layout = read_layout(folder)
    if layout.num_parts != num_parts:
        raise ValueError(f"{folder} holds {layout.num_parts} partitions; this run has {num_parts} "
                         "machines: use another folder, or remove it to partition again")
    if dataset is not None and layout.dataset != dataset:
        raise ValueError(f"{folder} holds a partitioning of {layout.dataset!r}, not of {dataset!r}")
    return layout
