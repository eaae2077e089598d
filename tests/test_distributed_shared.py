"""One shared copy of a dataset for the ranks of a machine (betty.distributed.shared).

In one process: the attached dataset equals the original (graph, its CSR, features,
labels, splits, scalars), its tensors are mapped from the shared files, a write into one
attachment stays private (copy-on-write), and the files are removed on exit. The
launched check (ranks map the files and train exactly) is part of
tests/test_distributed_exact.py's PyG launches.
"""

from __future__ import annotations

import os

import torch

from betty.distributed.shared import memory_of_process, share_dataset
from distributed_cases import dataset


def _mapped(folder: str) -> set[str]:
    with open("/proc/self/maps") as fh:
        return {line.split()[-1] for line in fh if folder in line}


def test_attach_equals_original_maps_files_and_copies_on_write(tmp_path):
    ds = dataset()
    with share_dataset(ds, folder=str(tmp_path)) as shared:
        got = shared.attach()
        assert got.name == ds.name and got.num_classes == ds.num_classes
        assert got.multilabel == ds.multilabel and got.ogb_name == ds.ogb_name
        for key in ("feat", "label", "train_idx", "valid_idx", "test_idx"):
            assert torch.equal(getattr(got, key), getattr(ds, key)), key
            assert getattr(got, key).dtype == getattr(ds, key).dtype
        assert got.graph.num_nodes() == ds.graph.num_nodes()
        assert torch.equal(got.graph.src, ds.graph.src) and torch.equal(got.graph.dst, ds.graph.dst)
        assert "in_csr" in got.graph.__dict__  # shared, not rebuilt
        for a, b in zip(got.graph.in_csr, ds.graph.in_csr):
            assert torch.equal(a, b)
        assert _mapped(shared.folder) == {t.path for t in shared.tensors.values()}
        assert shared.nbytes >= ds.feat.numel() * 4 + 2 * ds.graph.num_edges() * 8
        before = float(ds.feat[0, 0])
        got.feat[0, 0] = before + 1.0
        assert float(shared.attach().feat[0, 0]) == before  # the write stayed private
        folder = shared.folder
    assert not os.path.exists(folder)


def test_memory_of_process_reports_rss_and_pss():
    mem = memory_of_process()
    assert mem["rss_peak_bytes"] > 0
    if os.path.exists("/proc/self/smaps_rollup"):
        assert 0 < mem["pss_bytes"] <= mem["rss_bytes"] <= mem["rss_peak_bytes"] * 1.5
