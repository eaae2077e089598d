"""The one container every dataset loader returns.

Conventions (shared by every loader, checked in :meth:`GraphDataset.__post_init__`):

* ``graph`` is a :class:`betty.graph.Graph` on the CPU (COO or, loaded from the
  dataset store, its in-CSR alone), no DGL or PyG object (a backend converts it: ``graph.to_dgl()``, ``graph.edge_index()``).
  An edge ``u -> v`` means *u is a neighbour of v*: a node aggregates over its
  **in**-edges. Features and labels live beside it.
* ``feat`` is ``(N, F)`` float32, or bfloat16 / float16 when loaded with that
  ``feature_dtype`` (:data:`betty.data.names.FEATURE_DTYPES`).
* ``label`` is ``(N,)`` int64 class IDs for single-label tasks (``-1`` marks a node
  without a label, e.g. most of ogbn-papers100M), or ``(N, T)`` float32 0/1 targets for
  multi-label tasks (ogbn-proteins, T = 112 binary tasks).
* ``train_idx`` / ``valid_idx`` / ``test_idx`` are ``(n,)`` int64 node IDs.
* ``num_classes`` is C for single-label, T (number of tasks) for multi-label.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from betty.data.names import FEATURE_DTYPES
from betty.graph import Graph

_FEAT_DTYPES = tuple(getattr(torch, name) for name in FEATURE_DTYPES)

__all__ = ["GraphDataset"]


@dataclass
class GraphDataset:
    """A node-classification dataset: graph, features, labels and split.

    Attributes:
        name: dataset name as passed to :func:`betty.data.load_dataset`.
        graph: the int64 CPU :class:`betty.graph.Graph`, edges ``src -> dst``
            (in-edges are a node's neighbours).
        feat: ``(N, F)`` float32 node features (bfloat16 or float16 when asked for).
        label: ``(N,)`` int64 (single-label, ``-1`` = unlabeled) or ``(N, T)`` float32
            0/1 (multi-label).
        train_idx, valid_idx, test_idx: ``(n,)`` int64 node IDs of each split.
        num_classes: C classes (single-label) or T tasks (multi-label).
        multilabel: whether ``label`` is ``(N, T)`` binary targets.
        is_ogb: whether the official ``ogb.nodeproppred.Evaluator`` applies.
        ogb_name: the OGB dataset name for that evaluator (``None`` otherwise).
    """

    name: str
    graph: Graph
    feat: torch.Tensor
    label: torch.Tensor
    train_idx: torch.Tensor
    valid_idx: torch.Tensor
    test_idx: torch.Tensor
    num_classes: int
    multilabel: bool = False
    is_ogb: bool = False
    ogb_name: str | None = None

    def __post_init__(self) -> None:
        problems = _contract_violations(self)
        if problems:
            raise ValueError(
                f"dataset {self.name!r} breaks the GraphDataset contract: "
                + "; ".join(problems)
            )

    @property
    def num_nodes(self) -> int:
        return int(self.graph.num_nodes())

    @property
    def num_edges(self) -> int:
        return int(self.graph.num_edges())

    @property
    def num_features(self) -> int:
        return int(self.feat.shape[1])

    def in_degrees(self) -> torch.Tensor:
        """``(N,)`` int64 in-degree of every node (the in-CSR's row lengths)."""
        return self.graph.in_degrees()

    def edge_homophily(self) -> float:
        """Fraction of edges whose endpoints share a label, over edges with both ends
        labelled: ``|{(u,v) : y_u = y_v}| / |E_labelled|``. NaN for multi-label data or
        when no edge has two labelled ends."""
        if self.multilabel:
            return float("nan")
        n = same = 0
        for src, dst in self.graph.csr_edge_chunks():
            ls, ld = self.label[src], self.label[dst]
            both = (ls >= 0) & (ld >= 0)
            n += int(both.sum())
            same += int(((ls == ld) & both).sum())
        return float(same) / n if n else float("nan")

    def stats(self) -> dict[str, float | int]:
        """Plain-number summary for logging.

        Keys: num_nodes, num_edges, num_features, num_classes, multilabel (0/1),
        num_train, num_valid, num_test, mean_in_degree (= E / N), median_in_degree,
        max_in_degree, num_distinct_in_degrees, num_zero_in_degree, num_self_loops,
        edge_homophily (NaN for multi-label).
        """
        deg = self.in_degrees()
        loops = sum(int((src == dst).sum()) for src, dst in self.graph.csr_edge_chunks())
        n = self.num_nodes
        return {
            "num_nodes": n,
            "num_edges": self.num_edges,
            "num_features": self.num_features,
            "num_classes": int(self.num_classes),
            "multilabel": int(self.multilabel),
            "num_train": int(self.train_idx.numel()),
            "num_valid": int(self.valid_idx.numel()),
            "num_test": int(self.test_idx.numel()),
            "mean_in_degree": self.num_edges / n if n else 0.0,
            "median_in_degree": float(deg.median()) if n else 0.0,
            "max_in_degree": int(deg.max()) if n else 0,
            "num_distinct_in_degrees": int(torch.unique(deg).numel()),
            "num_zero_in_degree": int((deg == 0).sum()),
            "num_self_loops": loops,
            "edge_homophily": self.edge_homophily(),
        }


def _contract_violations(ds: GraphDataset) -> list[str]:
    """Every way ``ds`` departs from the conventions in the module docstring (cheap
    checks only: shapes, dtypes, device, index ranges)."""
    g = ds.graph
    if not isinstance(g, Graph):
        return [f"graph must be a betty.graph.Graph (betty.graph.as_graph converts a "
                f"dgl.DGLGraph), got {type(g).__name__}"]
    out: list[str] = []
    n = int(g.num_nodes())
    if ds.feat.dim() != 2 or ds.feat.shape[0] != n or ds.feat.dtype not in _FEAT_DTYPES:
        out.append(
            f"feat must be ({n}, F) float32 (or {', '.join(FEATURE_DTYPES[1:])}), "
            f"got {tuple(ds.feat.shape)} {ds.feat.dtype}"
        )
    if ds.multilabel:
        want = f"({n}, {ds.num_classes}) float32"
        ok = (
            ds.label.dim() == 2
            and tuple(ds.label.shape) == (n, ds.num_classes)
            and ds.label.dtype == torch.float32
        )
    else:
        want = f"({n},) int64"
        ok = ds.label.dim() == 1 and ds.label.shape[0] == n and ds.label.dtype == torch.int64
    if not ok:
        out.append(f"label must be {want}, got {tuple(ds.label.shape)} {ds.label.dtype}")
    if ds.num_classes < 1:
        out.append(f"num_classes must be >= 1, got {ds.num_classes}")
    for split in ("train_idx", "valid_idx", "test_idx"):
        idx = getattr(ds, split)
        if idx.dim() != 1 or idx.dtype != torch.int64:
            out.append(f"{split} must be (n,) int64, got {tuple(idx.shape)} {idx.dtype}")
        elif idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            out.append(f"{split} holds node IDs outside [0, {n})")
    return out
