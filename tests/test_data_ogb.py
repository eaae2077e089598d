"""OGB datasets read offline from OGB's raw files with ogb's own raw readers (no DGL),
and the same graph as ogb's DglNodePropPredDataset builds (compared when DGL is installed).

Small graphs are written in OGB's raw on-disk layout (``tests/ogb_format.py``) under
the folder names OGB uses, so the real reader and betty's per-dataset processing run
exactly as they would on the downloaded files.
"""

from __future__ import annotations

import builtins
import time

import numpy as np
import pytest
import torch

from betty.data import DatasetNotFoundError, cache_path, load_dataset
from ogb_format import write_ogb_node_dataset
from betty.data.ogb_loader import _read_with_ogb, load_ogb, ogb_meta
from betty.graph import Graph

N = 10
# a ring 0->1->...->9->0, a chord 2->7, a self-loop 3->3, and 5->4 (reverse of 4->5)
EDGES = np.array(
    [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 7, 3, 4]]
)
SPLIT = {"train": np.array([0, 1, 2, 3]), "valid": np.array([4, 5]), "test": np.array([6, 7, 8, 9])}
FEAT = (np.arange(N * 3).reshape(N, 3) % 7) / 4.0  # exactly representable in CSV


@pytest.fixture(autouse=True)
def no_prompt(monkeypatch):
    """Any call to input() (OGB's download prompt) fails the test instead of blocking."""

    def forbidden(*_args, **_kwargs):
        raise AssertionError("input() was called: the loader would block on a prompt")

    monkeypatch.setattr(builtins, "input", forbidden)


def _pairs(src: torch.Tensor, dst: torch.Tensor) -> set[tuple[int, int]]:
    return set(zip(src.tolist(), dst.tolist()))


def _write(root, name, **kw):
    meta = ogb_meta(name)
    folder = root / "_".join(name.split("-"))
    args = dict(
        edge_index=EDGES,
        num_nodes=N,
        node_label=(np.arange(N) % 3)[:, None],
        split=SPLIT,
        split_name=meta["split"],
        node_feat=FEAT,
        binary=meta["binary"] == "True",
        version=int(meta["version"]),
    )
    args.update(kw)
    return write_ogb_node_dataset(folder, **args)


def test_products_self_loops_removed_inverse_edges_from_ogb(tmp_path):
    _write(tmp_path, "ogbn-products")
    ds = load_dataset("ogbn-products", root=tmp_path)
    src, dst = ds.graph.edges()
    directed = {(u, v) for u, v in EDGES.T.tolist() if u != v}
    # OGB adds the inverse of every stored edge for products (add_inverse_edge)
    assert _pairs(src, dst) == directed | {(v, u) for u, v in directed}
    assert not bool((src == dst).any())
    assert ds.graph.idtype == torch.int64 and isinstance(ds.graph, Graph)
    assert torch.equal(ds.feat, torch.tensor(FEAT, dtype=torch.float32))
    assert torch.equal(ds.label, torch.arange(N) % 3) and ds.label.dtype == torch.int64
    for part, idx in zip(("train", "valid", "test"), (ds.train_idx, ds.valid_idx, ds.test_idx)):
        assert torch.equal(idx, torch.as_tensor(SPLIT[part])) and idx.dtype == torch.int64
    assert (ds.is_ogb, ds.ogb_name, ds.multilabel, ds.num_classes) == (True, "ogbn-products", False, 47)


def test_arxiv_is_made_bidirected_without_duplicates(tmp_path):
    _write(tmp_path, "ogbn-arxiv", extra_node_files={"node_year": 2000 + np.arange(N)})
    ds = load_dataset("ogbn-arxiv", root=tmp_path)
    src, dst = ds.graph.edges()
    directed = {(u, v) for u, v in EDGES.T.tolist() if u != v}
    expected = directed | {(v, u) for u, v in directed}
    assert _pairs(src, dst) == expected
    assert ds.num_edges == len(expected)  # 4->5 and 5->4 were both stored: no duplicate
    assert ds.num_classes == 40 and ds.ogb_name == "ogbn-arxiv"


def test_proteins_features_are_mean_of_incident_edge_features(tmp_path):
    rng = np.random.default_rng(0)
    edge_feat = rng.integers(0, 9, size=(EDGES.shape[1], 8)) / 8.0
    labels = rng.integers(0, 2, size=(N, 112))
    _write(
        tmp_path,
        "ogbn-proteins",
        node_feat=None,
        edge_feat=edge_feat,
        node_label=labels,
        extra_node_files={"node_species": np.full(N, 3702)},
    )
    ds = load_dataset("ogbn-proteins", root=tmp_path)
    # reference: OGB stores each edge in both directions with the same features, so a
    # node's in-edges are all edges touching it (a self-loop touches it twice)
    expected = np.zeros((N, 8))
    count = np.zeros(N)
    for (u, v), f in zip(EDGES.T, edge_feat):
        for end in (u, v):
            expected[end] += f
            count[end] += 1
    expected /= count[:, None]
    assert torch.allclose(ds.feat, torch.tensor(expected, dtype=torch.float32), atol=1e-6)
    assert ds.multilabel and ds.num_classes == 112 and ds.ogb_name == "ogbn-proteins"
    assert ds.label.dtype == torch.float32 and torch.equal(ds.label, torch.tensor(labels, dtype=torch.float32))
    src, dst = ds.graph.edges()
    assert not bool((src == dst).any())


def test_papers100m_nan_labels_become_minus_one(tmp_path):
    labels = np.full((N, 1), np.nan)
    labelled = np.concatenate(list(SPLIT.values()))[:-1]  # node 9: in test, labelled below
    labels[labelled, 0] = labelled % 5
    labels[9, 0] = 171.0
    # an extra unlabelled node outside every split
    extra_split = {k: v for k, v in SPLIT.items()}
    extra_split["test"] = np.array([6, 7, 8, 9])
    _write(
        tmp_path,
        "ogbn-papers100M",
        num_nodes=N + 1,
        node_feat=np.vstack([FEAT, np.zeros((1, 3))]).astype(np.float32),
        node_label=np.vstack([labels, [[np.nan]]]),
        split=extra_split,
        extra_node_files={"node_year": 2000 + np.arange(N + 1)},
    )
    ds = load_dataset("ogbn-papers100M", root=tmp_path)
    assert ds.num_nodes == N + 1 and ds.label.dtype == torch.int64
    assert int(ds.label[N]) == -1  # unlabelled node
    assert ds.label[torch.as_tensor(labelled)].tolist() == (labelled % 5).tolist()
    assert int(ds.label[9]) == 171
    assert ds.num_classes == 172
    src, dst = ds.graph.edges()
    assert _pairs(src, dst) == _pairs(dst, src)  # bidirected


def test_papers100m_split_node_without_label_is_an_error(tmp_path):
    labels = np.zeros((N, 1))
    labels[SPLIT["train"][0], 0] = np.nan
    _write(
        tmp_path,
        "ogbn-papers100M",
        node_label=labels,
        node_feat=FEAT.astype(np.float32),
        extra_node_files={"node_year": 2000 + np.arange(N)},
    )
    with pytest.raises(ValueError, match="1 train/valid/test nodes have NaN labels"):
        load_dataset("ogbn-papers100M", root=tmp_path)


def test_custom_meta_dict_runs_the_same_processing(tmp_path):
    folder = tmp_path / "toy"
    write_ogb_node_dataset(
        folder,
        edge_index=EDGES,
        num_nodes=N,
        node_label=(np.arange(N) % 2)[:, None],
        split=SPLIT,
        split_name="custom",
        node_feat=FEAT,
    )
    meta = {
        **ogb_meta("ogbn-arxiv"),
        "dir_path": str(folder),
        "split": "custom",
        "additional node files": "None",
        "num classes": 2,
    }
    ds = load_ogb("toy-arxiv", tmp_path, meta_dict=meta, recipe="ogbn-arxiv")
    src, dst = ds.graph.edges()
    assert _pairs(src, dst) == _pairs(dst, src) and not bool((src == dst).any())
    assert ds.num_classes == 2 and ds.name == "toy-arxiv" and ds.ogb_name == "ogbn-arxiv"
    with pytest.raises(ValueError, match="recipe='toy'"):
        load_ogb("toy", tmp_path, meta_dict=meta)


def test_second_ogb_load_uses_betty_cache(tmp_path, monkeypatch):
    _write(tmp_path, "ogbn-products")
    first = load_dataset("ogbn-products", root=tmp_path)
    assert cache_path("ogbn-products", tmp_path).is_dir()
    import betty.data.ogb_loader as ogb_loader

    monkeypatch.setattr(ogb_loader, "load_ogb", lambda *a, **k: pytest.fail("not cached"))
    second = load_dataset("ogbn-products", root=tmp_path)
    assert torch.equal(first.feat, second.feat) and second.is_ogb
    # changed source files change the key
    before = cache_path("ogbn-products", tmp_path)
    _write(tmp_path, "ogbn-products", node_feat=FEAT + 1)
    assert cache_path("ogbn-products", tmp_path) != before


@pytest.mark.parametrize("name", ["ogbn-products", "ogbn-arxiv", "ogbn-proteins", "ogbn-papers100M"])
def test_missing_dataset_fails_fast_naming_the_place(tmp_path, name):
    start = time.perf_counter()
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset(name, root=tmp_path)
    assert time.perf_counter() - start < 20  # fails fast: no download, no prompt
    folder = tmp_path / "_".join(name.split("-"))
    msg = str(err.value)
    assert repr(name) in msg and str(folder) in msg and "RELEASE_v1.txt" in msg
    raw = "raw/data.npz" if name == "ogbn-papers100M" else "raw/edge.csv.gz"
    assert str(folder / raw) in msg
    assert str(folder / "split" / ogb_meta(name)["split"] / "train.csv.gz") in msg


def test_folder_without_release_file_does_not_prompt(tmp_path):
    folder = _write(tmp_path, "ogbn-products")
    (folder / "RELEASE_v1.txt").unlink()  # OGB would ask input() to update the dataset
    with pytest.raises(DatasetNotFoundError, match="RELEASE_v1.txt"):
        load_dataset("ogbn-products", root=tmp_path)


def test_partial_download_lists_only_missing_files(tmp_path):
    folder = _write(tmp_path, "ogbn-arxiv", extra_node_files={"node_year": 2000 + np.arange(N)})
    (folder / "raw" / "node-feat.csv.gz").unlink()
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("ogbn-arxiv", root=tmp_path)
    assert "node-feat.csv.gz" in str(err.value) and "edge.csv.gz" not in str(err.value)


def test_ogb_reader_itself_never_downloads(tmp_path, monkeypatch):
    """Even called directly, the reader only checks and reads local files: OGB's download
    helpers are never reached."""
    import ogb.utils.url as ogb_url

    monkeypatch.setattr(ogb_url, "download_url", lambda *a, **k: pytest.fail("downloaded"))
    meta = {**ogb_meta("ogbn-products"), "dir_path": str(tmp_path / "absent")}
    with pytest.raises(DatasetNotFoundError, match="edge.csv.gz"):
        _read_with_ogb("ogbn-products", tmp_path, meta)


@pytest.mark.dgl
@pytest.mark.parametrize("name", ["ogbn-products", "ogbn-proteins"])
@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")  # raised inside OGB's own class
def test_same_arrays_as_ogbs_dgl_class(tmp_path, name):
    """The raw reader gives OGB's DGL class's edge list (same order), features/edge
    features, labels and split."""
    from ogb.nodeproppred import DglNodePropPredDataset

    kw = {"edge_feat": np.arange(EDGES.shape[1] * 8).reshape(-1, 8) / 8.0, "node_feat": None,
          "node_label": (np.arange(N * 112).reshape(N, 112) % 2),
          "extra_node_files": {"node_species": np.full(N, 3702)}} if name == "ogbn-proteins" else {}
    _write(tmp_path, name, **kw)
    graph, labels, split, _ = _read_with_ogb(name, tmp_path, None)
    ref = DglNodePropPredDataset(name, root=str(tmp_path))
    g, ref_labels = ref[0]
    src, dst = g.edges()
    assert torch.equal(torch.as_tensor(graph["edge_index"][0]), src)
    assert torch.equal(torch.as_tensor(graph["edge_index"][1]), dst)
    key = "feat"
    ours = graph["edge_feat"] if name == "ogbn-proteins" else graph["node_feat"]
    theirs = g.edata[key] if name == "ogbn-proteins" else g.ndata[key]
    assert torch.equal(torch.as_tensor(ours), theirs)
    assert torch.equal(torch.as_tensor(labels), ref_labels)
    ref_split = ref.get_idx_split()
    for part in ("train", "valid", "test"):
        assert torch.equal(torch.as_tensor(split[part]), ref_split[part])


def test_split_dict_pt_with_numpy_arrays(tmp_path):
    """papers100M ships its split as split/time/split_dict.pt holding numpy arrays; it is
    read (torch >= 2.6 refuses numpy in its default weights-only load)."""
    folder = _write(tmp_path, "ogbn-papers100M", node_feat=FEAT.astype(np.float32),
                    extra_node_files={"node_year": 2000 + np.arange(N)})
    split_dir = next((folder / "split").iterdir())
    for part in ("train", "valid", "test"):
        (split_dir / f"{part}.csv.gz").unlink()
    swapped = {"train": SPLIT["test"], "valid": SPLIT["valid"], "test": SPLIT["train"]}
    torch.save({k: np.asarray(v, dtype=np.int64) for k, v in swapped.items()}, split_dir / "split_dict.pt")
    ds = load_dataset("ogbn-papers100M", root=tmp_path, cache=False)
    assert torch.equal(ds.train_idx, torch.as_tensor(SPLIT["test"]))
    assert torch.equal(ds.test_idx, torch.as_tensor(SPLIT["train"]))


def test_loading_warns_about_nothing(tmp_path):
    """No warning a user sees and cannot act on (e.g. torch's about the read-only arrays
    pandas returns), under Python's default filters (a library's DeprecationWarning,
    hidden by default, does not count). In a fresh process: torch gives that warning only
    once per process."""
    import os
    import subprocess
    import sys

    name = "ogbn-products"
    _write(tmp_path, name)
    code = ("from betty.data.ogb_loader import load_ogb; "
            f"load_ogb({name!r}, {str(tmp_path)!r})")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Warning" not in res.stderr, res.stderr[-2000:]


class _Payload:
    """Unpickling this runs ``open(marker, "w")``: what a crafted split_dict.pt does."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.open, (self.marker, "w"))


def _papers_folder_with_split(tmp_path, split) -> None:
    folder = _write(tmp_path, "ogbn-papers100M", node_feat=FEAT.astype(np.float32),
                    extra_node_files={"node_year": 2000 + np.arange(N)})
    split_dir = next((folder / "split").iterdir())
    for part in ("train", "valid", "test"):
        (split_dir / f"{part}.csv.gz").unlink()
    torch.save(split, split_dir / "split_dict.pt")


@pytest.mark.parametrize("where", ["value", "key"])
def test_crafted_split_dict_pt_runs_no_code(tmp_path, where):
    """A split_dict.pt carrying a pickle payload is refused and the payload never runs."""
    marker = tmp_path / "marker"
    split = {k: np.asarray(v) for k, v in SPLIT.items()}
    if where == "value":
        split["train"] = _Payload(marker)
    else:
        split["extra"] = [np.arange(2), _Payload(marker)]
    _papers_folder_with_split(tmp_path, split)
    with pytest.raises(ValueError, match="split_dict.pt: not a split of tensors or numpy arrays; refusing"):
        load_dataset("ogbn-papers100M", root=tmp_path, cache=False)
    assert not marker.exists()


def test_split_dict_pt_with_tensors(tmp_path):
    _papers_folder_with_split(tmp_path, {k: torch.as_tensor(v) for k, v in SPLIT.items()})
    ds = load_dataset("ogbn-papers100M", root=tmp_path, cache=False)
    assert torch.equal(ds.train_idx, torch.as_tensor(SPLIT["train"]))
    assert torch.equal(ds.valid_idx, torch.as_tensor(SPLIT["valid"]))


def test_split_dict_pt_of_floats_is_refused(tmp_path):
    _papers_folder_with_split(tmp_path, {k: np.asarray(v, dtype=np.float64) for k, v in SPLIT.items()})
    with pytest.raises(ValueError, match="split 'train' is not a 1-D array of integer node IDs"):
        load_dataset("ogbn-papers100M", root=tmp_path, cache=False)


def test_check_available_is_the_loaders_check_without_loading(tmp_path):
    """``betty.data.check_available``: the same error as the loader for missing files,
    quiet for files in place and for generated datasets."""
    from betty.data import check_available

    with pytest.raises(DatasetNotFoundError) as from_check:
        check_available("ogbn-arxiv", tmp_path)
    with pytest.raises(DatasetNotFoundError) as from_load:
        load_dataset("ogbn-arxiv", root=tmp_path)
    assert str(from_check.value) == str(from_load.value)
    _write(tmp_path, "ogbn-products")
    check_available("ogbn-products", tmp_path)
    check_available("synthetic", tmp_path, scale=0.5)
    with pytest.raises(DatasetNotFoundError, match="does not exist"):
        check_available("dgl-file", tmp_path, path=str(tmp_path / "none.bin"))
    with pytest.raises(DatasetNotFoundError, match="cora"):
        check_available("cora", tmp_path)
    with pytest.raises(ValueError, match="unknown option"):
        check_available("synthetic", tmp_path, colour="red")


def test_new_source_files_replace_the_old_entry_not_beside_it(tmp_path):
    """A re-extracted or copied source file (a new mtime) gives a new key: the entry of the
    old files, as large as the dataset, is removed once the new one is written, and an
    entry with other options stays."""
    import os

    from betty.data import cache_path

    _write(tmp_path, "ogbn-products")
    load_dataset("ogbn-products", root=tmp_path)
    load_dataset("ogbn-products", root=tmp_path, feature_dtype="bfloat16")  # other options: kept
    old = cache_path("ogbn-products", tmp_path)
    for path in (tmp_path / "ogbn_products" / "raw").iterdir():
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    new = cache_path("ogbn-products", tmp_path)
    assert new != old
    load_dataset("ogbn-products", root=tmp_path)
    entries = sorted(p.name for p in (tmp_path / "betty-cache").iterdir())
    assert new.name in entries and old.name not in entries and len(entries) == 2, entries
