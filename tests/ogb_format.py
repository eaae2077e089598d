"""Write a homogeneous node-property dataset in OGB's on-disk layout.

This is the layout OGB's dataset classes and ``ogb.io.read_graph_raw`` read (see
:mod:`betty.data.ogb_loader`), so a graph written here is loaded by OGB's own reader.
A test helper: the OGB tests write small graphs with it and load them offline.

CSV layout (gzip, no header, one row per item)::

    <folder>/RELEASE_v<version>.txt
    <folder>/raw/edge.csv.gz            E rows "src,dst"
    <folder>/raw/num-node-list.csv.gz   "N"
    <folder>/raw/num-edge-list.csv.gz   "E"
    <folder>/raw/node-feat.csv.gz       N rows of F values        (optional)
    <folder>/raw/edge-feat.csv.gz       E rows of D values        (optional)
    <folder>/raw/node-label.csv.gz      N rows of T values (NaN = no label)
    <folder>/raw/<name>.csv.gz          extra node files, N rows  (e.g. node_year)
    <folder>/split/<split>/{train,valid,test}.csv.gz   one node ID per row

Binary layout (``binary=True``, as ogbn-papers100M): ``raw/data.npz`` with
``edge_index (2, E)``, ``num_nodes_list``, ``num_edges_list``, ``node_feat`` and the extra
node arrays, plus ``raw/node-label.npz`` with ``node_label``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

__all__ = ["write_ogb_node_dataset"]


def _csv(path: Path, array: np.ndarray) -> None:
    frame = pd.DataFrame(np.asarray(array).reshape(len(array), -1))
    frame.to_csv(path, header=False, index=False, compression="gzip")


def write_ogb_node_dataset(
    folder: str | Path,
    *,
    edge_index: np.ndarray,
    num_nodes: int,
    node_label: np.ndarray,
    split: dict[str, np.ndarray],
    split_name: str,
    node_feat: np.ndarray | None = None,
    edge_feat: np.ndarray | None = None,
    extra_node_files: dict[str, np.ndarray] | None = None,
    binary: bool = False,
    version: int = 1,
) -> Path:
    """Write one graph in OGB's raw layout under ``folder``.

    Args:
        folder: dataset folder (``<root>/ogbn_<name>`` for an OGB name).
        edge_index: ``(2, E)`` integer ``[src; dst]`` as stored by OGB (one direction
            for datasets OGB marks ``add_inverse_edge``).
        num_nodes: N.
        node_label: ``(N, T)`` labels (float with NaN allowed).
        split: ``{"train", "valid", "test"}`` -> node IDs.
        split_name: the split folder name (OGB's ``split`` meta entry, e.g. ``time``).
        node_feat: ``(N, F)`` features or ``None``.
        edge_feat: ``(E, D)`` edge features or ``None`` (CSV layout only).
        extra_node_files: name (``node_year``, ``node_species``) -> ``(N, k)`` array.
        binary: write the npz layout instead of CSV.
        version: written as ``RELEASE_v<version>.txt``.

    Returns:
        ``folder`` as a ``Path``.
    """
    folder = Path(folder)
    raw = folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    edge_index = np.asarray(edge_index, dtype=np.int64)
    extra = extra_node_files or {}
    label = np.asarray(node_label).reshape(num_nodes, -1)
    if binary:
        if edge_feat is not None:
            raise ValueError("edge_feat is only supported in the CSV layout (binary=False)")
        arrays = {
            "edge_index": edge_index,
            "num_nodes_list": np.array([num_nodes], dtype=np.int64),
            "num_edges_list": np.array([edge_index.shape[1]], dtype=np.int64),
            **{k: np.asarray(v).reshape(num_nodes, -1) for k, v in extra.items()},
        }
        if node_feat is not None:
            arrays["node_feat"] = np.asarray(node_feat)
        np.savez_compressed(raw / "data.npz", **arrays)
        np.savez_compressed(raw / "node-label.npz", node_label=label)
    else:
        _csv(raw / "edge.csv.gz", edge_index.T)
        _csv(raw / "num-node-list.csv.gz", np.array([num_nodes]))
        _csv(raw / "num-edge-list.csv.gz", np.array([edge_index.shape[1]]))
        _csv(raw / "node-label.csv.gz", label)
        if node_feat is not None:
            _csv(raw / "node-feat.csv.gz", np.asarray(node_feat))
        if edge_feat is not None:
            _csv(raw / "edge-feat.csv.gz", np.asarray(edge_feat))
        for name, values in extra.items():
            _csv(raw / f"{name}.csv.gz", np.asarray(values).reshape(num_nodes, -1))
    split_dir = folder / "split" / split_name
    split_dir.mkdir(parents=True, exist_ok=True)
    for part in ("train", "valid", "test"):
        _csv(split_dir / f"{part}.csv.gz", np.asarray(split[part], dtype=np.int64))
    (folder / f"RELEASE_v{version}.txt").write_text(f"OGB-layout dataset, version {version}\n")
    return folder
