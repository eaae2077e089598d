"""Reddit through DGL's own RedditDataset, offline, from small files in its raw layout."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from betty.data import dgl_raw_path, load_dataset


@pytest.mark.dgl
def test_reddit_layout_is_read_by_dgl_class(tmp_path):
    n = 9
    rows = np.array([0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 0])
    cols = np.array([1, 0, 2, 1, 4, 3, 6, 5, 8, 7, 8])
    folder = dgl_raw_path("reddit", tmp_path)
    folder.mkdir(parents=True)
    sp.save_npz(folder / "reddit_graph.npz", sp.coo_matrix((np.ones(rows.size), (rows, cols)), shape=(n, n)))
    original_id = np.arange(n, dtype=np.float32)
    feature = np.stack([original_id, original_id * 2], axis=1)
    np.savez(
        folder / "reddit_data.npz",
        feature=feature,
        label=np.arange(n) % 5,
        node_types=np.array([1, 1, 1, 1, 2, 2, 3, 3, 3]),  # 1 train, 2 valid, 3 test
    )
    ds = load_dataset("reddit", root=tmp_path)
    assert (ds.num_nodes, ds.num_edges, ds.num_classes) == (n, rows.size, 41)
    assert (ds.train_idx.numel(), ds.valid_idx.numel(), ds.test_idx.numel()) == (4, 2, 3)
    # DGL renumbers nodes (reverse Cuthill-McKee); features and labels move together
    orig = ds.feat[:, 0].long()
    assert torch.equal(ds.label, orig % 5)
    assert torch.equal(torch.sort(orig[ds.train_idx]).values, torch.arange(4))
    src, dst = ds.graph.edges()
    assert {(int(orig[s]), int(orig[d])) for s, d in zip(src, dst)} == set(zip(rows.tolist(), cols.tolist()))
    assert ds.graph.idtype == torch.int64 and ds.feat.dtype == torch.float32


def test_reddit_without_dgl_names_the_install_command(tmp_path, monkeypatch):
    import sys

    folder = dgl_raw_path("reddit", tmp_path)
    folder.mkdir(parents=True)
    for f in ("reddit_data.npz", "reddit_graph.npz"):
        (folder / f).write_bytes(b"")  # present, so the file check passes
    monkeypatch.setitem(sys.modules, "dgl", None)
    monkeypatch.setitem(sys.modules, "dgl.data", None)
    with pytest.raises(ImportError, match=r"pip install 'dgl==2.1.0'"):
        load_dataset("reddit", root=tmp_path)


def test_the_digest_names_the_raw_files_not_the_cache_dgl_writes_beside_them(tmp_path):
    """DGL writes its processed file into the raw folder on the first load: that must not
    make the data look new; a rewritten raw file must. Without raw files the processed
    file is the data."""
    import os

    from betty.data import dataset_digest

    folder = dgl_raw_path("reddit", tmp_path)
    folder.mkdir(parents=True)
    for name in ("reddit_data.npz", "reddit_graph.npz"):
        (folder / name).write_bytes(b"raw")
    before = dataset_digest("reddit", tmp_path)
    (folder / "dgl_graph.bin").write_bytes(b"processed by DGL")
    assert dataset_digest("reddit", tmp_path) == before
    st = (folder / "reddit_data.npz").stat()
    os.utime(folder / "reddit_data.npz", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert dataset_digest("reddit", tmp_path) != before
    (folder / "reddit_data.npz").unlink()
    (folder / "reddit_graph.npz").unlink()
    processed = dataset_digest("reddit", tmp_path)
    (folder / "dgl_graph.bin").write_bytes(b"processed again, longer")
    assert dataset_digest("reddit", tmp_path) != processed
