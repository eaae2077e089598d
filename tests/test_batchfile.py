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
