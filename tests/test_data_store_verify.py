"""The store's load checks: sizes and the manifest always, a file's SHA-256 only when the
verification stamp does not vouch for the file's current state."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from betty.data import store as store_module
from betty.data.store import MANIFEST, STAMP, StoreError, open_store, write_store

from fsclock import wait_past

ARRAYS = {"a": torch.arange(1000, dtype=torch.int64), "b": torch.linspace(0, 1, 3000).reshape(1000, 3),
          "c": torch.tensor([7, -1, 3], dtype=torch.int32)}
FILES = sorted(f"{name}.bin" for name in ARRAYS)


@pytest.fixture
def hashed(monkeypatch):
    """The names of the files hashed, in order."""
    calls: list[str] = []
    real = store_module._sha256

    def counting(path):
        calls.append(path.name)
        return real(path)

    monkeypatch.setattr(store_module, "_sha256", counting)
    return calls


def _settle(folder) -> None:
    """Wait until the file system's clock has passed the last change in ``folder`` (a file
    changed in the clock tick its hashing began in is not stamped)."""
    wait_past(max(p.stat().st_ctime_ns for p in folder.iterdir()), folder.parent)


def _store(tmp_path, stamped: bool = True):
    """A store of :data:`ARRAYS` at ``tmp_path/s``, stamped by one verifying open."""
    folder = tmp_path / "s"
    write_store(folder, ARRAYS, {"k": 1})
    _settle(folder)
    if stamped:
        open_store(folder)
        assert (folder / STAMP).is_file()
    return folder


def _same(arrays) -> None:
    assert arrays.keys() == ARRAYS.keys()
    for name, want in ARRAYS.items():
        assert arrays[name].dtype == want.dtype and torch.equal(arrays[name], want), name


def _listing(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_second_load_does_not_hash(tmp_path, hashed):
    folder = _store(tmp_path, stamped=False)
    _same(open_store(folder)[0])
    assert sorted(hashed) == FILES
    stamp = json.loads((folder / STAMP).read_text())
    manifest = json.loads((folder / MANIFEST).read_text())["arrays"]
    assert stamp["stamp_format"] == 1 and sorted(stamp["files"]) == FILES
    for entry in manifest.values():
        st = (folder / entry["file"]).stat()
        assert stamp["files"][entry["file"]] == {
            "sha256": entry["sha256"], "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "ino": st.st_ino, "dev": st.st_dev}
    hashed.clear()
    arrays, scalars = open_store(folder)
    assert hashed == [] and scalars == {"k": 1}
    _same(arrays)
    assert _listing(folder) == sorted([*FILES, MANIFEST, STAMP])  # no temporary file left


def test_full_hashes_every_file_and_false_none(tmp_path, hashed):
    folder = _store(tmp_path)
    hashed.clear()
    open_store(folder, verify="full")
    assert sorted(hashed) == FILES
    hashed.clear()
    (folder / STAMP).unlink()
    open_store(folder, verify=False)
    assert hashed == [] and not (folder / STAMP).exists()
    with pytest.raises(ValueError, match="allowed: True, False, 'full'"):
        open_store(folder, verify="yes")


def test_same_size_change_in_place_is_detected(tmp_path, hashed):
    """One byte flipped in place, the file's mtime put back: its ctime moved, so it is
    hashed again (and only it) and the mismatch is an error."""
    folder = _store(tmp_path)
    path = folder / "b.bin"
    before = path.stat()
    with path.open("r+b") as fh:
        fh.seek(123)
        byte = fh.read(1)
        fh.seek(123)
        fh.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_mtime_ns == before.st_mtime_ns and path.stat().st_size == before.st_size
    hashed.clear()
    with pytest.raises(StoreError, match="content of b.bin differs from its recorded SHA-256"):
        open_store(folder)
    assert hashed == ["b.bin"]
    assert _listing(folder) == sorted([*FILES, MANIFEST, STAMP])


def test_truncated_file_is_detected_without_hashing(tmp_path, hashed):
    folder = _store(tmp_path)
    os.truncate(folder / "c.bin", 8)
    hashed.clear()
    for verify in (True, "full", False):
        with pytest.raises(StoreError, match="has c.bin of 8 bytes, its manifest records 12"):
            open_store(folder, verify=verify)
    assert hashed == []


@pytest.mark.parametrize("damage", ["deleted", "garbage", "not an object", "foreign format",
                                    "files not an object", "stat differs", "another file's record"])
def test_a_stamp_that_does_not_vouch_falls_back_to_hashing(tmp_path, hashed, damage):
    folder = _store(tmp_path)
    stamp_path = folder / STAMP
    stamp = json.loads(stamp_path.read_text())
    if damage == "deleted":
        stamp_path.unlink()
    elif damage == "garbage":
        stamp_path.write_bytes(b"\x00\xff{not json")
    elif damage == "not an object":
        stamp_path.write_text("[1, 2]")
    elif damage == "foreign format":
        stamp_path.write_text(json.dumps({**stamp, "stamp_format": 2}))
    elif damage == "files not an object":
        stamp_path.write_text(json.dumps({**stamp, "files": FILES}))
    elif damage == "stat differs":  # a crafted record: right hash, a state the file is not in
        for record in stamp["files"].values():
            record["mtime_ns"] += 1
        stamp_path.write_text(json.dumps(stamp))
    else:  # each file's name on the record of another file
        names = sorted(stamp["files"])
        stamp["files"] = {a: stamp["files"][b] for a, b in zip(names, names[1:] + names[:1])}
        stamp_path.write_text(json.dumps(stamp))
    hashed.clear()
    _same(open_store(folder)[0])
    assert sorted(hashed) == FILES
    hashed.clear()
    open_store(folder)  # the stamp was rewritten
    assert hashed == []


def test_a_stamp_for_another_recorded_hash_is_not_trusted(tmp_path, hashed):
    """The manifest now records another SHA-256 for a file the stamp vouches for: the
    file is hashed against the manifest and refused."""
    folder = _store(tmp_path)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["arrays"]["a"]["sha256"] = "0" * 64
    (folder / MANIFEST).write_text(json.dumps(manifest))
    hashed.clear()
    with pytest.raises(StoreError, match="content of a.bin differs from its recorded SHA-256"):
        open_store(folder)
    assert hashed == ["a.bin"]


def test_a_file_changed_in_the_tick_hashing_began_is_not_stamped(tmp_path, hashed, monkeypatch):
    """A file whose ctime is not older than the stamp's start could change again within
    the same clock tick unseen: it is verified but left out of the stamp."""
    folder = _store(tmp_path, stamped=False)
    newest = (folder / "b.bin").stat().st_ctime_ns
    real_init = store_module._Stamper.__init__

    def same_tick(self, where):
        real_init(self, where)
        self.t0 = newest  # the clock has not moved past b.bin's last change

    monkeypatch.setattr(store_module._Stamper, "__init__", same_tick)
    _same(open_store(folder)[0])
    files = json.loads((folder / STAMP).read_text())["files"]
    assert sorted(files) == sorted(f for f in FILES if (folder / f).stat().st_ctime_ns < newest)
    assert "b.bin" not in files
    monkeypatch.setattr(store_module._Stamper, "__init__", real_init)
    hashed.clear()
    open_store(folder)
    assert "b.bin" in hashed


def test_a_file_changed_while_hashed_is_not_stamped(tmp_path, hashed, monkeypatch):
    """A file changed while it is hashed (here: its mtime set) matched its hash but is
    not stamped: its ctime is no longer older than the stamp's start."""
    folder = _store(tmp_path, stamped=False)
    real = store_module._sha256

    def touching(path):
        digest = real(path)
        if path.name == "a.bin":
            os.utime(path, ns=(1, 1))
        return digest

    monkeypatch.setattr(store_module, "_sha256", touching)
    open_store(folder)
    assert sorted(json.loads((folder / STAMP).read_text())["files"]) == ["b.bin", "c.bin"]


def test_an_unwritable_folder_loads_and_keeps_hashing(tmp_path, hashed, monkeypatch):
    folder = _store(tmp_path, stamped=False)

    def refuse(*args, **kwargs):
        raise PermissionError("read-only")

    monkeypatch.setattr(store_module.tempfile, "mkstemp", refuse)
    for _ in range(2):
        _same(open_store(folder)[0])
    assert sorted(hashed) == sorted(FILES * 2) and not (folder / STAMP).exists()


def _edit_manifest(folder, edit) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    edit(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("edit, why", [
    (lambda m: m["arrays"]["a"].pop("sha256"), "needs file, dtype, shape, bytes and sha256"),
    (lambda m: m["arrays"]["a"].update(file="../a.bin"), "not a plain, unused file name"),
    (lambda m: m["arrays"]["a"].update(file=".a.bin"), "not a plain, unused file name"),
    (lambda m: m["arrays"]["a"].update(file=MANIFEST), "not a plain, unused file name"),
    (lambda m: m["arrays"]["a"].update(file="b.bin"), "not a plain, unused file name"),
    (lambda m: m["arrays"]["a"].update(shape=[-1000]), "is not a list of counts"),
    (lambda m: m["arrays"]["a"].update(shape=[True]), "is not a list of counts"),
    (lambda m: m["arrays"]["a"].update(sha256="xyz"), "is not 64 hex digits"),
    (lambda m: m["arrays"]["a"].update(bytes=16), "8000 expected"),
    (lambda m: m["arrays"]["a"].update(bytes="8000"), "is not a count"),
    (lambda m: m.update(arrays=[]), "arrays and scalars are not objects"),
    (lambda m: m.pop("scalars"), "not an object with store_format, arrays and scalars"),
    (lambda m: m["scalars"].update(k=2), "scalars that do not match their recorded SHA-256"),
    (lambda m: m.pop("scalars_sha256"), "scalars that do not match their recorded SHA-256"),
])
def test_a_malformed_manifest_is_refused_before_hashing(tmp_path, hashed, edit, why):
    folder = _store(tmp_path)
    _edit_manifest(folder, edit)
    hashed.clear()
    with pytest.raises(StoreError, match=why):
        open_store(folder, verify="full")
    assert hashed == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/meminfo")
def test_an_array_larger_than_memory_and_swap_maps_copy_on_write(tmp_path):
    """A store larger than the machine's memory (out of core) maps: the kernel's
    overcommit check refuses a writable private mapping beyond memory + swap unless it
    reserves nothing. Writes stay private (the file keeps its bytes)."""
    from betty.data.store import _map

    meminfo = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    limit = (int(meminfo["MemTotal"].split()[0]) + int(meminfo["SwapTotal"].split()[0])) * 1024
    numel = (limit + 2**30) // 4
    path = tmp_path / "big.bin"
    with path.open("wb") as fh:  # sparse: no disk blocks
        fh.truncate(numel * 4)
    t = _map(path, torch.float32, [numel])
    assert t.numel() == numel and float(t[-1]) == 0.0
    t[-1] = 3.0
    assert float(t[-1]) == 3.0
    with path.open("rb") as fh:
        fh.seek(numel * 4 - 4)
        assert fh.read(4) == b"\0\0\0\0"


@pytest.mark.parametrize("name", [MANIFEST, STAMP])
def test_a_manifest_or_stamp_that_is_no_file_does_not_block(tmp_path, name):
    """A FIFO at ``manifest.json`` (refused) or ``verified.json`` (vouches for nothing,
    replaced by the new stamp) is not read: opening it would wait for a writer forever."""
    import threading

    folder = _store(tmp_path)
    (folder / name).unlink()
    os.mkfifo(folder / name)
    outcome = []

    def load():
        try:
            outcome.append(open_store(folder)[1])
        except StoreError as err:
            outcome.append(err)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(20)
    if reader.is_alive():  # unblock the reader, then fail
        os.close(os.open(folder / name, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"open_store blocked on a FIFO at {name}")
    if name == MANIFEST:
        assert isinstance(outcome[0], StoreError) and "has no readable manifest" in str(outcome[0])
    else:
        assert outcome == [{"k": 1}] and (folder / STAMP).is_file()
