"""On-disk cache of processed datasets: ``<root>/betty-cache/<name>-<key>.pt``.

``key`` is the first 16 hex digits of the SHA-256 of a JSON description of everything
the processed dataset depends on (name, resolved options with defaults filled in, a
fingerprint of the source files, and :data:`CACHE_FORMAT`), so changing any option
misses the cache. Files are written to a temporary name in the same directory and moved
into place with ``os.replace`` (atomic on POSIX): an interrupted run leaves either no
cache file or a complete one. A cache file that cannot be read is ignored (and later
overwritten).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

import torch

from betty.data.graph_build import bare_graph
from betty.data.types import GraphDataset

__all__ = ["CACHE_DIRNAME", "CACHE_FORMAT", "cache_key", "cache_file", "save_cached", "load_cached"]

CACHE_DIRNAME = "betty-cache"
CACHE_FORMAT = 1  # bump when the processing of any dataset changes


def cache_key(payload: dict) -> str:
    """16 hex digits of SHA-256 over ``payload`` serialized as sorted-key JSON."""
    text = json.dumps({"format": CACHE_FORMAT, **payload}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def cache_file(root: str | Path, name: str, payload: dict) -> Path:
    """Where the processed dataset ``name`` described by ``payload`` is cached."""
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
    return Path(root) / CACHE_DIRNAME / f"{safe}-{cache_key(payload)}.pt"


def save_cached(ds: GraphDataset, path: str | Path) -> None:
    """Write ``ds`` to ``path`` atomically (temporary file + ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    src, dst = ds.graph.edges()
    state = {
        "format": CACHE_FORMAT,
        "name": ds.name,
        "num_nodes": ds.num_nodes,
        "src": src,
        "dst": dst,
        "feat": ds.feat,
        "label": ds.label,
        "train_idx": ds.train_idx,
        "valid_idx": ds.valid_idx,
        "test_idx": ds.test_idx,
        "num_classes": int(ds.num_classes),
        "multilabel": bool(ds.multilabel),
        "is_ogb": bool(ds.is_ogb),
        "ogb_name": ds.ogb_name,
    }
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_cached(path: str | Path) -> GraphDataset | None:
    """The dataset stored at ``path``, or ``None`` if there is none or it is unreadable.

    Tensors are memory-mapped from the file (``torch.load(mmap=True)``), so loading is
    fast and pages are read on first use.
    """
    path = Path(path)
    if not path.is_file():
        return None
    try:
        state = torch.load(str(path), mmap=True, weights_only=True)
        if state.get("format") != CACHE_FORMAT:
            return None
        return GraphDataset(
            name=state["name"],
            graph=bare_graph(state["src"], state["dst"], state["num_nodes"]),
            feat=state["feat"],
            label=state["label"],
            train_idx=state["train_idx"],
            valid_idx=state["valid_idx"],
            test_idx=state["test_idx"],
            num_classes=state["num_classes"],
            multilabel=state["multilabel"],
            is_ogb=state["is_ogb"],
            ogb_name=state["ogb_name"],
        )
    except Exception as err:  # a damaged or foreign file: recompute instead
        warnings.warn(f"ignoring unreadable dataset cache {path}: {err}", stacklevel=2)
        return None
