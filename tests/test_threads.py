"""``train.threads: auto``: the cores a process may use (affinity, cgroup quota), shared
among ranks, bounded by the work size."""

import os

import pytest
import torch

from betty import threads
from betty.threads import EDGES_PER_THREAD, auto_threads, available_cores, cgroup_cpu_limit, idle_cores


def _cgroup_v2(tmp_path, text):
    (tmp_path / "cpu.max").write_text(text)
    return tmp_path


def _cgroup_v1(tmp_path, quota, period=100000):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(f"{period}\n")
    return tmp_path


def test_cgroup_quota_is_read_from_v2_and_v1_files(tmp_path):
    for name, text, cores in [("a", "150000 100000\n", 1.5), ("b", "max 100000\n", None)]:
        (tmp_path / name).mkdir()
        assert cgroup_cpu_limit(_cgroup_v2(tmp_path / name, text)) == cores
    (tmp_path / "c").mkdir()
    assert cgroup_cpu_limit(_cgroup_v1(tmp_path / "c", 250000)) == 2.5
    (tmp_path / "d").mkdir()
    assert cgroup_cpu_limit(_cgroup_v1(tmp_path / "d", -1)) is None
    (tmp_path / "e").mkdir()
    assert cgroup_cpu_limit(tmp_path / "e") is None  # nothing readable: no limit


def test_available_cores_is_the_affinity_mask_capped_by_the_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    assert available_cores(tmp_path) == 8  # no quota file
    assert available_cores(_cgroup_v2(tmp_path, "150000 100000")) == 2  # 1.5 cores, rounded up
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert available_cores(tmp_path) == 1  # the mask is smaller than the quota
    assert available_cores(_cgroup_v2(tmp_path, "1000 100000")) == 1  # never 0


def test_auto_threads_never_exceeds_the_idle_cores_and_follows_the_work(monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 16)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 1.0, 1.0))  # this process alone
    assert auto_threads() == 16
    assert auto_threads(ranks=4) == 4
    assert auto_threads(ranks=32) == 1
    assert auto_threads(10_000) == 1  # a small graph: one thread
    assert auto_threads(3 * EDGES_PER_THREAD) == 3
    assert auto_threads(10**12) == 16
    assert auto_threads(10**12, ranks=3) == 5
    assert auto_threads(10**12, cores=2) == 2
    with pytest.raises(ValueError, match="ranks"):
        auto_threads(ranks=0)


def test_busy_cores_are_left_to_the_work_that_holds_them(monkeypatch):
    assert idle_cores(16, load=0.2) == 16
    assert idle_cores(16, load=5.0) == 12  # four other runnable threads
    assert idle_cores(2, load=44.0) == 1  # an overloaded host: one thread, never 0
    assert auto_threads(10**12, cores=8, load=7.0) == 2
    monkeypatch.setattr(threads, "available_cores", lambda: 4)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0, 0.0, 0.0))
    assert auto_threads(10**12) == 2  # the load average is read when none is given


def test_auto_is_the_default_and_is_resolved_by_the_dataset_size(monkeypatch):
    from workflow.components import configure_threads, spec_threads
    from workflow.specfile import load_spec

    rspec = load_spec("tiny")
    assert rspec.spec.train.threads == "auto"
    monkeypatch.setattr(threads, "available_cores", lambda: 8)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert spec_threads(rspec) == 8
    assert spec_threads(rspec, 5 * EDGES_PER_THREAD) == 5
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # inside a rank of a 4-process job
    assert spec_threads(rspec) == 2
    assert spec_threads(load_spec("tiny", ["train.threads=3"]), 10) == 3
    assert spec_threads(load_spec("tiny", ["train.threads=null"])) is None
    before = torch.get_num_threads()
    try:
        configure_threads(rspec, 10)  # a tiny graph: one thread, whatever the cores
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
