"""Datasets: one entry point, :func:`load_dataset`, returning a :class:`GraphDataset`.

>>> ds = load_dataset("synthetic", root="data", scale=0.5, seed=1)
>>> ds.graph, ds.feat.shape, ds.label.shape, ds.train_idx.shape

Sources: a seeded generator (``synthetic``, ``synthetic-products``), OGB's raw files
through ``ogb``'s raw readers (``ogbn-*``), the Planetoid files parsed by betty
(``cora``, ``citeseer``, ``pubmed``), and, with DGL installed, DGL's Reddit class
(``reddit``) and ``dgl.save_graphs`` files (``dgl-file``). The graph is always a
:class:`betty.graph.Graph`; nothing here imports DGL or PyG at module level. Real
datasets are read offline from ``root``; a missing one raises
:class:`DatasetNotFoundError` at once with the exact place to put the files.
"""

from betty.data.names import DatasetNotFoundError
from betty.data.registry import (
    cache_path,
    check_available,
    dataset_digest,
    dataset_names,
    load_dataset,
    resolve_options,
)
from betty.data.synthetic_config import SYNTHETIC_PRESETS, SyntheticConfig

# Imported on first use: these need numpy and torch, the names above do not (so that a
# spec is validated without them).
_LAZY = {"GraphDataset": "types", "generate_synthetic": "synthetic", "stage_planetoid": "planetoid",
         "load_planetoid": "planetoid", "dgl_raw_path": "dgl_builtin"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"betty.data.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GraphDataset",
    "load_dataset",
    "dataset_names",
    "resolve_options",
    "check_available",
    "cache_path",
    "dataset_digest",
    "DatasetNotFoundError",
    "SyntheticConfig",
    "SYNTHETIC_PRESETS",
    "generate_synthetic",
    "stage_planetoid",
    "load_planetoid",
    "dgl_raw_path",
]
