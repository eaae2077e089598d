"""betty's on-disk array store: a folder of raw arrays and a ``manifest.json``.

One store is a folder holding one raw file per array (``<name>.bin``: the array's bytes
in C order, native little-endian, no header) and ``manifest.json``::

    {"store_format": 1,
     "arrays": {"<name>": {"file": "<name>.bin", "dtype": "int32", "shape": [E],
                           "bytes": 4E, "sha256": "<hex>"}, ...},
     "scalars": {...}, "scalars_sha256": "<hex>"}

(``scalars_sha256``: of the scalars as sorted-key compact JSON, :func:`scalars_digest`.)

Arrays are written in chunks (:class:`StoreWriter`, :meth:`StoreWriter.array`), so a
producer never needs a whole array in memory, and hashed as they are written. The
folder is built under a temporary name beside its final place and moved there with
``os.replace`` once the manifest is written: an interrupted write leaves no store, only
a temporary folder that is removed; one a killed writer left is removed by the next
writer in that place (it is named after its owner, :mod:`betty.owner`). A store another
writer moved into that place after this one began stands: two writers of one place
write the same content, and the one done first may already be mapped.

:func:`open_store` always checks that the manifest is complete and consistent (its
scalars against their SHA-256 too) and every file's size against it (a truncated file
is caught without reading it). It hashes a file (SHA-256, one sequential read) only
when the folder's stamp, ``verified.json``, does not vouch for it::

    {"stamp_format": 1,
     "files": {"<name>.bin": {"sha256": "<hex>", "bytes": n, "mtime_ns": m,
                              "ctime_ns": c, "ino": i, "dev": d}, ...}}

A record vouches for a file when its ``sha256`` is the manifest's and the other fields
equal the file's ``stat`` now: any write, truncation, ``utime`` or replacement changes
``ctime`` (which cannot be set back) or the inode, so a file changed since it was last
hashed is hashed again; a missing, unreadable or foreign stamp vouches for nothing. After
hashing, the files that matched are stamped (the stamp is written to a temporary file
and moved into place; a folder that cannot be written to keeps hashing), except a file
last changed in the clock tick the hashing began in (it could change again unseen).
The stamp trusts the file system's metadata: it catches a changed, replaced or cut
file, not bytes that rot on a disk without a write (``verify="full"`` hashes every file
whatever the stamp says), nor someone who may write the folder (they could rewrite the
manifest as well). ``verify=False`` checks sizes only.

Each array is then memory-mapped copy-on-write (``MAP_PRIVATE``, and on Linux
``MAP_NORESERVE`` so that files larger than the machine's memory map: pages are read
when first touched, writes stay private to the process). Any problem
raises :class:`StoreError` with the reason. Dtypes are stored by name (any torch dtype:
the store does not care what the arrays hold).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import mmap
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from betty.indexing import argsort_runs, put_rows, take_rows
from betty.owner import Owner, reclaim_stale_folders
from betty.pages import prefetch_rows, release_rows
from betty.workers import parallel_map

__all__ = ["STORE_FORMAT", "MANIFEST", "STAMP", "StoreError", "StoreWriter", "ArrayWriter", "write_store",
           "verify_mode", "scalars_digest", "open_store", "clear_path", "gather_rows"]

STORE_FORMAT = 1
MANIFEST = "manifest.json"
STAMP = "verified.json"
STAMP_FORMAT = 1
_WRITE_CHUNK = 1 << 26  # bytes per write/hash step


class StoreError(Exception):
    """A store that must not be used; the message says why."""


def scalars_digest(scalars: dict) -> str:
    """SHA-256 (hex) of ``scalars`` as sorted-key compact JSON: what the manifest records
    of its scalars, which no file's hash covers."""
    return hashlib.sha256(json.dumps(scalars, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


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
    error writes the manifest and moves the folder into place, replacing what was there
    unless another writer finished a store there after this one began (that store
    stands: see the module docstring); an error removes the temporary folder and leaves
    ``folder`` untouched."""

    def __init__(self, folder: str | Path, scalars: dict | None = None) -> None:
        self.folder = Path(folder)
        self.scalars = dict(scalars or {})
        self._writers: dict[str, ArrayWriter] = {}
        self._entries: dict[str, dict] = {}
        self._tmp: Path | None = None

    def __enter__(self) -> "StoreWriter":
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        # the temporary folders of writers killed before they could remove them (the
        # parent may be on a disk other machines share: only this boot's are judged)
        reclaim_stale_folders(str(self.folder.parent), this_boot_only=True)
        self._tmp = Path(tempfile.mkdtemp(dir=self.folder.parent, prefix=Owner.current().prefix(self.folder.name),
                                          suffix=".tmp"))
        self._began = self._tmp.stat().st_ctime_ns  # the file system's clock, as the manifests'
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
            manifest = {"store_format": STORE_FORMAT, "arrays": self._entries, "scalars": self.scalars,
                        "scalars_sha256": scalars_digest(self.scalars)}
            with (self._tmp / MANIFEST).open("w", encoding="utf-8") as fh:
                json.dump(manifest, fh, indent=1, sort_keys=True)
                fh.flush()
                os.fsync(fh.fileno())
            for entry in [*self._tmp.iterdir()]:
                os.chmod(entry, 0o644)
            os.chmod(self._tmp, 0o755)
            if self._finished_meanwhile():
                return
            clear_path(self.folder)
            try:
                os.replace(self._tmp, self.folder)
            except OSError as err:  # another writer of this entry finished in between: its entry stands
                if err.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not (self.folder / MANIFEST).is_file():
                    raise
        finally:
            for writer in self._writers.values():
                if not writer._fh.closed:
                    writer._fh.close()
            if self._tmp is not None and self._tmp.exists():
                shutil.rmtree(self._tmp, ignore_errors=True)

    def _finished_meanwhile(self) -> bool:
        """Whether another writer moved a store into ``folder`` after this one began:
        its manifest was written in a later tick of the file system's clock (a store that
        was there before, damaged or superseded, is replaced, as is one written in the
        very tick this writer began: a writer that began then has yet to write all of
        its arrays, long after the other's store has been loaded)."""
        try:
            written = (self.folder / MANIFEST).stat().st_mtime_ns
        except OSError:
            return False
        return self.folder.is_dir() and not self.folder.is_symlink() and written > self._began


def write_store(folder: str | Path, arrays: dict[str, torch.Tensor], scalars: dict) -> None:
    """Write ``arrays`` (name -> tensor, stored in its own dtype) and ``scalars`` (JSON
    values) as a store at ``folder``, atomically."""
    with StoreWriter(folder, scalars) as w:
        for name, tensor in arrays.items():
            w.put(name, tensor)


def _sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


#: ``mmap(2)``'s ``MAP_NORESERVE`` on Linux (Python's ``mmap`` module names it from 3.13 on)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def _map(path: Path, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """The array at ``path`` mapped copy-on-write (``MAP_PRIVATE``): pages are read from
    the file when first touched, writes stay private to the process. On Linux the
    mapping is ``MAP_NORESERVE``: no swap is reserved for the pages a process might
    write, so a file larger than the machine's memory maps (the kernel's overcommit
    check refuses a writable private mapping beyond memory + swap otherwise)."""
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if not _MAP_NORESERVE:
        return torch.from_file(str(path), shared=False, size=numel, dtype=dtype).view(*shape)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    with path.open("rb") as fh:
        mapped = mmap.mmap(fh.fileno(), nbytes, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
    # the tensor keeps ``mapped`` alive; the mapping outlives the closed file
    return torch.frombuffer(mapped, dtype=dtype, count=numel).view(*shape)


def verify_mode(verify: bool | str) -> str:
    """The check :func:`open_store` makes for ``verify``: ``"stamp"`` for ``True``,
    ``"size"`` for ``False``, ``"full"`` for ``"full"``; ``ValueError`` for anything else."""
    if verify is True:
        return "stamp"
    if verify is False:
        return "size"
    if verify == "full":
        return "full"
    raise ValueError(f"verify={verify!r} (allowed: True, False, 'full')")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _checked_entries(manifest) -> tuple[dict[str, dict], dict]:
    """``(entries, scalars)`` of a parsed manifest, every entry complete and consistent:
    a plain file name (no folder, not hidden, not one of the store's own files, each
    used once), a known dtype, a shape of counts, ``bytes`` = numel x item size and a
    64-digit hex SHA-256."""
    if not isinstance(manifest, dict) or not {"store_format", "arrays", "scalars"} <= manifest.keys():
        raise StoreError(f"has no readable manifest ({MANIFEST}: not an object with store_format, "
                         f"arrays and scalars)")
    fmt = manifest["store_format"]
    if fmt != STORE_FORMAT:
        raise StoreError(f"has store format {fmt!r}, this betty reads {STORE_FORMAT}")
    entries, scalars = manifest["arrays"], manifest["scalars"]
    if not isinstance(entries, dict) or not isinstance(scalars, dict):
        raise StoreError(f"has no readable manifest ({MANIFEST}: arrays and scalars are not objects)")
    if manifest.get("scalars_sha256") != scalars_digest(scalars):
        raise StoreError(f"has scalars that do not match their recorded SHA-256 ({MANIFEST}: damaged, or "
                         "written without scalars_sha256)")
    files: set[str] = set()
    for name, entry in entries.items():
        def bad(why: str) -> StoreError:
            return StoreError(f"has a malformed manifest entry for array {name!r} ({why})")
        if not isinstance(entry, dict) or not {"file", "dtype", "shape", "bytes", "sha256"} <= entry.keys():
            raise bad("needs file, dtype, shape, bytes and sha256")
        file = entry["file"]
        if (not isinstance(file, str) or not file or file != Path(file).name or "\\" in file
                or file.startswith(".") or file in (MANIFEST, STAMP) or file in files):
            raise bad(f"file {file!r} is not a plain, unused file name")
        files.add(file)
        dtype = _dtype(entry["dtype"])
        shape = entry["shape"]
        if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
            raise bad(f"shape {shape!r} is not a list of counts")
        digest = entry["sha256"]
        if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= set("0123456789abcdef"):
            raise bad(f"sha256 {digest!r} is not 64 hex digits")
        if not _is_count(entry["bytes"]):
            raise bad(f"bytes {entry['bytes']!r} is not a count")
        want = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        if entry["bytes"] != want:
            raise bad(f"bytes {entry['bytes']} for a {_dtype_name(dtype)} array of shape {shape}: "
                      f"{want} expected")
    return entries, scalars


def _file_identity(st: os.stat_result) -> dict:
    """What a stamp records of a file's state: any write, truncation, ``utime``, chmod
    or replacement changes at least one of these (``ctime`` cannot be set back)."""
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "ino": st.st_ino, "dev": st.st_dev}


def _read_stamp(folder: Path) -> dict:
    """``file name -> record`` of the folder's stamp; ``{}`` when it is absent or unreadable."""
    try:
        if not (folder / STAMP).is_file():  # absent, or no file to read (a FIFO would block)
            return {}
        stamp = json.loads((folder / STAMP).read_text(encoding="utf-8"))
        if not isinstance(stamp, dict) or stamp.get("stamp_format") != STAMP_FORMAT:
            return {}
        files = stamp["files"]
        return files if isinstance(files, dict) else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


class _Stamper:
    """Writes the stamp of the files hashed in one :func:`open_store`, atomically.

    Its temporary file is created before any hashing; that file's ``ctime`` (``t0``,
    from the file system's own clock) bounds what may be stamped: a file whose
    ``ctime`` is not older than ``t0`` changed after the hashing began or in the same
    clock tick (and could change again without a new ``ctime``), so it is left out
    (hashed again next time). A folder that cannot be written to gets no stamp."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.records = folder, {}
        try:
            fd, name = tempfile.mkstemp(dir=folder, prefix=f".{STAMP}.", suffix=".tmp")
        except OSError:
            self.tmp = None
            return
        self.tmp, self.fh = Path(name), os.fdopen(fd, "w", encoding="utf-8")
        self.t0 = os.fstat(fd).st_ctime_ns

    def record(self, file: str, digest: str, st: os.stat_result) -> None:
        """Stamp ``file`` as matching ``digest`` in state ``st`` (its ``stat`` after it was
        hashed), if that state is older than ``t0``: then the file did not change since
        the hashing began, and any later change moves its ``ctime`` to ``t0`` or later."""
        if self.tmp is not None and st.st_ctime_ns < self.t0:
            self.records[file] = {"sha256": digest, **_file_identity(st)}

    def commit(self, kept: dict) -> None:
        """Write ``kept`` (records still valid) with the new ones as the folder's stamp."""
        if self.tmp is None:
            return
        try:
            json.dump({"stamp_format": STAMP_FORMAT, "files": {**kept, **self.records}},
                      self.fh, indent=1, sort_keys=True)
            self.fh.flush()
            os.fsync(self.fh.fileno())
            self.fh.close()
            os.chmod(self.tmp, 0o644)
            os.replace(self.tmp, self.folder / STAMP)
        except OSError:
            pass
        finally:
            self.discard()

    def discard(self) -> None:
        """Remove the temporary file, if it is still there."""
        if self.tmp is not None:
            if not self.fh.closed:
                self.fh.close()
            self.tmp.unlink(missing_ok=True)
            self.tmp = None


def open_store(folder: str | Path, *, verify: bool | str = True) -> tuple[dict[str, torch.Tensor], dict]:
    """``(arrays, scalars)`` of the store at ``folder``, each array memory-mapped.

    Always checks that the manifest is complete and consistent and that every file is
    there with its recorded size (nothing is read from the files for that). Then, by
    ``verify``:

    * ``True``: hashes each file that the folder's stamp (:data:`STAMP`) does not record
      as matching its manifest SHA-256 in its current state (size, mtime, ctime, inode,
      device), and stamps the files that matched;
    * ``"full"``: hashes every file and stamps them;
    * ``False``: hashes nothing (for a store just written, hashed on the way).

    Raises:
        StoreError: not a folder, no readable or a malformed manifest, a foreign format,
            a missing or truncated file, or a hashed file whose SHA-256 differs from its
            manifest's.
        ValueError: ``verify`` is none of ``True``, ``False``, ``"full"``."""
    mode = verify_mode(verify)
    folder = Path(folder)
    if not folder.is_dir() or folder.is_symlink():
        raise StoreError("is not a store folder")
    try:
        if not (folder / MANIFEST).is_file():  # reading a FIFO or a device would block or never end
            raise OSError(f"{MANIFEST} is missing or not a regular file")
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise StoreError(f"has no readable manifest ({MANIFEST}: {err})") from None
    entries, scalars = _checked_entries(manifest)
    stats: dict[str, os.stat_result] = {}
    for name, entry in entries.items():
        path = folder / entry["file"]
        if not path.is_file():
            raise StoreError(f"lacks its file {entry['file']}")
        stats[name] = path.stat()
        if stats[name].st_size != entry["bytes"]:
            raise StoreError(f"has {entry['file']} of {stats[name].st_size} bytes, "
                             f"its manifest records {entry['bytes']}")
    if mode != "size":
        stamp = _read_stamp(folder) if mode == "stamp" else {}
        kept = {entry["file"]: stamp[entry["file"]] for name, entry in entries.items()
                if stamp.get(entry["file"]) == {"sha256": entry["sha256"], **_file_identity(stats[name])}}
        todo = [name for name, entry in entries.items() if entry["file"] not in kept]
        if todo:
            stamper = _Stamper(folder)
            try:
                for name in todo:
                    entry, path = entries[name], folder / entries[name]["file"]
                    if _sha256(path) != entry["sha256"]:
                        raise StoreError(f"content of {entry['file']} differs from its recorded SHA-256")
                    stamper.record(entry["file"], entry["sha256"], path.stat())
                stamper.commit(kept)
            finally:
                stamper.discard()
    arrays = {name: _map(folder / entry["file"], _dtype(entry["dtype"]), entry["shape"])
              for name, entry in entries.items()}
    return arrays, scalars


def gather_rows(table: torch.Tensor, ids: torch.Tensor, chunk_rows: int = 1 << 16, *,
                pin: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """``table[ids]``, reading ``table``'s rows in ascending order, ``chunk_rows`` at a time.

    For a memory-mapped ``table`` (features on disk) an unsorted gather touches pages in
    random order; here the IDs are sorted once (``order = argsort(ids)``, stable) and
    row blocks ``table[ids[order[a:b]]]`` are read in that order and scattered to their
    places, so the file is read front to back. For a ``table`` read out of core
    (:func:`betty.pages.out_of_core`) each chunk's pages are asked for while the chunk
    before is gathered
    (:func:`betty.pages.prefetch_rows`) and handed back once it is
    (:func:`betty.pages.release_rows`): the process holds about two chunks of the file,
    whatever ``n``. The chunks are spread over the
    preparation threads (:func:`betty.workers.parallel_map`), each reading its own
    stretch of the file; with one thread one chunk's gather is in flight at a time.
    A ``table`` that is not a tensor (rows read by ID from a graph store,
    :class:`betty.backends.distdgl.store.DistRows`) is read with ``table[ids]``.
    Shapes: ``table (N, ...)``, ``ids (n,)`` integer; returns ``(n, ...)`` in ``table``'s
    dtype, equal to ``table[ids]`` bit for bit; in pinned (page-locked) host memory with
    ``pin`` (needs CUDA), for a ``non_blocking`` copy to the device. ``out``: a buffer
    to reuse (a kept one costs no new pages): where its storage holds ``(n, ...)`` rows
    they are written there (the result is a view of that storage), else into a new
    buffer with room for ``n + n // 8`` rows (pinned as ``out`` is), so that a buffer
    kept for the next batch's rows, which vary a little, is seldom outgrown."""
    ids = torch.as_tensor(ids, dtype=torch.int64)
    if not isinstance(table, torch.Tensor):  # rows read by ID from elsewhere (a graph store)
        rows = table[ids]
        return rows.pin_memory() if pin else rows
    shape = (ids.numel(), *table.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=table.dtype, pin_memory=pin)
    elif out.dtype != table.dtype:
        raise ValueError(f"out is {out.dtype}, the table {table.dtype}")
    elif out.untyped_storage().nbytes() >= math.prod(shape) * table.element_size():
        out = table.new_empty(0).set_(out.untyped_storage(), 0, shape)
    else:
        room = torch.empty((shape[0] + shape[0] // 8, *shape[1:]), dtype=table.dtype,
                           pin_memory=pin or out.is_pinned())
        out = room[:shape[0]]
    if ids.numel() == 0:
        return out
    order = argsort_runs(ids)  # a micro-batch's IDs: a few ascending runs
    sorted_ids = ids[order]
    prefetch_rows(table, sorted_ids[:chunk_rows])

    def gather(lo: int) -> None:  # the chunks write disjoint rows of ``out``
        hi = min(lo + chunk_rows, ids.numel())
        prefetch_rows(table, sorted_ids[hi:hi + chunk_rows])  # the next chunk's pages, meanwhile
        put_rows(out, order[lo:hi], take_rows(table, sorted_ids[lo:hi]))
        release_rows(table, int(sorted_ids[lo]), int(sorted_ids[hi - 1]))

    parallel_map(gather, range(0, ids.numel(), chunk_rows))
    return out
