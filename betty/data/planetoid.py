"""Planetoid citation datasets (Cora, CiteSeer, PubMed) read from their raw files, no DGL.

The raw files ``ind.<name>.{x,y,tx,ty,allx,ally,graph,test.index}`` are Python pickles
(scipy sparse features, numpy one-hot labels, a ``{node: [neighbours]}`` dict) and a
text file of test node IDs. :func:`load_planetoid` processes them exactly as DGL 2.1's
``CitationGraphDataset`` does (``reverse_edge=True``, no reordering), so the dataset
equals DGL's (``tests/test_data_planetoid.py`` compares them when DGL is installed):

* **nodes** ``N = rows(allx) + rows(tx)``; the test rows of ``allx ∪ tx`` (and of
  ``ally ∪ ty``) are put back in the order ``test.index`` gives. CiteSeer's test IDs
  have holes (isolated nodes without features): ``tx``/``ty`` are first widened to the
  full ID range with zero rows (label 0 after the argmax);
* **features** row-normalized: ``x_v * (1 / sum(x_v))`` (zero rows stay zero), float32;
* **labels** ``argmax`` of the one-hot rows; C = number of one-hot columns;
* **edges** the undirected simple graph of the neighbour dict (each ``{u, v}`` once,
  a self-loop ``{v}`` once) stored in both directions: ``E = 2 |{u != v}| + |loops|``
  (Cora 10,556, CiteSeer 9,228 with its 124 self-loops), listed by (src, dst);
* **split** train = the first ``rows(y)`` nodes, valid = the next 500, test = the
  ``test.index`` IDs.

:func:`stage_planetoid` links raw files into the folder layout DGL's own classes read
(:func:`betty.data.dgl_builtin.dgl_raw_path`), which is also where ``load_dataset("cora",
root)`` looks.
"""

from __future__ import annotations

import pickle
import shutil
import warnings
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

from betty.data.dgl_builtin import DGL_BUILTINS, PLANETOID_SUFFIXES, dgl_raw_path
from betty.data.graph_build import bare_graph, canonical_edges
from betty.data.names import PLANETOID_NAMES
from betty.data.names import DatasetNotFoundError
from betty.data.types import GraphDataset

__all__ = ["PLANETOID_NAMES", "load_planetoid", "load_planetoid_dataset", "stage_planetoid"]

_NUM_VALID = 500


def _unpickle(path: Path):
    """The object pickled in ``path``; ``ValueError`` naming the file when it cannot be
    read back (a truncated or damaged download)."""
    try:
        with open(path, "rb") as f, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # old scipy pickles warn about moved modules
            return pickle.load(f, encoding="latin1")
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError,
            IndexError, KeyError) as err:
        raise ValueError(f"{path}: not a readable Planetoid file ({type(err).__name__}: {err}); "
                         "replace it with the original") from None


def _test_ids(path: Path, count: int) -> np.ndarray:
    """The node IDs of ``test.index``, one per line; ``ValueError`` naming the file unless
    there are ``count`` of them (the rows of ``tx``) and each is an integer."""
    try:
        ids = np.array([int(line) for line in path.read_text().split()], dtype=np.int64)
    except ValueError as err:
        raise ValueError(f"{path}: not a list of node IDs ({err}); replace it with the original") from None
    if ids.size != count:
        raise ValueError(f"{path}: {ids.size} test node IDs for the {count} rows of the test features "
                         "(a truncated or damaged file); replace it with the original")
    return ids


def _dense(m) -> np.ndarray:
    return np.asarray(m.todense()) if sp.issparse(m) else np.asarray(m)


def _row_normalize(feat: np.ndarray) -> np.ndarray:
    """``x_v * (1 / sum(x_v))`` per row (zero rows stay zero), in ``feat``'s dtype and
    with scipy's sparse row sums and product, the arithmetic DGL uses, so that the
    float32 features are bit-equal to DGL's on its stack. The reciprocal is NumPy's
    float32 ``power``, which NumPy 2 rounds correctly and NumPy 1 does not: on Cora the
    two stacks' features differ by one float32 ulp in 9,266 values (492 rows)."""
    mat = sp.csr_matrix(feat)
    rowsum = np.asarray(mat.sum(1)).ravel()
    zero = rowsum == 0
    rowsum[zero] = 1
    inverse = np.power(rowsum, -1)  # not 1 / s: numpy's float32 power rounds differently
    inverse[zero] = 0
    return np.asarray(sp.diags(inverse).dot(mat).todense())


def load_planetoid(folder: str | Path, name: str, *, stem: str | None = None) -> GraphDataset:
    """Read ``folder/ind.<stem>.*`` (``stem`` defaults to ``name``) as a GraphDataset.

    Args:
        folder: the folder holding the eight Planetoid files.
        name: ``"cora"``, ``"citeseer"`` or ``"pubmed"`` (the dataset name recorded;
            CiteSeer's hole filling applies to ``"citeseer"``).
        stem: the file-name stem when it differs from ``name`` (DGL's layout names
            Cora's files ``ind.cora_v2.*``).

    Raises:
        ValueError: unknown ``name``, or a file that cannot be read back (named).
        DatasetNotFoundError: files missing (all named).
    """
    if name not in PLANETOID_NAMES:
        raise ValueError(f"name={name!r} is not a Planetoid dataset; allowed: {list(PLANETOID_NAMES)}")
    folder, stem = Path(folder), stem or name
    paths = {s: folder / f"ind.{stem}.{s}" for s in PLANETOID_SUFFIXES}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise DatasetNotFoundError(
            f"dataset {name!r} is not available offline: missing {', '.join(missing)}. Place "
            f"the Planetoid files there as ind.{stem}.{{{','.join(PLANETOID_SUFFIXES)}}}"
            + (f" (the ind.{name}.* files, renamed)" if stem != name else "")
            + " (betty.data.stage_planetoid links them into place; nothing is downloaded)."
        )
    x, y, tx, ty, allx, ally, adjacency = (_unpickle(paths[s]) for s in PLANETOID_SUFFIXES[:7])
    tx, ty = _dense(tx), _dense(ty)
    test_ids = _test_ids(paths["test.index"], tx.shape[0])
    test_sorted = np.sort(test_ids)
    if name == "citeseer":  # isolated test nodes: zero rows at the missing IDs
        span = int(test_ids.max() - test_ids.min()) + 1
        wide_x = np.zeros((span, tx.shape[1]), dtype=np.float64)  # DGL widens in float64
        wide_y = np.zeros((span, ty.shape[1]), dtype=ty.dtype)
        wide_x[test_sorted - test_sorted.min()] = tx
        wide_y[test_sorted - test_sorted.min()] = ty
        tx, ty = wide_x, wide_y
    feat = np.vstack([_dense(allx), tx])  # float32 (Cora), float64 (CiteSeer, widened)
    onehot = np.vstack([_dense(ally), ty])
    feat[test_ids] = feat[test_sorted]
    onehot[test_ids] = onehot[test_sorted]
    feat = _row_normalize(feat)
    n = feat.shape[0]

    src = np.fromiter((u for u, nbrs in adjacency.items() for _ in nbrs), dtype=np.int64)
    dst = np.fromiter((v for nbrs in adjacency.values() for v in nbrs), dtype=np.int64)
    nodes = max(n, int(max(src.max(initial=-1), dst.max(initial=-1))) + 1)
    if nodes != n:
        raise ValueError(f"{name}: the graph names node {nodes - 1} but there are {n} feature rows")
    s, d = canonical_edges(torch.from_numpy(src), torch.from_numpy(dst), n,
                           remove_self_loops=False, to_bidirected=True)
    num_train = _dense(y).shape[0]
    return GraphDataset(
        name=name,
        graph=bare_graph(s, d, n),
        feat=torch.from_numpy(feat.astype(np.float32)),
        label=torch.from_numpy(onehot.argmax(1).astype(np.int64)),
        train_idx=torch.arange(num_train, dtype=torch.int64),
        valid_idx=torch.arange(num_train, num_train + _NUM_VALID, dtype=torch.int64),
        test_idx=torch.from_numpy(test_sorted),
        num_classes=int(onehot.shape[1]),
    )


def load_planetoid_dataset(name: str, root: str | Path = "data") -> GraphDataset:
    """``load_dataset``'s reader for ``cora`` / ``citeseer`` / ``pubmed``: the files in
    DGL's folder under ``root`` (:func:`stage_planetoid` puts them there)."""
    return load_planetoid(dgl_raw_path(name, root), name, stem=DGL_BUILTINS[name].dgl_name)


def stage_planetoid(
    src_dir: str | Path, raw_dir: str | Path, name: str, *, symlink: bool = True
) -> Path:
    """Make ``src_dir/ind.<name>.*`` readable by DGL's class under ``raw_dir``.

    Creates ``dgl_raw_path(name, raw_dir)`` (e.g. ``raw_dir/cora_v2_d697a464``) holding
    ``ind.<dgl name>.<suffix>`` for the eight Planetoid suffixes, as symlinks to the
    source files (``symlink=False`` copies them). Existing staged files are kept, so
    staging twice is harmless. The source directory is only read.

    Args:
        src_dir: folder with the Planetoid files ``ind.<name>.{x,y,tx,ty,allx,ally,graph,test.index}``.
        raw_dir: the ``root`` later given to ``load_dataset(name, root=raw_dir)``.
        name: ``"cora"``, ``"citeseer"`` or ``"pubmed"``.

    Returns:
        The staged folder.

    Raises:
        ValueError: unknown ``name``. FileNotFoundError: source files missing.
    """
    if name not in PLANETOID_NAMES:
        raise ValueError(f"name={name!r} is not a Planetoid dataset; allowed: {list(PLANETOID_NAMES)}")
    src_dir = Path(src_dir)
    sources = [src_dir / f"ind.{name}.{s}" for s in PLANETOID_SUFFIXES]
    missing = [str(p) for p in sources if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"Planetoid files for {name!r} missing: {', '.join(missing)}")
    folder = dgl_raw_path(name, raw_dir)
    folder.mkdir(parents=True, exist_ok=True)
    dgl_name = DGL_BUILTINS[name].dgl_name
    for source, suffix in zip(sources, PLANETOID_SUFFIXES):
        target = folder / f"ind.{dgl_name}.{suffix}"
        if target.exists():
            continue
        if target.is_symlink():  # dangling link from an earlier staging
            target.unlink()
        if symlink:
            target.symlink_to(source.resolve())
        else:
            shutil.copyfile(source, target)
    return folder
