"""A dataset stored with ``dgl.save_graphs``: one graph with DGL's node-data names.

Reading the file needs DGL (its format is DGL's C++ serialization); without DGL the
loader fails with the install command. The dataset it returns holds no DGL object.

Expected node data (N nodes):

=============  =====================================================
``feat``       ``(N, F)`` floating point (stored as float32)
``label``      ``(N,)`` or ``(N, 1)`` integer class IDs (OGB's shape), or ``(N, T)``
               0/1 targets (multi-label; ``T = 1`` only as floating point)
``train_mask`` ``(N,)`` bool (or integer 0/1)
``val_mask``   ``(N,)`` bool (or integer 0/1)
``test_mask``  ``(N,)`` bool (or integer 0/1)
=============  =====================================================

Every violation is reported in one ``ValueError`` naming the field, what was found and
the expected shape/dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch

from betty.data.graph_build import bare_graph, mask_to_index
from betty.data.names import DGL_FILE_MAGIC, DatasetNotFoundError, is_dgl_file
from betty.data.types import GraphDataset

__all__ = ["REQUIRED_FIELDS", "DGL_FILE_MAGIC", "is_dgl_file", "load_dgl_file"]

REQUIRED_FIELDS = {
    "feat": "(N, F) floating point",
    "label": "(N,) or (N, 1) integer, or (N, T) 0/1",
    "train_mask": "(N,) bool or 0/1 integer",
    "val_mask": "(N,) bool or 0/1 integer",
    "test_mask": "(N,) bool or 0/1 integer",
}


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype}"


def _is_binary(t: torch.Tensor) -> bool:
    return t.numel() == 0 or bool(((t == 0) | (t == 1)).all())


def _class_column(t: torch.Tensor) -> bool:
    """An ``(N, 1)`` integer label: one class ID per node, as OGB stores them (a single
    0/1 target column is multi-label only when it is floating point)."""
    return t.dim() == 2 and t.shape[1] == 1 and not t.is_floating_point() and t.dtype != torch.bool


def _field_problems(ndata, n: int) -> list[str]:
    problems = []
    for field, expected in REQUIRED_FIELDS.items():
        want = expected.replace("N", str(n))
        if field not in ndata:
            problems.append(f"{field}: missing (expected {want})")
            continue
        t = ndata[field]
        if field == "feat":
            ok = t.dim() == 2 and t.shape[0] == n and t.is_floating_point()
        elif field == "label":
            single = (t.dim() == 1 or _class_column(t)) and not t.is_floating_point() and t.dtype != torch.bool
            multi = t.dim() == 2 and _is_binary(t)
            ok = t.dim() >= 1 and t.shape[0] == n and (single or multi)
        else:
            ok = (
                t.dim() == 1
                and t.shape[0] == n
                and (t.dtype == torch.bool or (not t.is_floating_point() and _is_binary(t)))
            )
        if not ok:
            problems.append(f"{field}: got {_describe(t)} (expected {want})")
    return problems


def load_dgl_file(
    path: str | Path, *, name: str = "dgl-file", num_classes: int | None = None
) -> GraphDataset:
    """Load a one-graph ``dgl.save_graphs`` file as a :class:`GraphDataset`.

    Args:
        path: the file.
        name: dataset name to record.
        num_classes: class count for single-label data; default ``max(label) + 1``.
            For multi-label data it is the number of label columns T.

    Raises:
        DatasetNotFoundError: no such file.
        ImportError: DGL is not installed (the message gives the install command).
        ValueError: not exactly one homogeneous graph, or missing/misshapen fields.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetNotFoundError(f"dgl-file: path={str(path)!r} does not exist (a dgl.save_graphs file)")
    try:
        import dgl
    except ImportError as err:
        raise ImportError(
            f"dataset 'dgl-file' ({path}) is DGL's own binary format (dgl.save_graphs: "
            "serialized C++ graph objects, read by DGL's library only) and DGL is not "
            "installed: pip install 'dgl==2.1.0' (betty's DGL stack, see the README), or "
            "convert the file once on a machine with DGL"
        ) from err
    if not is_dgl_file(path):
        raise ValueError(f"dgl-file {path}: not a dgl.save_graphs file (its header is not DGL's)")
    try:
        graphs, _ = dgl.load_graphs(str(path))
    except dgl.DGLError as err:  # a damaged file: DGL's message without its C++ stack trace
        head = str(err).split("Stack trace:")[0].strip()
        reason = head.splitlines()[-1] if head else type(err).__name__
        raise ValueError(f"dgl-file {path}: DGL cannot read it ({reason})") from None
    if len(graphs) != 1:
        raise ValueError(f"dgl-file {path}: expected exactly one graph, found {len(graphs)}")
    g = graphs[0]
    if not g.is_homogeneous:
        raise ValueError(f"dgl-file {path}: expected a homogeneous graph, got types {g.ntypes}/{g.etypes}")
    n = int(g.num_nodes())
    problems = _field_problems(g.ndata, n)
    if problems:
        raise ValueError(f"dgl-file {path}: " + "; ".join(problems))

    label = g.ndata["label"]
    if _class_column(label):  # OGB's (N, 1) class IDs
        label = label.reshape(-1)
    multilabel = label.dim() == 2
    if multilabel:
        label = label.to(torch.float32)
        classes = int(label.shape[1])
        if num_classes is not None and num_classes != classes:
            raise ValueError(f"num_classes={num_classes} but the multi-label 'label' has {classes} columns")
    else:
        label = label.to(torch.int64)
        seen = int(label.max()) + 1 if label.numel() else 1
        classes = seen if num_classes is None else int(num_classes)
        if classes < seen:
            raise ValueError(f"num_classes={num_classes} but 'label' holds class {seen - 1}")
    src, dst = g.edges()
    return GraphDataset(
        name=name,
        graph=bare_graph(src.to(torch.int64), dst.to(torch.int64), n),
        feat=g.ndata["feat"].to(torch.float32).contiguous(),
        label=label.contiguous(),
        train_idx=mask_to_index(g.ndata["train_mask"]),
        valid_idx=mask_to_index(g.ndata["val_mask"]),
        test_idx=mask_to_index(g.ndata["test_mask"]),
        num_classes=classes,
        multilabel=multilabel,
    )
