"""Cora and CiteSeer from the real raw files: betty's own reader (no DGL), and the same
dataset as DGL's class builds (compared when DGL is installed).

The Planetoid files live in the read-only ``shared/data/planetoid`` beside the repository
or in ``/work/shared`` (``BETTY_PLANETOID_DIR`` overrides; see ``graphs.planetoid_dir``);
they are staged (symlinked) into a pytest tmp dir.
"""

from __future__ import annotations

import builtins
import time
from pathlib import Path

import pytest
import torch

from betty.data import DatasetNotFoundError, dgl_raw_path, load_dataset, stage_planetoid
from betty.data.planetoid import load_planetoid
from betty.graph import Graph

from graphs import planetoid_dir as find_planetoid_dir

PLANETOID = find_planetoid_dir()


@pytest.fixture(scope="module")
def planetoid_dir() -> Path:
    assert PLANETOID is not None, (
        "real Planetoid files not found beside the repository or in /work/shared "
        "(set BETTY_PLANETOID_DIR to the folder holding ind.cora.graph)"
    )
    return PLANETOID


@pytest.fixture(scope="module")
def staged_root(tmp_path_factory, planetoid_dir) -> Path:
    root = tmp_path_factory.mktemp("dgl_raw")
    stage_planetoid(planetoid_dir, root, "cora")
    stage_planetoid(planetoid_dir, root, "citeseer")
    return root


def test_staging_uses_dgl_folder_names(staged_root, planetoid_dir):
    cora = dgl_raw_path("cora", staged_root)
    assert cora == staged_root / "cora_v2_d697a464"
    assert dgl_raw_path("citeseer", staged_root) == staged_root / "citeseer_d6836239"
    link = cora / "ind.cora_v2.graph"
    assert link.is_symlink() and link.resolve() == (planetoid_dir / "ind.cora.graph").resolve()
    # staging again is harmless
    assert stage_planetoid(planetoid_dir, staged_root, "cora") == cora


def test_cora_matches_dgls_published_numbers(staged_root):
    ds = load_dataset("cora", root=staged_root)
    assert (ds.num_nodes, ds.num_edges, ds.num_classes) == (2708, 10556, 7)
    assert (ds.train_idx.numel(), ds.valid_idx.numel(), ds.test_idx.numel()) == (140, 500, 1000)
    assert ds.feat.shape == (2708, 1433) and ds.feat.dtype == torch.float32
    assert ds.label.dtype == torch.int64 and int(ds.label.max()) == 6
    assert ds.graph.idtype == torch.int64 and isinstance(ds.graph, Graph)
    src, dst = ds.graph.edges()
    assert set(zip(src.tolist(), dst.tolist())) == set(zip(dst.tolist(), src.tolist()))
    assert not ds.is_ogb and not ds.multilabel


def test_citeseer_matches_dgls_published_numbers(staged_root):
    ds = load_dataset("citeseer", root=staged_root)
    assert (ds.num_nodes, ds.num_edges, ds.num_classes) == (3327, 9228, 6)
    assert ds.train_idx.numel() == 120 and ds.feat.shape[1] == 3703


def test_copy_staging_loads_the_same_graph(tmp_path, planetoid_dir, staged_root):
    folder = stage_planetoid(planetoid_dir, tmp_path, "cora", symlink=False)
    assert not (folder / "ind.cora_v2.x").is_symlink()
    a = load_dataset("cora", root=tmp_path)
    b = load_dataset("cora", root=staged_root)
    assert torch.equal(a.feat, b.feat) and torch.equal(a.graph.edges()[0], b.graph.edges()[0])


def test_the_content_digest_follows_the_staged_files(tmp_path, planetoid_dir):
    """Not cached by betty, a DGL dataset's digest still names its files: one rewritten
    (a new size or time) is another dataset to the workflow's reuse."""
    import os

    from betty.data import cache_path, dataset_digest

    folder = stage_planetoid(planetoid_dir, tmp_path, "cora", symlink=False)
    before = dataset_digest("cora", tmp_path)
    assert dataset_digest("cora", tmp_path) == before and cache_path("cora", tmp_path) is None
    x = folder / "ind.cora_v2.x"
    st = x.stat()
    os.utime(x, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert dataset_digest("cora", tmp_path) != before


@pytest.mark.parametrize(
    "name, folder, a_file",
    [
        ("cora", "cora_v2_d697a464", "ind.cora_v2.x"),
        ("citeseer", "citeseer_d6836239", "ind.citeseer.graph"),
        ("pubmed", "pubmed_", "ind.pubmed.x"),
        ("reddit", "reddit_", "reddit_data.npz"),
    ],
)
def test_missing_dgl_dataset_fails_fast_naming_the_place(tmp_path, monkeypatch, name, folder, a_file):
    monkeypatch.setattr(builtins, "input", lambda *a: pytest.fail("prompted"))
    start = time.perf_counter()
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset(name, root=tmp_path)
    assert time.perf_counter() - start < 20  # fails fast: no download, no prompt
    msg = str(err.value)
    assert str(tmp_path / folder) in msg and a_file in msg
    if name == "cora":  # the files it asks for are the ones it reads: DGL's names for Cora's
        assert "as ind.cora_v2.{x," in msg and "(the ind.cora.* files, renamed)" in msg


def test_stage_planetoid_rejects_bad_input(tmp_path, planetoid_dir):
    with pytest.raises(ValueError, match="name='reddit'"):
        stage_planetoid(planetoid_dir, tmp_path, "reddit")
    with pytest.raises(FileNotFoundError, match="ind.cora.x"):
        stage_planetoid(tmp_path, tmp_path, "cora")


@pytest.mark.parametrize("victim, why", [("x", "not a readable Planetoid file"),
                                         ("graph", "not a readable Planetoid file"),
                                         ("test.index", "500 test node IDs for the 1000 rows")])
def test_a_damaged_raw_file_is_named(tmp_path, planetoid_dir, victim, why):
    """A raw file cut short (a broken download) is an error naming it, never a bare
    unpickling error nor, for ``test.index``, a dataset with half its test split."""
    import shutil

    for path in planetoid_dir.glob("ind.cora.*"):
        shutil.copy(path, tmp_path / path.name)
    damaged = tmp_path / f"ind.cora.{victim}"
    data = damaged.read_bytes()
    if victim == "test.index":  # its first 500 lines
        damaged.write_bytes(b"".join(data.splitlines(keepends=True)[:500]))
    else:
        damaged.write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=why) as err:
        load_planetoid(tmp_path, "cora")
    assert str(damaged) in str(err.value)


def test_reads_the_unstaged_files_directly(planetoid_dir, staged_root):
    a = load_planetoid(planetoid_dir, "cora")
    b = load_dataset("cora", root=staged_root)
    assert torch.equal(a.feat, b.feat) and torch.equal(a.label, b.label)
    assert torch.equal(a.graph.src, b.graph.src) and torch.equal(a.graph.dst, b.graph.dst)


@pytest.mark.dgl
@pytest.mark.parametrize("name", ["cora", "citeseer"])
def test_same_dataset_as_dgls_class(staged_root, name):
    """Features bit-equal, labels, split and edge set equal to DGL's CitationGraphDataset."""
    from betty.data.dgl_builtin import load_dgl_builtin

    ours, theirs = load_dataset(name, root=staged_root, cache=False), load_dgl_builtin(name, staged_root)
    assert torch.equal(ours.feat, theirs.feat) and torch.equal(ours.label, theirs.label)
    for split in ("train_idx", "valid_idx", "test_idx"):
        assert torch.equal(getattr(ours, split), getattr(theirs, split))
    assert ours.num_classes == theirs.num_classes

    def edge_set(ds):
        return set(zip(ds.graph.src.tolist(), ds.graph.dst.tolist()))

    assert ours.num_edges == theirs.num_edges and edge_set(ours) == edge_set(theirs)


def test_only_dgls_processed_file_is_not_enough_for_a_planetoid_dataset(tmp_path):
    """betty reads Planetoid's raw files itself: the pre-flight check must want them too
    (it passed on DGL's processed file alone, and the load failed later)."""
    from betty.data import check_available
    from betty.data.dgl_builtin import DGL_BUILTINS

    folder = dgl_raw_path("cora", tmp_path)
    folder.mkdir(parents=True)
    for name in DGL_BUILTINS["cora"].processed_files:
        (folder / name).write_bytes(b"DGL's own cache")
    with pytest.raises(DatasetNotFoundError, match="lacks"):
        check_available("cora", tmp_path)
