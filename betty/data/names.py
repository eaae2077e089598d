"""What the data layer knows without reading data: the names of the datasets it reads
from files, the feature dtypes a dataset may hold, and the error for files that are not
there. No numpy or torch here, so a
spec can be validated without them (:mod:`betty.data.registry`)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["DatasetNotFoundError", "OGB_NAMES", "PLANETOID_NAMES", "DGL_BUILTIN_NAMES", "DGL_FILE_MAGIC",
           "FEATURE_DTYPES", "is_dgl_file"]

FEATURE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
"""The feature dtypes a :class:`betty.data.GraphDataset` may hold (``feature_dtype``), float32 first."""

OGB_NAMES = ("ogbn-products", "ogbn-arxiv", "ogbn-proteins", "ogbn-papers100M")
"""OGB node-property datasets read from their raw files (:mod:`betty.data.ogb_loader`)."""

PLANETOID_NAMES = ("cora", "citeseer", "pubmed")
"""Planetoid datasets, parsed by betty (:mod:`betty.data.planetoid`)."""

DGL_BUILTIN_NAMES = (*PLANETOID_NAMES, "reddit")
"""Datasets in DGL's folder layout (:mod:`betty.data.dgl_builtin`; Reddit through DGL's class)."""


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files are not on disk (and nothing will be downloaded)."""


DGL_FILE_MAGIC = (0xDD2E4FF046B4A13F).to_bytes(8, "little")
"""The first 8 bytes of every ``dgl.save_graphs`` file (DGL's ``kDGLSerializeMagic``)."""


def is_dgl_file(path: str | Path) -> bool:
    """Whether ``path`` is a regular file starting with :data:`DGL_FILE_MAGIC` (reads 8
    bytes; needs no DGL)."""
    path = Path(path)
    if not path.is_file():
        return False
    try:
        with path.open("rb") as fh:
            return fh.read(8) == DGL_FILE_MAGIC
    except OSError:
        return False
