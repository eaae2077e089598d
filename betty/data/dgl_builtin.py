"""Cora, CiteSeer, PubMed and Reddit through DGL's own dataset classes, offline.

DGL reads a dataset from ``<raw_dir>/<dgl name>_<h>/`` where ``h`` is the first 8 hex
digits of the SHA-1 of the URL it would download from (``cora_v2_d697a464`` for Cora
with DGL 2.1: Cora's DGL name is ``cora_v2``, so its Planetoid files are renamed
``ind.cora_v2.*``). It processes the raw files there and caches a ``.bin`` beside them.
Here ``raw_dir`` is the ``root`` given to :func:`betty.data.load_dataset`; the folder is
checked before DGL runs, so a missing dataset raises at once with the exact folder and
file names, and DGL's download method is replaced by one that raises.

The graph is kept as DGL builds it (DGL's CiteSeer has 124 self-loops; they stay, so
the edge counts match DGL's: Cora 10,556, CiteSeer 9,228).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from betty.data.names import DGL_BUILTIN_NAMES, PLANETOID_NAMES, DatasetNotFoundError

if TYPE_CHECKING:
    from betty.data.types import GraphDataset

__all__ = ["DglBuiltin", "DGL_BUILTINS", "PLANETOID_SUFFIXES", "check_files", "dgl_raw_path", "load_dgl_builtin"]

PLANETOID_SUFFIXES = ("x", "y", "tx", "ty", "allx", "ally", "graph", "test.index")


@dataclass(frozen=True)
class DglBuiltin:
    """Where DGL's class for one dataset reads its files.

    Attributes:
        class_name: attribute of ``dgl.data`` (``CoraGraphDataset``).
        dgl_name: DGL's dataset name, the stem of its folder and Planetoid file names.
        url_path: the URL path DGL would download (hashed into the folder name).
        raw_files: files DGL's ``process`` reads from the folder.
        processed_files: DGL's own cache in the folder (enough without raw files).
        source_hint: where the raw files come from, for error messages.
    """

    class_name: str
    dgl_name: str
    url_path: str
    raw_files: tuple[str, ...]
    processed_files: tuple[str, ...]
    source_hint: str


def _planetoid(class_name: str, dgl_name: str, planetoid_name: str) -> DglBuiltin:
    return DglBuiltin(
        class_name=class_name,
        dgl_name=dgl_name,
        url_path=f"dataset/{dgl_name}.zip",
        raw_files=tuple(f"ind.{dgl_name}.{s}" for s in PLANETOID_SUFFIXES),
        processed_files=(f"{dgl_name}_dgl_graph.bin", f"{dgl_name}_dgl_graph.pkl"),
        source_hint=(
            f"the Planetoid files ind.{planetoid_name}.{{{','.join(PLANETOID_SUFFIXES)}}} "
            f"renamed to ind.{dgl_name}.* (betty.data.planetoid.stage_planetoid does this)"
        ),
    )


DGL_BUILTINS: dict[str, DglBuiltin] = {
    "cora": _planetoid("CoraGraphDataset", "cora_v2", "cora"),
    "citeseer": _planetoid("CiteseerGraphDataset", "citeseer", "citeseer"),
    "pubmed": _planetoid("PubmedGraphDataset", "pubmed", "pubmed"),
    "reddit": DglBuiltin(
        class_name="RedditDataset",
        dgl_name="reddit",
        url_path="dataset/reddit.zip",
        raw_files=("reddit_data.npz", "reddit_graph.npz"),
        processed_files=("dgl_graph.bin",),
        source_hint="reddit_data.npz and reddit_graph.npz from DGL's reddit.zip",
    ),
}
assert tuple(DGL_BUILTINS) == DGL_BUILTIN_NAMES, "betty.data.names.DGL_BUILTIN_NAMES lists them"


def _spec(name: str) -> DglBuiltin:
    if name not in DGL_BUILTINS:
        raise ValueError(f"name={name!r} is not a DGL built-in dataset; allowed: {sorted(DGL_BUILTINS)}")
    return DGL_BUILTINS[name]


def dgl_raw_path(name: str, raw_dir: str | Path) -> Path:
    """The folder DGL 2.x reads ``name`` from: ``raw_dir/<dgl name>_<sha1(url)[:8]>``
    (the same rule as ``DGLDataset.raw_path``, with the URL built as DGL's
    ``dgl.data.utils._get_dgl_url`` does: ``$DGL_REPO`` or ``https://data.dgl.ai/``, then
    the dataset's path). Needs no DGL."""

    spec = _spec(name)
    repo = os.environ.get("DGL_REPO", "https://data.dgl.ai/")
    url = (repo if repo.endswith("/") else repo + "/") + spec.url_path
    digest = hashlib.sha1(url.encode("utf-8")).hexdigest()[:8]
    return Path(raw_dir) / f"{spec.dgl_name}_{digest}"


def check_files(name: str, raw_dir: Path) -> None:
    spec = _spec(name)
    folder = dgl_raw_path(name, raw_dir)
    if name not in PLANETOID_NAMES and all((folder / f).is_file() for f in spec.processed_files):
        return  # DGL's class reads its processed file; betty reads Planetoid's raw files itself
    missing = [f for f in spec.raw_files if not (folder / f).is_file()]
    if missing:
        raise DatasetNotFoundError(
            f"dataset {name!r} is not available offline: {folder} lacks "
            + ", ".join(missing)
            + f". Place {spec.source_hint} in {folder}/ (nothing is downloaded)."
        )


def _refuse_download(self) -> None:
    raise DatasetNotFoundError(
        f"refusing to download DGL dataset {self.name!r} into {self.raw_path} "
        "(betty loads datasets offline only)"
    )


def load_dgl_builtin(name: str, root: str | Path = "data") -> GraphDataset:
    """Load ``name`` (cora, citeseer, pubmed, reddit) with DGL's class, offline.

    Args:
        name: key of :data:`DGL_BUILTINS`.
        root: DGL's ``raw_dir``; files go in :func:`dgl_raw_path` ``(name, root)``.

    Raises:
        DatasetNotFoundError: the files are missing (message names folder and files).
        ImportError: DGL is not installed (the message gives the install command).
    """
    import torch  # the file checks above need no torch

    from betty.data.graph_build import bare_graph, mask_to_index
    from betty.data.types import GraphDataset


    spec = _spec(name)
    root = Path(root)
    check_files(name, root)
    try:
        import dgl.data
    except ImportError as err:
        raise ImportError(
            f"dataset {name!r} is read with DGL's own dataset class, and DGL is not "
            "installed: pip install 'dgl==2.1.0' (betty's DGL stack, see the README)"
            + ("; cora, citeseer and pubmed load without DGL" if name != "reddit" else "")
        ) from err
    base = getattr(dgl.data, spec.class_name)
    offline = type(f"Offline{spec.class_name}", (base,), {"download": _refuse_download})
    dataset = offline(raw_dir=str(root), verbose=False)
    g = dataset[0]
    src, dst = g.edges()
    n = int(g.num_nodes())
    return GraphDataset(
        name=name,
        graph=bare_graph(src, dst, n),
        feat=g.ndata["feat"].to(torch.float32).contiguous(),
        label=g.ndata["label"].to(torch.int64).contiguous(),
        train_idx=mask_to_index(g.ndata["train_mask"]),
        valid_idx=mask_to_index(g.ndata["val_mask"]),
        test_idx=mask_to_index(g.ndata["test_mask"]),
        num_classes=int(dataset.num_classes),
    )
