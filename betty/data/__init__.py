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

from betty.data.dgl_builtin import dgl_raw_path
from betty.data.ogb_loader import DatasetNotFoundError
from betty.data.planetoid import load_planetoid, stage_planetoid
from betty.data.registry import cache_path, dataset_digest, dataset_names, load_dataset, resolve_options
from betty.data.synthetic import SYNTHETIC_PRESETS, SyntheticConfig, generate_synthetic
from betty.data.types import GraphDataset

__all__ = [
    "GraphDataset",
    "load_dataset",
    "dataset_names",
    "resolve_options",
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
