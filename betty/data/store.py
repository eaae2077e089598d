"""betty's on-disk array store: a folder of raw arrays and a ``manifest.json``.

One store is a folder holding one raw file per array (``<name>.bin``: the array's bytes
in C order, native little-endian, no header) and ``manifest.json``::

    {"store_format": 1,
     "arrays": {"<name>": {"file": "<name>.bin", "dtype": "int32", "shape": [E],
                           "bytes": 4E, "sha256": "<hex>"}, ...},
     "scalars": {...}}

Arrays are written in chunks (:class:`StoreWriter`, :meth:`StoreWriter.array`), so a
producer never needs a whole array in memory, and hashed as they are written. The
folder is built under a temporary name beside its final place and moved there with
``os.replace`` once the manifest is written: an interrupted write leaves no store, only
a temporary folder that is removed. :func:`open_store` checks every file's size against
its manifest (a truncated file is caught without reading it) and, with ``verify``, its
SHA-256 (reads every byte once, sequentially); it then memory-maps each file
copy-on-write (``torch.from_file(shared=False)``: pages are read when first touched,
writes stay private to the process). Any problem raises :class:`StoreError` with the
reason. Dtypes are stored by name (any torch dtype: the store does not care what the
arrays hold).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

__all__ = ["STORE_FORMAT", "MANIFEST", "StoreError", "StoreWriter", "ArrayWriter", "write_store",
           "open_store", "clear_path", "gather_rows"]

STORE_FORMAT = 1
MANIFEST = "manifest.json"
_WRITE_CHUNK = 1 << 26  # bytes per write/hash step


class StoreError(Exception):
    """A store that must not be used; the message says why."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise StoreError(f"records an unknown dtype {name!r}")
    return dtype


class ArrayWriter:
    """Appends row chunks of one array to its file, hashing them on the way.

    Args:
        path: the file.
        dtype: the array's dtype (each chunk is cast to it).
        row_shape: the shape of one row (``()`` for a vector)."""

    def __init__(self, path: Path, dtype: torch.dtype, row_shape: tuple[int, ...] = ()) -> None:
        self.path, self.dtype, self.row_shape = Path(path), dtype, tuple(int(n) for n in row_shape)
        self.rows = 0
        self._hash = hashlib.sha256()
        self._fh = self.path.open("wb")

    def append(self, chunk) -> None:
        """Write ``chunk`` (a tensor or array of shape ``(n, *row_shape)``)."""
        t = torch.as_tensor(chunk) if not isinstance(chunk, np.ndarray) else torch.from_numpy(chunk)
        if tuple(t.shape[1:]) != self.row_shape:
            raise ValueError(f"{self.path.name}: chunk rows are {tuple(t.shape[1:])}, "
                             f"the array's are {self.row_shape}")
        t = t.to(self.dtype).contiguous()
        raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        for lo in range(0, len(raw), _WRITE_CHUNK):
            part = raw[lo:lo + _WRITE_CHUNK]
            self._fh.write(part)
            self._hash.update(part)
        self.rows += int(t.shape[0]) if t.dim() else 1

    def close(self) -> dict:
        """Flush, fsync and close; the manifest entry of the array."""
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        return {"file": self.path.name, "dtype": _dtype_name(self.dtype),
                "shape": [self.rows, *self.row_shape], "bytes": self.path.stat().st_size,
                "sha256": self._hash.hexdigest()}


def clear_path(path: Path) -> None:
    """Remove whatever is at ``path`` (file, link, folder)."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


class StoreWriter:
    """Builds a store at ``folder`` (a context manager): :meth:`array` opens one array's
    writer, :meth:`put` writes a whole tensor; leaving the ``with`` block without an
    error writes the manifest and moves the folder into place (replacing what was
    there); an error removes the temporary folder and leaves ``folder`` untouched."""

    def __init__(self, folder: str | Path, scalars: dict | None = None) -> None:
        self.folder = Path(folder)
        self.scalars = dict(scalars or {})
        self._writers: dict[str, ArrayWriter] = {}
        self._entries: dict[str, dict] = {}
        self._tmp: Path | None = None

    def __enter__(self) -> "StoreWriter":
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(dir=self.folder.parent, prefix=f".{self.folder.name}.",
                                          suffix=".tmp"))
        return self

    def array(self, name: str, dtype: torch.dtype, row_shape: tuple[int, ...] = ()) -> ArrayWriter:
        """A writer for array ``name`` (closed and recorded when the store is finished)."""
        if name in self._writers or name in self._entries:
            raise ValueError(f"array {name!r} written twice")
        writer = ArrayWriter(self._tmp / f"{name}.bin", dtype, row_shape)
        self._writers[name] = writer
        return writer

    def put(self, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None,
            chunk_rows: int = 1 << 22) -> None:
        """Write all of ``tensor`` as array ``name`` (cast to ``dtype``, chunk by chunk)."""
        writer = self.array(name, dtype or tensor.dtype, tuple(tensor.shape[1:]))
        for lo in range(0, max(int(tensor.shape[0]), 1), chunk_rows):
            writer.append(tensor[lo:lo + chunk_rows])
        self._entries[name] = writer.close()
        del self._writers[name]

    def __exit__(self, kind, value, tb) -> None:
        try:
            if kind is not None:
                return
            for name, writer in self._writers.items():
                self._entries[name] = writer.close()
            manifest = {"store_format": STORE_FORMAT, "arrays": self._entries, "scalars": self.scalars}
            with (self._tmp / MANIFEST).open("w", encoding="utf-8") as fh:
                json.dump(manifest, fh, indent=1, sort_keys=True)
                fh.flush()
                os.fsync(fh.fileno())
            for entry in [*self._tmp.iterdir()]:
                os.chmod(entry, 0o644)
            os.chmod(self._tmp, 0o755)
            clear_path(self.folder)
            os.replace(self._tmp, self.folder)
        finally:
            for writer in self._writers.values():
                if not writer._fh.closed:
                    writer._fh.close()
            if self._tmp is not None and self._tmp.exists():
                shutil.rmtree(self._tmp, ignore_errors=True)


def write_store(folder: str | Path, arrays: dict[str, torch.Tensor], scalars: dict) -> None:
    """Write ``arrays`` (name -> tensor, stored in its own dtype) and ``scalars`` (JSON
    values) as a store at ``folder``, atomically."""
    with StoreWriter(folder, scalars) as w:
        for name, tensor in arrays.items():
            w.put(name, tensor)


def _sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _map(path: Path, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_file(str(path), shared=False, size=numel, dtype=dtype).view(*shape)


def open_store(folder: str | Path, *, verify: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """``(arrays, scalars)`` of the store at ``folder``, each array memory-mapped.

    Raises:
        StoreError: not a folder, no readable manifest, a foreign format, a missing or
            truncated file, or (with ``verify``) a file whose SHA-256 differs from its
            manifest's."""
    folder = Path(folder)
    if not folder.is_dir() or folder.is_symlink():
        raise StoreError("is not a store folder")
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        entries, scalars = manifest["arrays"], manifest["scalars"]
        fmt = manifest["store_format"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise StoreError(f"has no readable manifest ({MANIFEST}: {err})") from None
    if fmt != STORE_FORMAT:
        raise StoreError(f"has store format {fmt!r}, this betty reads {STORE_FORMAT}")
    arrays: dict[str, torch.Tensor] = {}
    for name, entry in entries.items():
        path = folder / entry["file"]
        if "/" in entry["file"] or not path.is_file():
            raise StoreError(f"lacks its file {entry['file']}")
        dtype = _dtype(entry["dtype"])
        want = int(np.prod(entry["shape"], dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        size = path.stat().st_size
        if size != want or entry["bytes"] != want:
            raise StoreError(f"has {entry['file']} of {size} bytes, its manifest records {want}")
        if verify and _sha256(path) != entry["sha256"]:
            raise StoreError(f"content of {entry['file']} differs from its recorded SHA-256")
        arrays[name] = _map(path, dtype, entry["shape"])
    return arrays, scalars


def gather_rows(table: torch.Tensor, ids: torch.Tensor, chunk_rows: int = 1 << 16) -> torch.Tensor:
    """``table[ids]``, reading ``table``'s rows in ascending order, ``chunk_rows`` at a time.

    For a memory-mapped ``table`` (features on disk) an unsorted gather touches pages in
    random order; here the IDs are sorted once (``order = argsort(ids)``, stable) and
    row blocks ``table[ids[order[a:b]]]`` are read in that order and scattered to their
    places, so the file is read front to back and only one chunk's gather is in flight.
    Shapes: ``table (N, ...)``, ``ids (n,)`` integer; returns ``(n, ...)`` in ``table``'s
    dtype, equal to ``table[ids]`` bit for bit."""
    ids = torch.as_tensor(ids, dtype=torch.int64)
    out = torch.empty((ids.numel(), *table.shape[1:]), dtype=table.dtype)
    if ids.numel() == 0:
        return out
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    for lo in range(0, ids.numel(), chunk_rows):
        at = order[lo:lo + chunk_rows]
        out[at] = table[sorted_ids[lo:lo + chunk_rows]]
    return out
