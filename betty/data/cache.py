"""On-disk cache of processed datasets: ``<root>/betty-cache/<name>-<key>.pt``.

``key`` is the first 16 hex digits of the SHA-256 of a JSON description of everything
the processed dataset depends on (name, resolved options with defaults filled in, a
fingerprint of the source files, and :data:`CACHE_FORMAT`), so changing any option
misses the cache. Files are written to a temporary name in the same directory and moved
into place with ``os.replace`` (atomic on POSIX): an interrupted run leaves either no
cache file or a complete one. Beside each file, ``<file>.sha256`` records the SHA-256 of
its bytes; a load hashes the file and checks it, so a cache whose content changed after
it was written (edited, replaced, truncated) is rebuilt with a warning instead of being
used. A cache file that cannot be read, has no or a different digest, or is not a
regular file (a directory in its place) is ignored with a warning and overwritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from betty.data.graph_build import bare_graph
from betty.data.types import GraphDataset

__all__ = ["CACHE_DIRNAME", "CACHE_FORMAT", "cache_key", "cache_file", "digest_file", "save_cached",
           "load_cached"]

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


def digest_file(path: str | Path) -> Path:
    """Where the SHA-256 of cache file ``path`` is recorded: ``<path>.sha256``."""
    path = Path(path)
    return path.with_name(path.name + ".sha256")


def _sha256(path: Path) -> str:
    """SHA-256 (hex) of the file's bytes."""
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _write_atomic(path: Path, write) -> None:
    """``write(fh)`` into a temporary file beside ``path``, fsync, then ``os.replace``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _clear(path: Path) -> None:
    """Remove whatever is at ``path`` unless it is a regular file (a directory or other
    object left where a cache file belongs), so the cache file can be written there."""
    if path.is_symlink() or (path.exists() and not path.is_dir() and not path.is_file()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def save_cached(ds: GraphDataset, path: str | Path) -> None:
    """Write ``ds`` to ``path`` atomically (temporary file + ``os.replace``), then its
    SHA-256 to :func:`digest_file` (also atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for target in (path, digest_file(path)):
        _clear(target)
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
    _write_atomic(path, lambda fh: torch.save(state, fh))
    digest = _sha256(path)
    _write_atomic(digest_file(path), lambda fh: fh.write(digest.encode("ascii") + b"\n"))


def _content_problem(path: Path) -> str | None:
    """Why the file at ``path`` must not be used as a cache (``None``: it may)."""
    if not path.is_file():
        return "is not a regular file"
    record = digest_file(path)
    try:
        want = record.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return f"has no readable content digest ({record.name})"
    if _sha256(path) != want:
        return f"content differs from its recorded SHA-256 ({record.name})"
    return None


def load_cached(path: str | Path) -> GraphDataset | None:
    """The dataset stored at ``path``, or ``None`` if there is none or it cannot be used
    (unreadable, not a regular file, content not matching its recorded SHA-256: each
    with a warning; the caller then rebuilds and overwrites it).

    Tensors are memory-mapped from the file (``mmap=True``, ``weights_only=True``) after its bytes
    are hashed once (about a second per GB), so pages are read from the page cache.
    """
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return None
    problem = _content_problem(path)
    if problem is not None:
        warnings.warn(f"ignoring dataset cache {path}: it {problem}; rebuilding it", stacklevel=2)
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
