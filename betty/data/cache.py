"""On-disk cache of processed datasets: ``<root>/betty-cache/<name>-<key>/``, a store.

``key`` is the first 16 hex digits of the SHA-256 of a JSON description of everything
the processed dataset depends on (name, resolved options with defaults filled in, a
fingerprint of the source files, and :data:`CACHE_FORMAT`), so changing any option
misses the cache. The cache entry is a :mod:`betty.data.store` folder (layout and
versioning in ``docs/graph_store.md``) holding the graph as its in-edge CSR only
(``indptr`` int64, ``indices`` int32 when N < 2^31, ``eid`` int32 when E < 2^31 and
left out when edge IDs are CSR positions), the features in the dtype asked for
(``feature_dtype``; a bfloat16 or float16 entry has its own key, the float32 one the
key it had before the option), the labels in their dtype, and the splits. It is
written to a temporary folder and moved into place (an interrupted run leaves no
entry); every file's size and SHA-256 are in its manifest. A load checks the manifest
and every size, hashes the files not stamped as verified since they last changed
(:func:`betty.data.store.open_store`: the first load after a build hashes them once,
later loads none), and memory-maps every array (nothing is read into memory but what
is touched): an entry that is not a folder, lacks or cannot read its manifest, has a
missing, truncated or changed file, damaged scalars, or the content of another key
(its manifest names the entry it was written as), is ignored with a warning and
rebuilt, never crashed on.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch

from betty.data.store import MANIFEST, StoreError, StoreWriter, open_store, verify_mode
from betty.data.types import GraphDataset
from betty.graph import Graph

__all__ = ["CACHE_DIRNAME", "CACHE_FORMAT", "files_fingerprint", "cache_key", "cache_file", "save_cached", "load_cached",
           "remove_superseded", "lean_csr", "entry_scalars", "dataset_from_store"]

CACHE_DIRNAME = "betty-cache"
CACHE_FORMAT = 2  # bump when the processing of any dataset or the entry's layout changes
_INT32_MAX = 2**31 - 1


def files_fingerprint(paths: Iterable[Path], relative_to: Path | None = None) -> list:
    """``[(name, size, mtime_ns)]`` of the files among ``paths`` that exist (named
    relative to ``relative_to``, else by their full path): what changes when a file
    is replaced or rewritten."""
    out = []
    for path in paths:
        if path.is_file():
            st = path.stat()
            name = path.relative_to(relative_to) if relative_to is not None else path.resolve()
            out.append((str(name), st.st_size, st.st_mtime_ns))
    return out


def cache_key(payload: dict) -> str:
    """16 hex digits of SHA-256 over ``payload`` serialized as sorted-key JSON."""
    text = json.dumps({"format": CACHE_FORMAT, **payload}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def cache_file(root: str | Path, name: str, payload: dict) -> Path:
    """The folder where the processed dataset ``name`` described by ``payload`` is cached."""
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
    return Path(root) / CACHE_DIRNAME / f"{safe}-{cache_key(payload)}"


def lean_csr(graph: Graph) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``graph``'s in-CSR as stored: ``indptr`` int64, ``indices`` int32 when N < 2^31,
    ``eid`` int32 when E < 2^31, or ``None`` when ``eid[p] = p`` (checked in chunks).
    The narrowing is done chunk by chunk as the store writes; here only the dtypes are
    chosen (the tensors returned are the graph's own)."""
    indptr, indices, eid = graph.in_csr
    if eid is not None:
        step = 1 << 24
        identity = all(torch.equal(eid[lo:lo + step].to(torch.int64), torch.arange(lo, min(lo + step, eid.numel())))
                       for lo in range(0, eid.numel(), step))
        if identity:
            eid = None
    return indptr.to(torch.int64), indices, eid


def entry_scalars(path: str | Path, name: str, num_nodes: int, num_classes: int, *, multilabel: bool = False,
                  is_ogb: bool = False, ogb_name: str | None = None) -> dict:
    """The manifest scalars of the cache entry at ``path`` (what a generator writing an
    entry itself passes to :class:`betty.data.store.StoreWriter`); ``entry``, the
    folder's name (``<name>-<key>``), ties the content to its key: a folder copied or
    moved under another key is refused (:func:`load_cached`)."""
    return {"cache_format": CACHE_FORMAT, "entry": Path(path).name, "name": name, "num_nodes": int(num_nodes),
            "num_classes": int(num_classes), "multilabel": bool(multilabel),
            "is_ogb": bool(is_ogb), "ogb_name": ogb_name}


def save_cached(ds: GraphDataset, path: str | Path, *, feature_dtype: torch.dtype | None = None,
                lineage: str | None = None) -> None:
    """Write ``ds`` as a store folder at ``path`` (atomically; see the module docstring),
    its features cast to ``feature_dtype`` (default: their own) as they are written,
    row chunk by row chunk (no whole cast copy is made). ``lineage``: the key of the
    dataset and options without the source files' fingerprint, kept in the manifest
    for :func:`remove_superseded`."""
    path = Path(path)
    indptr, indices, eid = lean_csr(ds.graph)
    scalars = entry_scalars(path, ds.name, ds.num_nodes, ds.num_classes, multilabel=ds.multilabel,
                            is_ogb=ds.is_ogb, ogb_name=ds.ogb_name)
    if lineage is not None:
        scalars["lineage"] = lineage
    with StoreWriter(path, scalars) as w:
        w.put("indptr", indptr, torch.int64)
        w.put("indices", indices, torch.int32 if ds.num_nodes <= _INT32_MAX else torch.int64)
        if eid is not None:
            w.put("eid", eid, torch.int32 if ds.num_edges <= _INT32_MAX else torch.int64)
        w.put("feat", ds.feat, feature_dtype)
        for field in ("label", "train_idx", "valid_idx", "test_idx"):
            w.put(field, getattr(ds, field))


def remove_superseded(path: str | Path, lineage: str) -> list[Path]:
    """Remove the entries beside ``path`` that cache the same dataset with the same
    options (``lineage``) from source files as they were before: a source file
    re-extracted or copied (a new modification time) gives a new key, and the old
    entry, as large as the dataset, would stay forever. Returns what was removed (a
    process that still maps one keeps its pages until it unmaps them)."""
    path = Path(path)
    removed = []
    for entry in sorted(path.parent.iterdir()):
        if entry == path or entry.name.startswith(".") or entry.is_symlink() or not entry.is_dir():
            continue
        try:
            scalars = json.loads((entry / MANIFEST).read_text(encoding="utf-8")).get("scalars")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(scalars, dict) and scalars.get("lineage") == lineage:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def dataset_from_store(arrays: dict[str, torch.Tensor], scalars: dict) -> GraphDataset:
    """The :class:`GraphDataset` of an opened store (its graph CSR-only)."""
    graph = Graph.from_csr(arrays["indptr"], arrays["indices"], arrays.get("eid"), scalars["num_nodes"])
    return GraphDataset(
        name=scalars["name"], graph=graph, feat=arrays["feat"], label=arrays["label"],
        train_idx=arrays["train_idx"], valid_idx=arrays["valid_idx"], test_idx=arrays["test_idx"],
        num_classes=scalars["num_classes"], multilabel=scalars["multilabel"],
        is_ogb=scalars["is_ogb"], ogb_name=scalars["ogb_name"])


def load_cached(path: str | Path, *, verify: bool | str = True) -> GraphDataset | None:
    """The dataset stored at ``path``, or ``None`` if there is none or it cannot be used
    (each reason with a warning; the caller then rebuilds and overwrites it).

    Every array is memory-mapped after the manifest and every file's size are checked;
    ``verify`` (:func:`betty.data.store.open_store`) says which files are hashed against
    their manifest SHA-256: ``True`` those changed since they were last verified,
    ``"full"`` all (one sequential read of the entry, about a second per GB, leaving it
    in the page cache), ``False`` none.

    Raises:
        ValueError: ``verify`` is none of ``True``, ``False``, ``"full"``."""
    verify_mode(verify)
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return None
    try:
        arrays, scalars = open_store(path, verify=verify)
        if scalars.get("cache_format") != CACHE_FORMAT:
            raise StoreError(f"has cache format {scalars.get('cache_format')!r}, this betty writes {CACHE_FORMAT}")
        if scalars.get("entry") != path.name:
            raise StoreError(f"was written as entry {scalars.get('entry')!r}, not {path.name!r} (a folder "
                             "copied or moved under another key)")
        return dataset_from_store(arrays, scalars)
    except StoreError as err:
        warnings.warn(f"ignoring dataset cache {path}: it {err}; rebuilding it", stacklevel=2)
    except Exception as err:  # a damaged or foreign entry: recompute instead
        warnings.warn(f"ignoring unreadable dataset cache {path}: {err}; rebuilding it", stacklevel=2)
    return None
