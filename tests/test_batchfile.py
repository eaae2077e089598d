"""A sampled batch written as ``.npz`` and read back (:mod:`betty.batchfile`)."""

from __future__ import annotations

import numpy as np
import torch

from betty.batchfile import load_batch, save_batch
from betty.partition.planted import planted_community_graph
from betty.sampling import sample_full_batch


def test_batch_file_round_trip(tmp_path):
    graph, _ = planted_community_graph(400, 6, avg_degree=8.0, seed=0)
    batch = sample_full_batch(graph, torch.arange(0, 400, 5), [4, 6], seed=0)
    groups = torch.arange(batch.num_outputs) % 3
    loaded, g = load_batch(save_batch(tmp_path / "b.npz", batch, groups))
    assert torch.equal(g, groups) and loaded.fanouts == batch.fanouts
    for a, b in zip(loaded.layers, batch.layers):
        assert a.num_dst == b.num_dst
        for name in ("src_nid", "edge_src", "edge_dst", "edge_id", "src_out_degree"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name

    z = np.load(tmp_path / "b.npz")
    assert z["block0_src"].dtype == np.int64
    assert np.array_equal(z["block1_dst"], batch.layers[1].src_nid[batch.layers[1].edge_dst].numpy())
    assert np.array_equal(z["outputs"], batch.output_nid.numpy())


def test_save_batch_returns_the_file_it_wrote_and_leaves_no_temporary(tmp_path):
    graph, _ = planted_community_graph(60, 2, avg_degree=4.0, seed=0)
    batch = sample_full_batch(graph, torch.arange(10), [2, 2], seed=0)
    path = save_batch(tmp_path / "out" / "batch", batch)  # NumPy adds .npz: so does save_batch's answer
    assert path == tmp_path / "out" / "batch.npz" and path.is_file()
    assert [p.name for p in path.parent.iterdir()] == ["batch.npz"]
    again, _ = load_batch(path)
    assert torch.equal(again.output_nid, batch.output_nid)


def _tampered(tmp_path, batch, name: str, change) -> str:
    """``batch``'s file with ``change(arrays)`` applied, as ``name``."""
    from betty.batchfile import batch_arrays

    arrays = batch_arrays(batch, torch.arange(batch.num_outputs) % 2)
    change(arrays)
    path = tmp_path / f"{name}.npz"
    np.savez(path, **arrays)
    return path


def test_a_damaged_or_foreign_batch_file_is_refused_naming_it(tmp_path):
    """Each of these loaded without an error (a swapped source fed one node's row as
    another's) or failed with a bare KeyError or TypeError."""
    import pytest

    graph, _ = planted_community_graph(200, 4, avg_degree=6.0, seed=0)
    batch = sample_full_batch(graph, torch.arange(0, 200, 4), [3, 4], seed=0)

    def swap(a):
        a["block1_src_nid"][[0, 1]] = a["block1_src_nid"][[1, 0]]

    cases = {
        "outputs": (lambda a: a.update(outputs=a["outputs"][::-1].copy()), "are not the outputs"),
        "chain": (swap, "are not block 1's sources"),
        "eid": (lambda a: a.update(block0_eid=a["block0_eid"][:-1]), "edge IDs"),
        "degree": (lambda a: a.update(block1_src_out_degree=a["block1_src_out_degree"][:2]), "out-degrees"),
        "groups": (lambda a: a.update(groups=np.zeros(1, dtype=np.int64)), "groups for"),
        "floats": (lambda a: a.update(block0_src=a["block0_src"] + 0.4), "not 1-D integer arrays"),
        "missing": (lambda a: a.pop("block1_src"), r"arrays \['block1_src'\] are missing"),
        "repeated": (lambda a: a["block0_src_nid"].__setitem__(-1, a["block0_src_nid"][-2]), "a source node twice"),
    }
    for name, (change, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            load_batch(_tampered(tmp_path, batch, name, change))
    np.save(tmp_path / "one.npy", np.arange(3))
    with pytest.raises(ValueError, match="single .npy array"):
        load_batch(tmp_path / "one.npy")
    good = save_batch(tmp_path / "good.npz", batch)
    (tmp_path / "cut.npz").write_bytes(good.read_bytes()[:100])
    with pytest.raises(ValueError, match="not a readable batch file"):
        load_batch(tmp_path / "cut.npz")
