"""One shared copy of a dataset for the ranks of a machine (betty.distributed.shared).

In one process: the attached dataset equals the original (graph, its CSR, features,
labels, splits, scalars), its tensors are mapped from the shared files, a write into one
attachment stays private (copy-on-write), and the files are removed on exit; a folder
left by a launcher killed with SIGKILL (or otherwise gone: a reused pid, an earlier boot)
is removed by the next launch, a live one's never. The launched check (ranks map the files and train exactly) is part of
tests/test_distributed_exact.py's PyG launches.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from betty.owner import Owner, reclaim_stale_folders
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


def _zombie() -> subprocess.Popen:
    """A child that has exited but is not reaped yet (its pid and start time still stand)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with open(f"/proc/{child.pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                return child
        time.sleep(0.01)
    raise AssertionError("the child did not exit")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_reclaim_removes_the_folders_of_gone_owners_only(tmp_path):
    here = Owner.current()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    zombie = _zombie()
    try:
        other_boot = "deadbeef" if here.boot != "deadbeef" else "feedbeef"
        gone = {
            "dead pid": Owner(dead.pid, 1, here.pidns, here.boot),
            "pid reused": Owner(here.pid, here.start + 1, here.pidns, here.boot),
            "earlier boot": Owner(here.pid, here.start, here.pidns, other_boot),
            "zombie": Owner.of_process(zombie.pid),
        }
        alive = {
            "this process": here,
            "live child": Owner.of_process(sleeper.pid),
            "other namespace": Owner(dead.pid, 1, here.pidns + 1, here.boot),
        }
        assert alive["live child"].start > 0 and gone["zombie"].start > 0
        paths = {}
        for why, owner in {**gone, **alive}.items():
            paths[why] = tempfile.mkdtemp(prefix=owner.prefix(), dir=tmp_path)
            (Path(paths[why]) / "x.bin").write_bytes(b"1234")
        kept = [tmp_path / "betty-1a2b3c4d-abc_123", tmp_path / "other"]  # another format
        for path in kept:
            path.mkdir()
        not_a_folder = tmp_path / (gone["dead pid"].prefix() + "file")
        not_a_folder.write_bytes(b"")

        removed = reclaim_stale_folders(str(tmp_path))
        assert sorted(removed) == sorted(paths[why] for why in gone)
        for why in alive:
            assert os.path.isfile(os.path.join(paths[why], "x.bin")), why
        assert all(p.is_dir() for p in kept) and not_a_folder.is_file()
        assert reclaim_stale_folders(str(tmp_path)) == []
    finally:
        sleeper.kill()
        sleeper.wait()
        zombie.wait()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_a_sigkilled_launchers_folder_is_reclaimed_by_the_next_launch(tmp_path):
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(tests), tests])}
    code = ("import sys, time\n"
            "from betty.distributed.shared import share_dataset\n"
            "from distributed_cases import dataset\n"
            f"with share_dataset(dataset(40), folder={str(tmp_path)!r}) as shared:\n"
            "    print(shared.folder, flush=True)\n"
            "    time.sleep(300)\n")
    launcher = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        folder = launcher.stdout.readline().strip()
        assert folder and os.listdir(folder)
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    assert os.path.isdir(folder)  # SIGKILL: nothing could remove it
    with share_dataset(dataset(40), folder=str(tmp_path)) as shared:
        assert not os.path.exists(folder)
        assert os.listdir(tmp_path) == [os.path.basename(shared.folder)]
        assert reclaim_stale_folders(str(tmp_path)) == []  # a live launcher's folder stays
        assert os.listdir(shared.folder)
    assert os.listdir(tmp_path) == []
