"""Pages of memory-mapped arrays: read ahead exactly where a gather needs them, and
handed back to the page cache once read.

A dataset store maps its arrays from files (:func:`betty.data.store.open_store`): a page
is read when first touched and then stays in the process's resident set (``RssFile``)
until the kernel reclaims it, so a sampler that touches 1 GiB of the in-CSR leaves the
process 1 GiB larger through the partition and the step that follow. Those pages are
clean copies of the file, kept in the page cache either way: dropping them from the
process's page tables (``madvise(MADV_DONTNEED)``) frees nothing the process needs, and
the next touch maps them again from the page cache, with no disk read while they stay
cached (the kernel maps a run of neighbouring cached pages per fault).

:func:`release_pages` does this only where it loses nothing. ``/proc/self/pagemap``
gives, per virtual page, whether it is resident (bit 63), swapped out (bit 62) and a
page of a file or of shared memory (bit 61). The storage is advised in blocks of
:data:`BLOCK_PAGES` pages, and a block only when none of its pages is swapped out and
every resident page is a file or shared page: a private anonymous page (ordinary
tensor memory, or a page of a copy-on-write mapping that the process wrote to) would be
lost, so a block holding one is left as it is. Only pages wholly inside the storage are
advised. Nothing may write to the storage while it is released (betty never writes to
the arrays it releases: the graph's in-CSR and the feature matrix).

Reading: a gather of rows scattered over a mapped file faults page by page, and at each
miss the kernel reads ahead around the faulting page, assuming a sequential reader: for
rows spread over a file larger than memory that reads most of the file for a few
percent of its rows (measured on a 37 GB feature file: 100,000 random rows, 49 MB of
them, read 34 GiB from the disk in 24 s). :func:`prefetch_rows` asks for exactly the
pages the rows lie on (``madvise(MADV_WILLNEED)`` on each run of consecutive pages,
which queues their reads at once), so that the gather finds them read: the same rows
then read 0.38 GiB in 0.9 s (:func:`betty.data.store.gather_rows` reads a mapped table
so, chunk by chunk, each chunk's pages asked for while the one before is gathered and
handed back once it is, :func:`release_rows`). A table of rows (2-D) is also advised ``MADV_RANDOM``
once: a page read ahead but evicted before the gather reaches it (memory is short when
the file is larger than memory) is then read alone at its fault; without it each such
miss read the kernel's read-around window again, and a training step over 4
micro-batches of about 0.9M rows each read 137 GiB of a 37 GB file.

Both of these cost CPU time where the file fits in memory with room to spare (the
asking, and the faults that map released pages again): they apply to tables
:func:`out_of_core`, a file-mapped table larger than :data:`OUT_OF_CORE_FRACTION` of the
machine's memory. A smaller one is read as any tensor (the page cache holds it after the
first epoch). :func:`release_pages` itself (one call per batch, as the sampler makes) is
cheap and applies to any mapped table.

Linux only; elsewhere (or without ``/proc/self/pagemap``) nothing is released or read
ahead.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from collections.abc import Iterable

import numpy as np
import torch

from betty.machine import machine_memory

__all__ = ["release_pages", "release_rows", "resident_bytes", "prefetch_rows", "file_mapped", "out_of_core",
           "BLOCK_PAGES", "OUT_OF_CORE_FRACTION"]

#: a file-mapped table larger than this fraction of the machine's memory is read
#: out of core (:func:`out_of_core`)
OUT_OF_CORE_FRACTION = 0.25
#: pages checked and advised together (32 MiB of address space at 4 KiB pages)
BLOCK_PAGES = 1 << 13
#: pages a fault maps beside the one it reads where they are cached (the kernel's
#: ``fault_around_bytes``, 64 KiB by default): a row span's release reaches that far
FAULT_AROUND_PAGES = 65536 // mmap.PAGESIZE
_MADV_RANDOM, _MADV_WILLNEED, _MADV_DONTNEED = 1, 3, 4
_PRESENT, _SWAPPED, _FILE_OR_SHARED = 1 << 63, 1 << 62, 1 << 61
_PAGE = mmap.PAGESIZE
_PAGEMAP = "/proc/self/pagemap"
_libc = None


def _madvise() -> "ctypes._CFuncPtr | None":
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return _libc.madvise


def _storage_pages(t: torch.Tensor) -> tuple[int, int] | None:
    """``(first page, page count)`` of the pages wholly inside ``t``'s storage."""
    storage = t.untyped_storage()
    addr, size = storage.data_ptr(), storage.nbytes()
    first = -(-addr // _PAGE)
    last = (addr + size) // _PAGE
    return (first, last - first) if last > first else None


def _spans(tensors: Iterable[torch.Tensor | None]) -> list[tuple[int, int]]:
    """The page spans (:func:`_storage_pages`) of the distinct CPU storages of
    ``tensors``."""
    spans, seen = [], set()
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        span = _storage_pages(t)
        if span is not None:
            spans.append(span)
    return spans


def _row_span(table: torch.Tensor, lo: int, hi: int) -> tuple[int, int] | None:
    """``(first page, page count)`` of the pages that rows ``lo..hi`` (inclusive) of the
    contiguous ``table`` lie on and the fault-around window either side, within those
    wholly inside its storage."""
    storage = _storage_pages(table)
    if storage is None:
        return None
    row = table[0].numel() * table.element_size() if table.dim() > 1 else table.element_size()
    start = table.data_ptr() + lo * row
    first = max(start // _PAGE - FAULT_AROUND_PAGES, storage[0])
    last = min((start + (hi - lo + 1) * row - 1) // _PAGE + FAULT_AROUND_PAGES, storage[0] + storage[1] - 1)
    return (first, last - first + 1) if last >= first else None


def _blocks(spans: list[tuple[int, int]]):
    """``(first page, page count, flags)`` per block of :data:`BLOCK_PAGES` pages of
    the page ``spans``, ``flags`` the blocks' ``(n,)`` uint64 pagemap entries; nothing
    off Linux."""
    if not spans or not sys.platform.startswith("linux") or not os.access(_PAGEMAP, os.R_OK):
        return
    with open(_PAGEMAP, "rb", buffering=0) as pagemap:
        for first, count in spans:
            for block in range(first, first + count, BLOCK_PAGES):
                n = min(BLOCK_PAGES, first + count - block)
                pagemap.seek(block * 8)
                flags = np.frombuffer(pagemap.read(n * 8), dtype=np.uint64)
                if flags.size != n:
                    break  # the range is not mapped here
                yield block, n, flags


def _present(flags: np.ndarray) -> np.ndarray:
    return (flags & np.uint64(_PRESENT)) != 0


def resident_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the resident pages wholly inside the storages of ``tensors`` (0 off
    Linux)."""
    return sum(int(_present(flags).sum()) for _, _, flags in _blocks(_spans(tensors))) * _PAGE


def release_pages(tensors: Iterable[torch.Tensor | None]) -> int:
    """Drop the resident file pages of each CPU tensor's storage from this process
    (see the module docstring for when a block of pages is left alone).

    Args:
        tensors: tensors (anything else, ``None`` say, skipped); each distinct storage
            is released once.

    Returns:
        Bytes of resident pages released (0 where nothing was, or off Linux).
    """
    return _release(_spans(tensors))


def release_rows(table: torch.Tensor, lo: int, hi: int) -> int:
    """:func:`release_pages` for the pages that rows ``lo..hi`` (inclusive) of a
    contiguous ``table`` read out of core (:func:`out_of_core`) lie on, and
    :data:`FAULT_AROUND_PAGES` either side (0 for any other table): what a gather of rows
    in that range mapped, without looking at the rest of the table."""
    if not out_of_core(table) or not table.is_contiguous() or hi < lo:
        return 0
    span = _row_span(table, lo, hi)
    return 0 if span is None else _release([span])


def _release(spans: list[tuple[int, int]]) -> int:
    released = 0
    for block, n, flags in _blocks(spans):
        present = _present(flags)
        resident = int(present.sum())
        if not resident or ((flags & np.uint64(_SWAPPED)) != 0).any():
            continue
        if (present & ((flags & np.uint64(_FILE_OR_SHARED)) == 0)).any():
            continue  # a private anonymous page would be lost
        if _madvise()(block * _PAGE, n * _PAGE, _MADV_DONTNEED) == 0:
            released += resident * _PAGE
    return released


_FILE_MAPPED: dict[tuple[int, int], bool] = {}
_RANDOM: dict[int, int] = {}  # row tables advised MADV_RANDOM: address -> bytes


def file_mapped(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage lies in a mapping of a file (``/proc/self/maps``; the
    answer is kept per storage address and size). ``False`` off Linux."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    storage = t.untyped_storage()
    key = (storage.data_ptr(), storage.nbytes())
    known = _FILE_MAPPED.get(key)
    if known is None:
        known = False
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    lo, _, hi = fields[0].partition("-")
                    if int(lo, 16) <= key[0] < int(hi, 16):
                        known = len(fields) == 6 and fields[5].startswith("/") and fields[4] != "0"
                        break
        except OSError:
            pass
        _FILE_MAPPED[key] = known
    return known


_RUN_CHUNK = 1 << 20  # IDs turned into page numbers at a time (bounds the temporaries)


def _page_runs(table: torch.Tensor, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(first, last)`` absolute page numbers of each run of consecutive pages that rows
    ``ids`` (any order, repeats allowed) of the contiguous ``table`` lie on.

    Each row covers pages ``a..b``. Few rows of a large table: the distinct rows sorted,
    a run starting where a row's ``a`` passes the row before's ``b + 1``; O(n log n).
    Many rows: ``+1`` at ``a`` and ``-1`` at ``b + 1`` counted by ``bincount`` over the
    table's pages (chunk by chunk, bounding the temporaries), whose running sum is
    positive exactly on the covered pages; O(n + table pages), no sort."""
    row = table[0].numel() * table.element_size() if table.dim() > 1 else table.element_size()
    start = table.data_ptr()
    base = start // _PAGE
    pages = (start + table.shape[0] * row - 1) // _PAGE - base + 1
    if ids.size * 32 < pages:
        rows = np.unique(ids)
        first = (start + rows * row) // _PAGE
        last = (start + (rows + 1) * row - 1) // _PAGE
        begins = np.flatnonzero(np.concatenate([[True], first[1:] > last[:-1] + 1]))
        ends = np.concatenate([begins[1:] - 1, [rows.size - 1]])
        return first[begins], last[ends]
    edges = np.zeros(pages + 1, dtype=np.int64)
    for lo in range(0, ids.size, _RUN_CHUNK):
        offset = start + ids[lo:lo + _RUN_CHUNK] * row
        edges += np.bincount(offset // _PAGE - base, minlength=pages + 1)
        edges -= np.bincount((offset + row - 1) // _PAGE - base + 1, minlength=pages + 1)
    covered = np.cumsum(edges[:-1]) > 0
    change = np.flatnonzero(np.diff(covered.view(np.int8), prepend=0, append=0))
    return change[0::2] + base, change[1::2] - 1 + base


def out_of_core(t: torch.Tensor) -> bool:
    """Whether ``t`` is read out of core: file-mapped (:func:`file_mapped`) and larger
    than :data:`OUT_OF_CORE_FRACTION` of the machine's memory."""
    if not file_mapped(t):
        return False
    return t.untyped_storage().nbytes() > OUT_OF_CORE_FRACTION * (machine_memory() or 0)


def prefetch_rows(table: torch.Tensor, ids: torch.Tensor) -> int:
    """Ask the kernel to read the pages that rows ``ids`` of a ``table`` read out of
    core (:func:`out_of_core`) lie on (see the module docstring); nothing for another
    table.

    Args:
        table: ``(N, ...)`` contiguous CPU tensor (a 1-D table's rows are its entries).
        ids: ``(n,)`` integer row IDs, any order.

    Returns:
        Runs of consecutive pages advised (0 where nothing was).
    """
    if not out_of_core(table) or ids.numel() == 0 or not table.is_contiguous():
        return 0
    run_starts, run_ends = _page_runs(table, np.asarray(ids, dtype=np.int64))
    start = table.data_ptr()
    madvise = _madvise()
    if table.dim() > 1 and _RANDOM.get(start) != table.untyped_storage().nbytes():
        # a table read by rows: a page missing at a fault (one read ahead but evicted
        # before its gather) is read alone, not with the kernel's read-around
        span = _storage_pages(table)
        if span is not None and madvise(span[0] * _PAGE, span[1] * _PAGE, _MADV_RANDOM) == 0:
            _RANDOM[start] = table.untyped_storage().nbytes()
    for lo, hi in zip(run_starts.tolist(), run_ends.tolist()):
        madvise(lo * _PAGE, (hi - lo + 1) * _PAGE, _MADV_WILLNEED)
    return int(run_starts.size)
