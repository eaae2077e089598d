"""benchmarks/backends.py --epoch: both backends run the same epoch (same K, same loss)."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytest.importorskip("torch_geometric")
pytest.importorskip("dgl")

pytestmark = [pytest.mark.dgl, pytest.mark.pyg]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_backends", os.path.join(ROOT, "benchmarks", "backends.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_epoch_mode_times_the_same_epoch_on_both_backends(tmp_path):
    bench = _bench()
    times = bench.time_epochs("tiny", [f"dataset.root={tmp_path}"], repeats=2)
    assert set(times) == {"dgl", "pyg"}
    for backend in times:
        for part in bench.EPOCH_PARTS:
            assert len(times[backend][part]) == 2 and all(t >= 0 for t in times[backend][part])
        assert times[backend]["k"] == [2, 2]  # the spec's K
        epoch, parts = times[backend]["epoch_time_s"], times[backend]
        for r in range(2):  # the parts lie inside the epoch
            assert sum(parts[p][r] for p in bench.EPOCH_PARTS[:-1]) <= epoch[r]
    losses = times["dgl"]["loss"] + times["pyg"]["loss"]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0])
