"""OGB node-property datasets read from OGB's raw files with ``ogb``'s own readers, offline,
without DGL or PyG.

OGB's dataset classes download a missing dataset, ask ``input()`` first when the
download is large or when the folder lacks its ``RELEASE_v<version>.txt``, and cache a
processed file (``torch.load``-ed on later runs). Here nothing may block and no
framework is needed: :func:`check_ogb_files` verifies the on-disk layout first and raises
:class:`DatasetNotFoundError` naming every missing path and where it must go; then
``ogb.io.read_graph_raw``'s ``read_csv_graph_raw`` / ``read_binary_graph_raw`` (the
functions OGB's classes call) read the raw graph, and the labels and split are read from
the same files OGB's classes read. The graph is the one OGB's DGL and PyG classes build
(same edge list and order, inverse edges appended where OGB's meta says
``add_inverse_edge``); betty caches its own processed dataset.

Layout OGB reads, under ``<root>/<dir>`` with ``<dir>`` = the name with ``-`` -> ``_``
(``ogbn_products``; OGB prefers ``<dir>_dgl`` when that folder exists)::

    RELEASE_v<version>.txt
    raw/edge.csv.gz, num-node-list.csv.gz, num-edge-list.csv.gz, node-label.csv.gz,
        node-feat.csv.gz (when the dataset has node features), edge-feat.csv.gz (proteins),
        <additional node files>.csv.gz          (csv datasets)
    raw/data.npz, raw/node-label.npz           (binary datasets: papers100M)
    split/<split type>/{train,valid,test}.csv.gz   (or split_dict.pt)

Processing after OGB's reader (the *recipe* of each dataset):

* every dataset: self-loops removed (as Betty does for products), bare int64 graph;
* ``ogbn-arxiv``, ``ogbn-papers100M`` (directed citation graphs): made bidirected,
  ``E' = {(u,v)} ∪ {(v,u)}`` without duplicates;
* ``ogbn-proteins``: OGB ships no node features; ``feat[v] = mean_{(u→v)∈E} efeat[u→v]``
  over the (E, 8) edge features (zeros for a node without in-edges), computed before
  self-loops are dropped; labels ``(N, 112)`` as float32 0/1, ``multilabel=True``;
* ``ogbn-papers100M``: labels are float with NaN for unlabeled nodes; they become int64
  with ``-1`` for NaN, and every train/valid/test node must be labelled.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from betty.data.cache import files_fingerprint
from betty.data.graph_build import bare_graph, canonical_edges
from betty.data.names import OGB_NAMES, DatasetNotFoundError
from betty.data.types import GraphDataset

__all__ = [
    "OGB_RECIPES",
    "OgbRecipe",
    "DatasetNotFoundError",
    "ogb_meta",
    "ogb_dataset_dir",
    "check_ogb_files",
    "ogb_source_fingerprint",
    "load_ogb",
    "load_split_dict",
]


@dataclass(frozen=True)
class OgbRecipe:
    """How a raw OGB dataset becomes a :class:`GraphDataset`.

    Attributes:
        to_bidirected: store both directions of every edge, without duplicates.
        feat_from_edges: node features = mean of in-edge features (no node features).
        multilabel: labels are ``(N, T)`` binary targets.
    """

    to_bidirected: bool = False
    feat_from_edges: bool = False
    multilabel: bool = False


OGB_RECIPES: dict[str, OgbRecipe] = {
    "ogbn-products": OgbRecipe(),
    "ogbn-arxiv": OgbRecipe(to_bidirected=True),
    "ogbn-proteins": OgbRecipe(feat_from_edges=True, multilabel=True),
    "ogbn-papers100M": OgbRecipe(to_bidirected=True),
}
assert tuple(OGB_RECIPES) == OGB_NAMES, "betty.data.names.OGB_NAMES lists the recipes"


def ogb_meta(name: str) -> dict:
    """OGB's own meta information for ``name`` (its ``master.csv`` column)."""
    import ogb.nodeproppred
    import pandas as pd

    master = pd.read_csv(
        os.path.join(os.path.dirname(ogb.nodeproppred.__file__), "master.csv"),
        index_col=0,
        keep_default_na=False,
    )
    if name not in master:
        raise ValueError(f"{name!r} is not an OGB node-property dataset; known: {list(master)}")
    return dict(master[name])


def ogb_dataset_dir(name: str, root: str | Path, meta_dict: dict | None = None) -> Path:
    """The folder OGB's class reads for ``name`` under ``root`` (same rule as OGB)."""
    if meta_dict is not None:
        return Path(meta_dict["dir_path"])
    base = Path(root) / "_".join(name.split("-"))
    dgl_variant = base.with_name(base.name + "_dgl")
    return dgl_variant if dgl_variant.exists() else base


def _required_files(meta: dict) -> tuple[list[str], list[str]]:
    """(raw files needed when no processed file exists, split files) relative to the
    dataset folder."""
    if meta["binary"] == "True":
        raw = ["raw/data.npz", "raw/node-label.npz"]
    else:
        raw = [
            "raw/edge.csv.gz",
            "raw/num-node-list.csv.gz",
            "raw/num-edge-list.csv.gz",
            "raw/node-label.csv.gz",
        ]
        if meta.get("has_node_attr") == "True":
            raw.append("raw/node-feat.csv.gz")
        if meta.get("has_edge_attr") == "True":
            raw.append("raw/edge-feat.csv.gz")
        extra = meta.get("additional node files", "None")
        if extra != "None":
            raw += [f"raw/{f}.csv.gz" for f in extra.split(",")]
    split = [f"split/{meta['split']}/{part}.csv.gz" for part in ("train", "valid", "test")]
    return raw, split


def check_ogb_files(name: str, root: str | Path, meta_dict: dict | None = None) -> Path:
    """Verify everything OGB's class will read is on disk; return the dataset folder.

    Raises:
        DatasetNotFoundError: listing each missing path and where the download goes.
    """
    meta = meta_dict if meta_dict is not None else ogb_meta(name)
    folder = ogb_dataset_dir(name, root, meta_dict)
    missing: list[str] = []
    release = folder / f"RELEASE_v{meta['version']}.txt"
    if not release.is_file():
        missing.append(str(release))
    raw, _ = _required_files(meta)
    missing += [str(folder / f) for f in raw if not (folder / f).is_file()]
    _, split = _required_files(meta)
    split_dir = folder / "split" / str(meta["split"])
    if not (split_dir / "split_dict.pt").is_file():
        missing += [str(folder / f) for f in split if not (folder / f).is_file()]
    if missing:
        where = (
            f"Download {meta.get('url', 'the dataset zip')} on a machine with network "
            f"access, unzip it and move the extracted folder "
            f"'{meta.get('download_name', '?')}' to {folder} "
            "(it must contain RELEASE_v*.txt, raw/ and split/)."
        )
        raise DatasetNotFoundError(
            f"dataset {name!r} is not available offline under {Path(root)}: missing "
            + ", ".join(missing)
            + ". "
            + where
        )
    return folder


def ogb_source_fingerprint(name: str, root: str | Path, meta_dict: dict | None = None) -> list:
    """``[(relative path, size, mtime_ns)]`` of the release, raw and split files (not
    OGB's processed file, which OGB writes on first load), for the cache key."""
    folder = ogb_dataset_dir(name, root, meta_dict)
    if not folder.is_dir():
        return []
    out = []
    for sub in ("raw", "split"):
        out += files_fingerprint(sorted((folder / sub).rglob("*")) if (folder / sub).is_dir() else [], folder)
    out += [(p.name, 0, 0) for p in sorted(folder.glob("RELEASE_v*.txt"))]
    return out


def _read_with_ogb(name: str, root: Path, meta_dict: dict | None) -> tuple[dict, np.ndarray, dict, dict]:
    """``(graph, labels, split, meta)`` from the raw files, with ``ogb``'s raw readers.

    ``graph`` is OGB's dict (``edge_index (2, E)``, ``node_feat``, ``edge_feat``,
    ``num_nodes``), ``labels`` ``(N, T)``, ``split`` ``{"train", "valid", "test"}`` ->
    node IDs. Reads only local files (a missing one raises
    :class:`DatasetNotFoundError` via :func:`check_ogb_files`); nothing is downloaded.
    """
    import pandas as pd
    from ogb.io.read_graph_raw import read_binary_graph_raw, read_csv_graph_raw

    meta = meta_dict if meta_dict is not None else ogb_meta(name)
    folder = check_ogb_files(name, root, meta_dict)
    raw = folder / "raw"
    inverse = meta["add_inverse_edge"] == "True"
    extra = meta.get("additional node files", "None")
    extra_edge = meta.get("additional edge files", "None")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        if meta["binary"] == "True":
            graph = read_binary_graph_raw(str(raw), add_inverse_edge=inverse)[0]
            labels = np.load(raw / "node-label.npz")["node_label"]
        else:
            graph = read_csv_graph_raw(
                str(raw), add_inverse_edge=inverse,
                additional_node_files=[] if extra == "None" else extra.split(","),
                additional_edge_files=[] if extra_edge == "None" else extra_edge.split(","),
            )[0]
            labels = pd.read_csv(raw / "node-label.csv.gz", compression="gzip", header=None).values
    split_dir = folder / "split" / str(meta["split"])
    if (split_dir / "split_dict.pt").is_file():
        split = load_split_dict(split_dir / "split_dict.pt")
    else:
        split = {part: pd.read_csv(split_dir / f"{part}.csv.gz", compression="gzip",
                                   header=None).values.T[0]
                 for part in ("train", "valid", "test")}
    return graph, labels, split, meta


# What a pickled dict of numpy arrays refers to (numpy 1 and 2 spell the module
# differently; ``_codecs.encode`` turns the array's latin-1 text back into bytes).
_NUMPY_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
}


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays, dicts, lists and scalars and nothing else: any other
    global (a class or function a crafted file names to run code) is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) not in _NUMPY_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("tensor storages are loaded by torch.load(weights_only=True)")


def _numpy_split_dict(path: Path) -> dict:
    """A ``torch.save``-d dict of numpy arrays (no tensors) read with
    :class:`_NumpyOnlyUnpickler` from the file's ``data.pkl``."""
    with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        if len(names) != 1:
            raise pickle.UnpicklingError("not a torch.save zip archive with one data.pkl")
        with archive.open(names[0]) as fh:
            return _NumpyOnlyUnpickler(fh).load()


def load_split_dict(path: str | Path) -> dict[str, np.ndarray | torch.Tensor]:
    """OGB's ``split_dict.pt`` (papers100M ships one): ``{"train", "valid", "test"}`` ->
    integer node IDs, as tensors or numpy arrays, loaded without running any code from
    the file: ``torch.load(weights_only=True)`` for tensors, a numpy-only unpickler for
    numpy arrays (which torch's weights-only loader refuses).

    Raises:
        ValueError: the file holds anything else (objects, non-integer arrays, other keys).
    """
    path = Path(path)
    try:
        split = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError) as first:
        try:
            split = _numpy_split_dict(path)
        except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, ValueError, TypeError) as err:
            raise ValueError(f"{path}: not a split of tensors or numpy arrays; refusing to load it "
                             f"({str(err) or type(err).__name__}; torch: {str(first).strip().splitlines()[-1][:160]})"
                             ) from None
    _check_split(path, split)
    return split


def _check_split(path: Path, split) -> None:
    """``split`` is a dict of 1-D integer arrays or tensors under train/valid/test."""
    if not isinstance(split, dict) or not {"train", "valid", "test"} <= set(split):
        raise ValueError(f"{path}: expected a dict with keys 'train', 'valid', 'test'")
    for part in ("train", "valid", "test"):
        value = split[part]
        integer = (isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex()) or (
            isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.integer))
        if not integer or value.ndim != 1:
            raise ValueError(f"{path}: split {part!r} is not a 1-D array of integer node IDs")


def _node_features(graph: dict, recipe: OgbRecipe, name: str) -> torch.Tensor:
    """``(N, F)`` float32 features; for proteins the mean of in-edge features."""
    if recipe.feat_from_edges:
        if graph.get("edge_feat") is None:
            raise ValueError(f"{name}: the recipe averages edge features but the graph has none")
        efeat = torch.as_tensor(graph["edge_feat"]).to(torch.float32)
        dst = torch.as_tensor(graph["edge_index"][1], dtype=torch.int64)
        n = int(graph["num_nodes"])
        total = torch.zeros(n, efeat.shape[1], dtype=torch.float32).index_add_(0, dst, efeat)
        deg = torch.bincount(dst, minlength=n).clamp(min=1).to(torch.float32)
        return total / deg[:, None]
    if graph.get("node_feat") is None:
        raise ValueError(f"{name}: OGB graph has no node features")
    return torch.as_tensor(graph["node_feat"]).to(torch.float32).contiguous()


def _labels(
    labels: torch.Tensor, recipe: OgbRecipe, split_nodes: torch.Tensor, name: str
) -> torch.Tensor:
    """OGB labels -> ``(N,)`` int64 (``-1`` where OGB has NaN) or ``(N, T)`` float32."""
    if recipe.multilabel:
        return labels.to(torch.float32).reshape(labels.shape[0], -1).contiguous()
    flat = labels.reshape(labels.shape[0], -1)
    if flat.shape[1] != 1:
        raise ValueError(f"{name}: expected one label column, got shape {tuple(labels.shape)}")
    flat = flat[:, 0]
    if not flat.is_floating_point():
        return flat.to(torch.int64).contiguous()
    known = ~torch.isnan(flat)
    out = torch.full(flat.shape, -1, dtype=torch.int64)
    out[known] = flat[known].to(torch.int64)
    unlabelled = int((~known[split_nodes]).sum())
    if unlabelled:
        raise ValueError(f"{name}: {unlabelled} train/valid/test nodes have NaN labels")
    return out


def load_ogb(
    name: str,
    root: str | Path = "data",
    *,
    meta_dict: dict | None = None,
    recipe: str | None = None,
) -> GraphDataset:
    """Load an OGB node-property dataset offline and apply its recipe.

    Args:
        name: an OGB name (``ogbn-products`` ...), or any name with ``meta_dict``.
        root: folder holding ``<root>/ogbn_<name>/``.
        meta_dict: OGB's custom-dataset hook (keys of OGB's ``master.csv`` plus
            ``dir_path``); used to run the real OGB reader on hand-made files.
        recipe: which dataset's processing to apply (default: ``name``); required with
            a ``meta_dict`` whose name is not an OGB dataset.

    Raises:
        DatasetNotFoundError: files missing (checked before OGB runs; never downloads).
        ValueError: unknown recipe or inconsistent data.
    """
    recipe_name = recipe if recipe is not None else name
    if recipe_name not in OGB_RECIPES:
        raise ValueError(f"recipe={recipe_name!r} is not one of {sorted(OGB_RECIPES)}")
    rec = OGB_RECIPES[recipe_name]
    graph, labels, split, meta = _read_with_ogb(name, Path(root), meta_dict)

    # np.array copies: pandas hands out read-only arrays (splits, labels), which torch warns about
    train_idx, valid_idx, test_idx = (
        torch.from_numpy(np.array(split[k], dtype=np.int64).reshape(-1)) for k in ("train", "valid", "test")
    )
    n = int(graph["num_nodes"])
    feat = _node_features(graph, rec, name)
    label = _labels(torch.from_numpy(np.array(labels)), rec, torch.cat([train_idx, valid_idx, test_idx]), name)
    src, dst = (torch.as_tensor(graph["edge_index"][i], dtype=torch.int64) for i in (0, 1))
    del graph
    src, dst = canonical_edges(
        src, dst, n, remove_self_loops=True, to_bidirected=rec.to_bidirected
    )
    num_classes = int(meta["num tasks"]) if rec.multilabel else int(meta["num classes"])
    return GraphDataset(
        name=name,
        graph=bare_graph(src, dst, n),
        feat=feat,
        label=label,
        train_idx=train_idx,
        valid_idx=valid_idx,
        test_idx=test_idx,
        num_classes=num_classes,
        multilabel=rec.multilabel,
        is_ogb=True,
        ogb_name=recipe_name,
    )
