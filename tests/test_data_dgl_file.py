"""``dgl-file``: a graph saved with ``dgl.save_graphs`` using DGL's node-data names."""

from __future__ import annotations

import pytest
import torch

from betty.data import DatasetNotFoundError, load_dataset
from betty.graph import Graph

N = 8


def _graph(**ndata):
    import dgl

    src = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 1], dtype=torch.int32)
    dst = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0, 0], dtype=torch.int32)
    g = dgl.graph((src, dst), num_nodes=N, idtype=torch.int32)
    for k, v in ndata.items():
        g.ndata[k] = v
    return g


def _good_fields() -> dict:
    train = torch.zeros(N, dtype=torch.bool)
    train[:3] = True
    return {
        "feat": torch.arange(N * 4, dtype=torch.float64).reshape(N, 4),
        "label": torch.tensor([0, 1, 2, 0, 1, 2, 0, 1], dtype=torch.int32),
        "train_mask": train,
        "val_mask": torch.tensor([0, 0, 0, 1, 1, 0, 0, 0], dtype=torch.uint8),
        "test_mask": torch.tensor([0, 0, 0, 0, 0, 1, 1, 1], dtype=torch.int64),
    }


def _save(tmp_path, graphs, name="g.bin"):
    path = tmp_path / name
    import dgl

    dgl.save_graphs(str(path), graphs)
    return path


@pytest.mark.dgl
def test_good_file_is_converted_to_conventions(tmp_path):
    path = _save(tmp_path, [_graph(**_good_fields())])
    ds = load_dataset("dgl-file", path=path)
    assert ds.graph.idtype == torch.int64 and isinstance(ds.graph, Graph)
    src, dst = ds.graph.edges()
    assert src.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 1] and dst.tolist() == [1, 2, 3, 4, 5, 6, 7, 0, 0]
    assert ds.feat.dtype == torch.float32 and torch.equal(ds.feat, _good_fields()["feat"].float())
    assert ds.label.dtype == torch.int64 and ds.num_classes == 3
    assert ds.train_idx.tolist() == [0, 1, 2]
    assert ds.valid_idx.tolist() == [3, 4]
    assert ds.test_idx.tolist() == [5, 6, 7]
    assert ds.name == "dgl-file" and not ds.multilabel
    assert load_dataset("dgl-file", path=str(path), num_classes=5).num_classes == 5


@pytest.mark.dgl
def test_multilabel_file(tmp_path):
    fields = _good_fields()
    fields["label"] = (torch.arange(N * 3).reshape(N, 3) % 2).to(torch.float32)
    ds = load_dataset("dgl-file", path=_save(tmp_path, [_graph(**fields)]))
    assert ds.multilabel and ds.num_classes == 3 and ds.label.shape == (N, 3)


@pytest.mark.dgl
def test_ogb_shaped_class_ids_are_single_label(tmp_path):
    """``(N, 1)`` integer labels are class IDs as OGB stores them, not one 0/1 task; a
    float ``(N, 1)`` column stays one multi-label task."""
    fields = _good_fields()
    fields["label"] = fields["label"].reshape(N, 1).to(torch.int64)
    ds = load_dataset("dgl-file", path=_save(tmp_path, [_graph(**fields)]))
    assert not ds.multilabel and ds.num_classes == 3 and ds.label.shape == (N,)
    assert torch.equal(ds.label, _good_fields()["label"].long())
    fields["label"] = (fields["label"] % 2).float()
    ds = load_dataset("dgl-file", path=_save(tmp_path, [_graph(**fields)], "task.bin"))
    assert ds.multilabel and ds.num_classes == 1 and ds.label.shape == (N, 1)


@pytest.mark.dgl
def test_every_bad_field_is_named_with_its_expected_shape(tmp_path):
    fields = _good_fields()
    del fields["label"]
    fields["feat"] = torch.zeros(N)  # 1-D
    fields["val_mask"] = torch.rand(N)  # float mask
    fields["test_mask"] = torch.tensor([0, 2, 0, 0, 0, 1, 1, 1])  # not 0/1
    path = _save(tmp_path, [_graph(**fields)])
    with pytest.raises(ValueError) as err:
        load_dataset("dgl-file", path=path)
    msg = str(err.value)
    assert f"feat: got ({N},) torch.float32 (expected ({N}, F) floating point)" in msg
    assert f"label: missing (expected ({N},) or ({N}, 1) integer, or ({N}, T) 0/1)" in msg
    assert f"val_mask: got ({N},) torch.float32 (expected ({N},) bool or 0/1 integer)" in msg
    assert "test_mask: got" in msg
    assert "train_mask" not in msg


@pytest.mark.dgl
def test_float_single_label_and_too_small_num_classes_are_rejected(tmp_path):
    fields = _good_fields()
    fields["label"] = fields["label"].float()
    with pytest.raises(ValueError, match=r"label: got \(8,\) torch.float32"):
        load_dataset("dgl-file", path=_save(tmp_path, [_graph(**fields)]))
    good = _save(tmp_path, [_graph(**_good_fields())], "good.bin")
    with pytest.raises(ValueError, match="num_classes=2 but 'label' holds class 2"):
        load_dataset("dgl-file", path=good, num_classes=2)


@pytest.mark.dgl
def test_file_with_two_graphs_or_none(tmp_path):
    two = _save(tmp_path, [_graph(**_good_fields()), _graph(**_good_fields())])
    with pytest.raises(ValueError, match="exactly one graph, found 2"):
        load_dataset("dgl-file", path=two)
    with pytest.raises(DatasetNotFoundError, match="absent.bin"):
        load_dataset("dgl-file", path=tmp_path / "absent.bin")
    with pytest.raises(ValueError, match="needs option path="):
        load_dataset("dgl-file")
    with pytest.raises(ValueError, match=r"'feat'.*allowed options: path, num_classes"):
        load_dataset("dgl-file", path=two, feat="x")


def test_without_dgl_the_error_names_the_install_command(tmp_path, monkeypatch):
    import sys

    path = tmp_path / "g.bin"
    path.write_bytes(b"not read")
    monkeypatch.setitem(sys.modules, "dgl", None)  # import dgl raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'dgl==2.1.0'"):
        load_dataset("dgl-file", path=path)


@pytest.mark.dgl
def test_a_rewritten_file_has_another_digest_and_another_sample_stage_key(tmp_path):
    """Uncached as it is, the file's content digest follows the file: a graph rewritten
    at the same path is new data, so the sample stage (and through it the stages after)
    runs again instead of reusing results of the old graph."""
    import os

    from betty.data import dataset_digest
    from workflow.reuse import stage_key
    from workflow.specfile import resolve_spec

    path = _save(tmp_path, [_graph(**_good_fields())])
    rspec = resolve_spec({"name": "f", "dataset": {"name": "dgl-file", "path": str(path), "num_classes": 3},
                          "sampling": {"fanouts": [2, 2]}})
    before = dataset_digest("dgl-file", path=path, num_classes=3), stage_key(rspec, "sample", "d", "cpu")
    assert before == (dataset_digest("dgl-file", path=path, num_classes=3), stage_key(rspec, "sample", "d", "cpu"))
    fields = _good_fields()
    fields["feat"] = fields["feat"] + 1
    _save(tmp_path, [_graph(**fields)])
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a new mtime even in the same clock tick
    after = dataset_digest("dgl-file", path=path, num_classes=3), stage_key(rspec, "sample", "d", "cpu")
    assert after[0] != before[0] and after[1]["stage_sha"] != before[1]["stage_sha"]
    for stage in ("partition", "train", "evaluate"):  # each stage's own key, not only by lineage
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        old = stage_key(rspec, stage, "u", "cpu")["stage_sha"]
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        assert stage_key(rspec, stage, "u", "cpu")["stage_sha"] != old, stage
    # the download stage is keyed before it fetches the files: its key does not follow them
    download = stage_key(rspec, "download", None, "cpu")["stage_sha"]
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000))
    assert stage_key(rspec, "download", None, "cpu")["stage_sha"] == download
