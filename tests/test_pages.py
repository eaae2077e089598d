"""Resident pages of memory-mapped arrays handed back to the page cache
(:mod:`betty.pages`): only clean file pages go, the values stay, and the sampler and the
Trainer release what they read of a stored dataset."""

from __future__ import annotations

import mmap
import sys
import time

import numpy as np
import pytest
import torch

from betty.data import load_dataset
from betty.engine import PartitionPlan, Trainer
from betty.models import build_model
from betty.pages import BLOCK_PAGES, release_pages, resident_bytes
from betty.sampling import sample_full_batch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/pagemap")

PAGE = mmap.PAGESIZE
OPTS = dict(num_nodes=20_000, avg_degree=10.0, num_communities=20, num_classes=4, num_features=16)


def _mapped(tmp_path, n: int) -> torch.Tensor:
    """An int64 file of ``0..n-1`` mapped copy-on-write, as the store maps its arrays."""
    path = tmp_path / "arr.bin"
    np.arange(n, dtype=np.int64).tofile(path)
    return torch.from_file(str(path), shared=False, size=n, dtype=torch.int64)


def test_clean_file_pages_are_released_and_read_back_unchanged(tmp_path):
    n = 3 * BLOCK_PAGES * PAGE // 8
    t = _mapped(tmp_path, n)
    total = int(t.sum())  # touches every page
    assert resident_bytes([t]) == n * 8
    assert release_pages([t]) == n * 8
    assert resident_bytes([t]) == 0
    assert int(t.sum()) == total and torch.equal(t[:5], torch.arange(5))


def test_a_block_holding_a_written_page_is_kept_whole(tmp_path):
    """A write to a copy-on-write mapping makes a private page: releasing it would lose
    the write, so its block stays resident; the other blocks go."""
    n = 3 * BLOCK_PAGES * PAGE // 8
    t = _mapped(tmp_path, n)
    t.sum()
    at = BLOCK_PAGES * PAGE // 8 + 7  # in the second block
    t[at] = -1
    assert release_pages([t]) == 2 * BLOCK_PAGES * PAGE
    # what stays is that block (the kernel may unmap its other pages at the write)
    assert 0 < resident_bytes([t]) <= BLOCK_PAGES * PAGE
    assert int(t[at]) == -1 and int(t[at + 1]) == at + 1


def test_anonymous_memory_is_never_released():
    t = torch.randn(3 * BLOCK_PAGES * PAGE // 4)
    copy = t.clone()
    assert release_pages([t, None, t]) == 0
    assert torch.equal(t, copy)
    assert resident_bytes([t]) >= t.numel() * 4 - 2 * PAGE


def test_the_sampler_hands_back_the_stored_csr_pages_it_read(tmp_path):
    plain = load_dataset("synthetic", root=tmp_path, cache=False, **OPTS)
    load_dataset("synthetic", root=tmp_path, **OPTS)  # writes the entry
    stored = load_dataset("synthetic", root=tmp_path, **OPTS)
    _, indices, eid = stored.graph.in_csr
    assert indices.numel() * 4 > 64 * PAGE  # enough pages to tell
    for seed in (0, 1):
        got = sample_full_batch(stored.graph, stored.train_idx, [5, 5], seed=seed)
        assert resident_bytes([indices, eid]) == 0
        want = sample_full_batch(plain.graph, plain.train_idx, [5, 5], seed=seed)
        for a, b in zip(got.layers, want.layers):
            for name in ("src_nid", "edge_src", "edge_dst", "edge_id"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_a_trainer_step_hands_back_the_feature_pages_it_read(tmp_path, monkeypatch):
    """A feature file read out of core (any mapped table, here) is gathered chunk by
    chunk and its pages handed back."""
    import betty.pages

    monkeypatch.setattr(betty.pages, "OUT_OF_CORE_FRACTION", 0.0)
    load_dataset("synthetic", root=tmp_path, **OPTS)
    ds = load_dataset("synthetic", root=tmp_path, **OPTS)
    assert ds.feat.numel() * 4 > 64 * PAGE
    torch.manual_seed(0)
    model = build_model("sage", ds.num_features, ds.num_classes, hidden=8, layers=2)
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), ds, [5, 5],
                      PartitionPlan("random", 2), seed=0)
    trainer.train_epoch(0)
    assert resident_bytes([ds.feat]) == 0


def _cached_pages(t: torch.Tensor) -> np.ndarray:
    """Per page of ``t``'s mapping, whether the page cache holds it (``mincore``)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    n = t.untyped_storage().nbytes() // PAGE
    vec = ctypes.create_string_buffer(n)
    assert libc.mincore(t.data_ptr(), n * PAGE, vec) == 0, ctypes.get_errno()
    return (np.frombuffer(vec.raw, dtype=np.uint8) & 1).astype(bool)


def test_prefetch_reads_the_pages_of_the_rows_asked_for(tmp_path, monkeypatch):
    """Rows of 1 KiB, every 37th asked for: the page cache then holds their pages and
    not the ones between (the kernel's own read-ahead around a fault would). The table
    is read out of core only when larger than the fraction of memory."""
    import os

    import betty.pages
    from betty.data.store import gather_rows
    from betty.pages import out_of_core, prefetch_rows

    n_rows, width = 64 * 1024, 128  # int64 rows of 1 KiB: 4 rows a page, 64 MiB
    path = tmp_path / "rows.bin"
    np.arange(n_rows * width, dtype=np.int64).tofile(path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    table = torch.from_file(str(path), shared=False, size=n_rows * width, dtype=torch.int64).view(n_rows, width)
    assert _cached_pages(table).sum() < 16
    ids = torch.arange(0, n_rows, 37)
    assert not out_of_core(table) and prefetch_rows(table, ids) == 0  # 64 MiB: fits in memory
    monkeypatch.setattr(betty.pages, "OUT_OF_CORE_FRACTION", 0.0)
    assert out_of_core(table)
    assert prefetch_rows(table, ids) == ids.numel()  # each row on a page of its own
    wanted = np.zeros(n_rows * width * 8 // PAGE, dtype=bool)
    wanted[ids.numpy() * width * 8 // PAGE] = True
    deadline = time.monotonic() + 10  # the reads are queued, not waited for (a loaded disk takes seconds)
    while not (cached := _cached_pages(table))[wanted].all() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cached[wanted].all()
    assert cached.sum() <= 2 * wanted.sum()
    rows = gather_rows(table, ids.flip(0), chunk_rows=100)
    assert torch.equal(rows, torch.arange(n_rows * width).view(n_rows, width)[ids.flip(0)])
    assert resident_bytes([table]) == 0


def test_prefetch_leaves_ordinary_memory_alone():
    from betty.pages import file_mapped, prefetch_rows, release_rows

    table = torch.arange(4096 * 8).view(4096, 8)
    copy = table.clone()
    assert not file_mapped(table)
    assert prefetch_rows(table, torch.tensor([3, 1])) == 0
    assert release_rows(table, 0, 4095) == 0
    assert torch.equal(table, copy)


@pytest.mark.parametrize("width,dtype", [(1, torch.int32), (128, torch.float32), (3, torch.float64),
                                         (1500, torch.float32)], ids=["csr", "rows", "straddling", "multi-page"])
@pytest.mark.parametrize("count", [5, 300, 60_000], ids=["sorted-path", "sorted-path-more", "counting-path"])
def test_page_runs_are_the_runs_of_the_pages_the_rows_lie_on(width, dtype, count):
    """Both ways of finding the runs (sorting few rows, counting many) give the runs of
    the set of pages every row touches, rows of any size (straddling two pages or many)."""
    from betty.pages import _page_runs

    n = 40_000 if width < 100 else 3_000
    table = torch.zeros((n, width) if width > 1 else (n,), dtype=dtype)
    ids = np.random.default_rng(count).integers(0, n, count)
    row = table[0].numel() * table.element_size() if width > 1 else table.element_size()
    start = table.data_ptr()
    pages = sorted({p for i in np.unique(ids).tolist()
                    for p in range((start + i * row) // PAGE, (start + (i + 1) * row - 1) // PAGE + 1)})
    pages = np.array(pages)
    breaks = np.flatnonzero(np.diff(pages) != 1)
    first, last = _page_runs(table, ids)
    assert np.array_equal(first, np.concatenate([pages[:1], pages[breaks + 1]]))
    assert np.array_equal(last, np.concatenate([pages[breaks], pages[-1:]]))
