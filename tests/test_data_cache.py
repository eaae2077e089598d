"""betty's processed-dataset cache: hits, misses on option changes, atomic writes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import betty.data.synthetic as synthetic_module
from betty.data import cache_path, load_dataset
from betty.data import cache as cache_module
from betty.data import store as store_module
from betty.data.store import STAMP
from betty.sampling import sample_full_batch

from fsclock import wait_past

OPTS = dict(num_nodes=600, avg_degree=6.0, num_communities=10, num_classes=4)


def _replace(path, data: bytes) -> None:
    """Put ``data`` at ``path`` as a new file (the old one may be mapped by a loaded
    dataset: changing it in place would change that dataset's memory)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    tmp.replace(path)


def _same(a, b) -> None:
    sa, da = a.graph.edges()
    sb, db = b.graph.edges()
    assert torch.equal(sa, sb) and torch.equal(da, db)
    for f in ("feat", "label", "train_idx", "valid_idx", "test_idx"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert (a.name, a.num_classes, a.multilabel, a.is_ogb, a.ogb_name) == (
        b.name, b.num_classes, b.multilabel, b.is_ogb, b.ogb_name,
    )


@pytest.fixture
def generator_calls(monkeypatch):
    """Count runs of the synthetic generator."""
    calls = []
    real = synthetic_module.generate_synthetic

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(synthetic_module, "generate_synthetic", counting)
    return calls


def test_second_load_hits_cache(tmp_path, generator_calls):
    first = load_dataset("synthetic", root=tmp_path, **OPTS)
    path = cache_path("synthetic", tmp_path, **OPTS)
    assert path.is_dir() and (path / "manifest.json").is_file() and path.parent == tmp_path / "betty-cache"
    assert len(generator_calls) == 1
    second = load_dataset("synthetic", root=tmp_path, **OPTS)
    assert len(generator_calls) == 1, "the generator ran again"
    _same(first, second)
    second.stats()  # memory-mapped tensors are usable


def test_changed_option_misses_and_equal_settings_hit(tmp_path, generator_calls):
    load_dataset("synthetic", root=tmp_path, **OPTS)
    base = cache_path("synthetic", tmp_path, **OPTS)
    changed = cache_path("synthetic", tmp_path, **{**OPTS, "seed": 1})
    assert changed != base
    other = load_dataset("synthetic", root=tmp_path, **{**OPTS, "seed": 1})
    assert len(generator_calls) == 2 and changed.is_dir()
    assert not torch.equal(other.feat, load_dataset("synthetic", root=tmp_path, **OPTS).feat)
    assert len(generator_calls) == 2
    # the same settings spelled differently: an explicit default, an int for a float
    same = {**OPTS, "avg_degree": 6, "scale": 1, "seed": 0}
    assert cache_path("synthetic", tmp_path, **same) == base
    load_dataset("synthetic", root=tmp_path, **same)
    assert len(generator_calls) == 2
    # the two presets never share a cache entry
    assert cache_path("synthetic-products", tmp_path, **OPTS) != base


def test_cache_false_neither_reads_nor_writes(tmp_path, generator_calls):
    load_dataset("synthetic", root=tmp_path, cache=False, **OPTS)
    assert not (tmp_path / "betty-cache").exists()
    load_dataset("synthetic", root=tmp_path, **OPTS)
    load_dataset("synthetic", root=tmp_path, cache=False, **OPTS)
    assert len(generator_calls) == 3


def test_interrupted_write_leaves_no_cache_file(tmp_path, monkeypatch, generator_calls):
    real = store_module.ArrayWriter.append

    def crash_midway(self, chunk):
        if self.path.name == "feat.bin":  # after the CSR files were written
            real(self, chunk[:1])
            raise KeyboardInterrupt
        real(self, chunk)

    monkeypatch.setattr(store_module.ArrayWriter, "append", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        load_dataset("synthetic", root=tmp_path, **OPTS)
    assert list((tmp_path / "betty-cache").iterdir()) == []  # no final file, no temp file
    monkeypatch.undo()
    load_dataset("synthetic", root=tmp_path, **OPTS)
    assert cache_path("synthetic", tmp_path, **OPTS).is_dir()


@pytest.mark.parametrize("victim", ["indptr.bin", "indices.bin", "eid.bin", "feat.bin"])
def test_damaged_cache_is_recomputed(tmp_path, generator_calls, victim):
    """A file of the entry overwritten with other bytes of the same length."""
    first = load_dataset("synthetic", root=tmp_path, **OPTS)
    path = cache_path("synthetic", tmp_path, **OPTS)
    size = (path / victim).stat().st_size
    _replace(path / victim, bytes(range(256)) * (size // 256) + bytes(size % 256))
    with pytest.warns(UserWarning, match=f"ignoring dataset cache .*content of {victim} differs from its recorded SHA-256"):
        again = load_dataset("synthetic", root=tmp_path, **OPTS)
    assert len(generator_calls) == 2
    _same(first, again)
    load_dataset("synthetic", root=tmp_path, **OPTS)  # the rewritten file is good
    assert len(generator_calls) == 2


def test_changed_cache_content_is_rebuilt(tmp_path, generator_calls):
    """An entry that still loads but whose labels were shifted is not used."""
    first = load_dataset("synthetic", root=tmp_path, **OPTS)
    path = cache_path("synthetic", tmp_path, **OPTS)
    label = (first.label + 1) % first.num_classes
    _replace(path / "label.bin", label.numpy().tobytes())
    with pytest.warns(UserWarning, match="content of label.bin differs from its recorded SHA-256"):
        again = load_dataset("synthetic", root=tmp_path, **OPTS)
    assert len(generator_calls) == 2
    _same(first, again)
    load_dataset("synthetic", root=tmp_path, **OPTS)  # the rebuilt file and digest agree
    assert len(generator_calls) == 2


@pytest.mark.parametrize("damage", ["missing", "garbled"])
def test_cache_without_manifest_is_rebuilt(tmp_path, generator_calls, damage):
    load_dataset("synthetic", root=tmp_path, **OPTS)
    manifest = cache_path("synthetic", tmp_path, **OPTS) / "manifest.json"
    if damage == "missing":
        manifest.unlink()
    else:
        _replace(manifest, manifest.read_bytes()[:-40])
    with pytest.warns(UserWarning, match="has no readable manifest"):
        load_dataset("synthetic", root=tmp_path, **OPTS)
    assert len(generator_calls) == 2


@pytest.mark.parametrize("key, value", [("num_classes", 5), ("name", "synthetic-products")])
def test_damaged_manifest_scalars_are_rebuilt(tmp_path, generator_calls, key, value):
    """A scalar of the manifest changed (no file's hash covers it: the output width, the
    dataset's name) fails its recorded SHA-256: the entry is rebuilt, not served."""
    first = load_dataset("synthetic", root=tmp_path, **OPTS)
    manifest = cache_path("synthetic", tmp_path, **OPTS) / "manifest.json"
    data = json.loads(manifest.read_text())
    data["scalars"][key] = value
    _replace(manifest, json.dumps(data).encode())
    with pytest.warns(UserWarning, match="scalars that do not match their recorded SHA-256"):
        again = load_dataset("synthetic", root=tmp_path, verify=False, **OPTS)
    assert len(generator_calls) == 2
    _same(first, again)


def test_an_entry_copied_under_another_key_is_rebuilt(tmp_path, generator_calls):
    """Another seed's entry copied over this key's folder is intact but not this
    dataset: its manifest names the entry it was written as, so it is refused."""
    first = load_dataset("synthetic", root=tmp_path, **OPTS)
    other = {**OPTS, "seed": 1}
    load_dataset("synthetic", root=tmp_path, **other)
    here = cache_path("synthetic", tmp_path, **OPTS)
    shutil.rmtree(here)
    shutil.copytree(cache_path("synthetic", tmp_path, **other), here)
    with pytest.warns(UserWarning, match=f"was written as entry .*, not '{here.name}'"):
        again = load_dataset("synthetic", root=tmp_path, verify="full", **OPTS)
    assert len(generator_calls) == 3
    _same(first, again)


def test_a_writer_keeps_the_entry_another_one_finished_after_it_began(tmp_path):
    """Two processes building one entry: the one done second does not replace the
    entry the first moved into place meanwhile (the first may be mapping it already);
    an entry that was there before it began (damaged, superseded) it replaces."""
    from betty.data import store

    folder = tmp_path / "entry"
    store.write_store(folder, {"x": torch.arange(4)}, {"who": "before"})
    with store.StoreWriter(folder, {"who": "second"}) as second:
        second.put("x", torch.arange(4))
        wait_past(second._began, tmp_path)  # the other writer's manifest: a later tick
        store.write_store(folder, {"x": torch.arange(4)}, {"who": "first"})
        first = store.open_store(folder)[0]["x"]
    assert store.open_store(folder)[1]["who"] == "first" and torch.equal(first, torch.arange(4))
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]  # no temporary folder left
    store.write_store(folder, {"x": torch.arange(4)}, {"who": "later"})
    assert store.open_store(folder)[1]["who"] == "later"


@pytest.mark.parametrize("victim", ["indptr.bin", "indices.bin", "eid.bin"])
def test_truncated_csr_is_detected_and_rebuilt(tmp_path, generator_calls, victim):
    """A CSR file cut short (a full disk, a killed copy) is caught by its size, before
    it is read; the rerun rebuilds it and samples the same batch."""
    first = load_dataset("synthetic", root=tmp_path, **OPTS)
    want = sample_full_batch(first.graph, first.train_idx, [3, 2], seed=5)
    path = cache_path("synthetic", tmp_path, **OPTS) / victim
    _replace(path, path.read_bytes()[:-4])
    with pytest.warns(UserWarning, match=f"{victim} of .* bytes, its manifest records"):
        again = load_dataset("synthetic", root=tmp_path, **OPTS)
    assert len(generator_calls) == 2
    _same_batch(sample_full_batch(again.graph, again.train_idx, [3, 2], seed=5), want)
    load_dataset("synthetic", root=tmp_path, **OPTS)
    assert len(generator_calls) == 2


def test_a_writer_that_finishes_second_keeps_the_first_ones_entry(tmp_path, monkeypatch):
    """Two processes building one cache entry at once: when the other one's entry lands
    between this writer's clearing and its rename, that entry stands (no "Directory not
    empty" error), and it reads back."""
    from betty.data import store

    folder = tmp_path / "entry"
    clear = store.clear_path
    landed = []

    def clear_then_the_other_writer(path):
        clear(path)
        if not landed:
            landed.append(path)
            store.write_store(folder, {"x": torch.arange(4)}, {"who": "first"})

    monkeypatch.setattr(store, "clear_path", clear_then_the_other_writer)
    store.write_store(folder, {"x": torch.arange(4)}, {"who": "second"})
    arrays, scalars = store.open_store(folder)
    assert torch.equal(arrays["x"], torch.arange(4)) and scalars["who"] == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]  # no temporary folder left


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_the_next_writer_removes_a_killed_writers_temporary_folder(tmp_path):
    """A writer killed by SIGKILL leaves its temporary folder; the next writer in that
    place removes it, but not a live writer's, nor one of another boot (the cache may lie
    on a disk other machines share)."""
    import signal
    import subprocess
    import sys

    from betty.data import store
    from betty.owner import Owner, reclaim_stale_folders

    code = ("import sys, time, torch\n"
            "from betty.data.store import StoreWriter\n"
            f"with StoreWriter({str(tmp_path / 'entry')!r}, {{}}) as w:\n"
            "    w.array('x', torch.int64).append(torch.arange(8))\n"
            "    print(w._tmp, flush=True)\n"
            "    time.sleep(300)\n")
    writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        killed = Path(writer.stdout.readline().strip())
        assert killed.is_dir() and killed.name.startswith(".entry.betty-")
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    here = Owner.current()
    other_boot = Owner(writer.pid, 1, here.pidns, "0badb007" if here.boot != "0badb007" else "0badb008")
    elsewhere = tmp_path / (other_boot.prefix("entry") + "abc.tmp")
    elsewhere.mkdir()
    with store.StoreWriter(tmp_path / "other", {}) as live:  # open: its owner (this process) runs
        store.write_store(tmp_path / "entry", {"x": torch.arange(4)}, {})
        assert not killed.exists()
        assert live._tmp.is_dir() and elsewhere.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["entry", "other", elsewhere.name])
    assert reclaim_stale_folders(str(tmp_path)) == [str(elsewhere)]  # judged when boots count


def test_file_in_place_of_the_cache_folder_is_rebuilt(tmp_path, generator_calls):
    first = load_dataset("synthetic", root=tmp_path, **OPTS)
    path = cache_path("synthetic", tmp_path, **OPTS)
    shutil.rmtree(path)
    path.write_bytes(b"a stray file")
    with pytest.warns(UserWarning, match="is not a store folder"):
        again = load_dataset("synthetic", root=tmp_path, **OPTS)
    assert path.is_dir() and len(generator_calls) == 2
    _same(first, again)


def _same_batch(a, b) -> None:
    assert a.fanouts == b.fanouts and len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        assert la.num_dst == lb.num_dst
        for f in ("src_nid", "edge_src", "edge_dst", "edge_id", "src_out_degree"):
            x, y = getattr(la, f), getattr(lb, f)
            assert x.dtype == y.dtype == torch.int64 and torch.equal(x, y), f


def _edges_are_the_graphs(batch, graph) -> None:
    """Every sampled edge ID names an edge of ``graph`` with the sampled endpoints."""
    src, dst = graph.edges()
    for layer in batch.layers:
        assert torch.equal(src[layer.edge_id], layer.src_nid[layer.edge_src])
        assert torch.equal(dst[layer.edge_id], layer.src_nid[layer.edge_dst])


@pytest.mark.parametrize("self_loops", [False, True])
def test_sampler_reads_the_stored_csr_and_gives_the_same_batch(tmp_path, monkeypatch, self_loops):
    """The cached entry holds the CSR alone (int32 indices, no COO), memory-mapped; the
    sampler, the degrees and the derived COO equal those of the uncached dataset (the
    passes over all edges run in several chunks here)."""
    import betty.graph as graph_module

    monkeypatch.setattr(graph_module, "_CHUNK", 257)
    plain = load_dataset("synthetic", root=tmp_path, cache=False, self_loops=self_loops, **OPTS)
    load_dataset("synthetic", root=tmp_path, self_loops=self_loops, **OPTS)  # writes the entry
    stored = load_dataset("synthetic", root=tmp_path, self_loops=self_loops, **OPTS)
    entry = cache_path("synthetic", tmp_path, self_loops=self_loops, **OPTS)
    names = [p.name for p in entry.iterdir()]  # the stamp, unless the load raced the write
    assert sorted(names) == sorted(
        ["manifest.json", "indptr.bin", "indices.bin", "eid.bin", "feat.bin", "label.bin",
         "train_idx.bin", "valid_idx.bin", "test_idx.bin", *[STAMP] * (STAMP in names)])
    g = stored.graph
    assert "src" not in g.__dict__ and g.in_csr[1].dtype == torch.int32 and g.in_csr[2].dtype == torch.int32
    for seed in (0, 1):
        got = sample_full_batch(g, stored.train_idx, [4, 3], seed=seed)
        _same_batch(got, sample_full_batch(plain.graph, plain.train_idx, [4, 3], seed=seed))
        _edges_are_the_graphs(got, plain.graph)
    assert torch.equal(g.in_degrees(), plain.graph.in_degrees())
    assert torch.equal(g.out_degrees(), plain.graph.out_degrees())
    stats = stored.stats()
    assert stats == pytest.approx(plain.stats(), nan_ok=True)
    src, dst = plain.graph.edges()  # the passes over the CSR against the COO directly
    assert stats["num_self_loops"] == int((src == dst).sum())
    assert stats["edge_homophily"] == pytest.approx(float((plain.label[src] == plain.label[dst]).double().mean()))
    assert "src" not in g.__dict__  # the sampler and the statistics read the CSR in place
    _same(stored, plain)  # the COO derived on demand, edge IDs kept


def test_identity_edge_ids_are_not_stored(tmp_path):
    """A graph whose edges are already in CSR order stores no ``eid`` and samples the
    same batch (edge ID = CSR position)."""
    from betty.data.types import GraphDataset
    from betty.graph import Graph

    ds = load_dataset("synthetic", root=tmp_path, cache=False, **OPTS)
    indptr, indices, eid = ds.graph.in_csr
    src, dst = ds.graph.src[eid], ds.graph.dst[eid]  # renumber the edges into CSR order
    ordered = GraphDataset(**{**ds.__dict__, "graph": Graph(src, dst, ds.num_nodes)})
    cache_module.save_cached(ordered, tmp_path / "entry")
    back = cache_module.load_cached(tmp_path / "entry")
    assert not (tmp_path / "entry" / "eid.bin").exists() and back.graph.in_csr[2] is None
    _same_batch(sample_full_batch(back.graph, ds.train_idx, [4, 3], seed=2),
                sample_full_batch(ordered.graph, ds.train_idx, [4, 3], seed=2))
    _same(back, ordered)


def test_uncached_datasets_have_no_cache_path(tmp_path):
    assert cache_path("cora", tmp_path) is None
    assert cache_path("dgl-file", tmp_path, path="x.bin") is None


def test_self_loops_option_adds_each_loop_once_and_keys_the_cache(tmp_path, generator_calls):
    """``self_loops``: one loop per node that has none, existing edges and IDs kept, its
    own cache file (and the default leaves the existing cache key unchanged)."""
    from betty.data import dataset_digest
    from betty.data.cache import cache_key

    plain = load_dataset("synthetic", tmp_path, **OPTS)
    looped = load_dataset("synthetic", tmp_path, self_loops=True, **OPTS)
    assert len(generator_calls) == 2  # a separate cache entry
    assert cache_path("synthetic", tmp_path, self_loops=True, **OPTS) != cache_path("synthetic", tmp_path, **OPTS)
    assert cache_path("synthetic", tmp_path, self_loops=False, **OPTS) == cache_path("synthetic", tmp_path, **OPTS)
    assert dataset_digest("synthetic", tmp_path, **OPTS) == cache_key(
        {"name": "synthetic", "options": synthetic_module.SyntheticConfig(**OPTS).to_dict(), "source": []})
    s0, d0 = plain.graph.edges()
    s1, d1 = looped.graph.edges()
    e, n = plain.num_edges, plain.num_nodes
    assert torch.equal(s1[:e], s0) and torch.equal(d1[:e], d0)
    loops = torch.bincount(s1[s1 == d1], minlength=n)
    assert bool((loops >= 1).all())
    had = torch.bincount(s0[s0 == d0], minlength=n)
    assert torch.equal(loops, torch.where(had > 0, had, torch.ones_like(had)))  # none doubled
    assert looped.graph.with_self_loops() is looped.graph  # idempotent
    again = load_dataset("synthetic", tmp_path, self_loops=True, **OPTS)
    assert len(generator_calls) == 2
    _same(again, looped)
    with pytest.raises(ValueError, match="self_loops"):
        load_dataset("synthetic", tmp_path, self_loops="yes", **OPTS)


def test_self_loops_keep_existing_loops():
    from betty.graph import Graph

    g = Graph(torch.tensor([0, 1, 2, 2]), torch.tensor([0, 2, 1, 2]), 4)
    looped = g.with_self_loops()
    assert looped.edges()[0].tolist() == [0, 1, 2, 2, 1, 3]
    assert looped.edges()[1].tolist() == [0, 2, 1, 2, 1, 3]
    assert looped.with_self_loops() is looped


def test_only_the_first_load_after_a_build_hashes_and_an_edit_in_place_rebuilds(tmp_path, monkeypatch,
                                                                                generator_calls):
    """The build hashes as it writes and is not hashed again; the next load hashes every
    file once and stamps them; later loads hash none, unless ``verify="full"``. A file
    then edited in place (same size, mtime put back) is hashed, refused and rebuilt."""
    import os

    from test_data_store_verify import _settle

    hashed = []
    real = store_module._sha256
    monkeypatch.setattr(store_module, "_sha256", lambda path: hashed.append(path.name) or real(path))
    first = load_dataset("synthetic", root=tmp_path, **OPTS)
    path = cache_path("synthetic", tmp_path, **OPTS)
    files = sorted(p.name for p in path.iterdir() if p.suffix == ".bin")
    assert hashed == [] and len(files) == 8
    _settle(path)
    load_dataset("synthetic", root=tmp_path, **OPTS)
    assert sorted(hashed) == files and (path / STAMP).is_file()
    hashed.clear()
    _same(first, load_dataset("synthetic", root=tmp_path, **OPTS))
    assert hashed == []
    load_dataset("synthetic", root=tmp_path, verify="full", **OPTS)
    assert sorted(hashed) == files
    with pytest.raises(ValueError, match="allowed: True, False, 'full'"):
        load_dataset("synthetic", root=tmp_path, verify="sometimes", **OPTS)
    hashed.clear()
    victim = path / "label.bin"
    before = victim.stat()
    data = bytearray(victim.read_bytes())
    data[0] ^= 1
    with victim.open("r+b") as fh:  # the datasets loaded above map this file: not used again
        fh.write(data[:1])
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.warns(UserWarning, match="content of label.bin differs from its recorded SHA-256"):
        again = load_dataset("synthetic", root=tmp_path, **OPTS)
    assert hashed == ["label.bin"] and len(generator_calls) == 2
    assert torch.equal(again.label, load_dataset("synthetic", root=tmp_path, cache=False, **OPTS).label)


def _mapped_file(t: torch.Tensor) -> str | None:
    """The file whose memory mapping holds ``t``'s data (``/proc/self/maps``), or ``None``
    when ``t`` lives in anonymous memory."""
    ptr = t.data_ptr()
    with open("/proc/self/maps") as fh:
        for line in fh:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return fields[5].strip() if len(fields) == 6 and fields[5].startswith("/") else None
    return None


def test_feature_dtype_entry_is_cast_once_and_mapped_and_keeps_the_float32_key(tmp_path, generator_calls,
                                                                               monkeypatch):
    """``feature_dtype=bfloat16``: its own entry (the float32 key is the one without the
    option, the key every entry had before it), features equal to the float32 ones cast
    to bfloat16, and a second load maps the bfloat16 file itself: no float32 entry is
    read or made, nothing is converted."""
    from betty.data import dataset_digest
    from betty.data.cache import cache_key

    f32_key = cache_key({"name": "synthetic", "options": synthetic_module.SyntheticConfig(**OPTS).to_dict(),
                         "source": []})
    for spelled in (None, "float32", torch.float32):
        assert dataset_digest("synthetic", tmp_path, feature_dtype=spelled, **OPTS) == f32_key
        assert cache_path("synthetic", tmp_path, feature_dtype=spelled, **OPTS).name == f"synthetic-{f32_key}"
    bf16_path = cache_path("synthetic", tmp_path, feature_dtype=torch.bfloat16, **OPTS)
    assert bf16_path == cache_path("synthetic", tmp_path, feature_dtype="bfloat16", **OPTS) != \
        cache_path("synthetic", tmp_path, **OPTS)
    assert cache_path("synthetic", tmp_path, feature_dtype="float16", **OPTS) not in (
        bf16_path, cache_path("synthetic", tmp_path, **OPTS))

    first = load_dataset("synthetic", tmp_path, feature_dtype=torch.bfloat16, **OPTS)
    assert sorted(p.name for p in (tmp_path / "betty-cache").iterdir()) == [bf16_path.name]  # no float32 entry
    assert json.loads((bf16_path / "manifest.json").read_text())["arrays"]["feat"]["dtype"] == "bfloat16"
    plain = load_dataset("synthetic", tmp_path, cache=False, **OPTS)
    assert plain.feat.dtype == torch.float32 and first.feat.dtype == torch.bfloat16
    assert torch.equal(first.feat.view(torch.int16), plain.feat.to(torch.bfloat16).view(torch.int16))

    casts = []
    real_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: casts.append(self.dtype) or real_to(self, *a, **k))
    second = load_dataset("synthetic", tmp_path, feature_dtype="bfloat16", **OPTS)
    monkeypatch.undo()
    assert len(generator_calls) == 2  # the bf16 build and the uncached float32 load: a hit
    assert second.feat.dtype == torch.bfloat16 and torch.float32 not in casts
    assert _mapped_file(second.feat) == str(bf16_path / "feat.bin")
    assert torch.equal(second.feat.view(torch.int16), first.feat.view(torch.int16))
    assert sorted(p.name for p in (tmp_path / "betty-cache").iterdir()) == [bf16_path.name]
    f32 = load_dataset("synthetic", tmp_path, feature_dtype="float32", **OPTS)  # a float32 entry beside it
    assert f32.feat.dtype == torch.float32 and _mapped_file(f32.feat) == str(
        cache_path("synthetic", tmp_path, **OPTS) / "feat.bin")
    assert torch.equal(load_dataset("synthetic", tmp_path, feature_dtype="float16", cache=False, **OPTS).feat,
                       plain.feat.to(torch.float16))
    with pytest.raises(ValueError, match="feature_dtype='int8'"):
        load_dataset("synthetic", tmp_path, feature_dtype="int8", **OPTS)
    with pytest.raises(ValueError, match="feature_dtype=torch.float64"):
        load_dataset("synthetic", tmp_path, feature_dtype=torch.float64, **OPTS)


def test_a_cache_that_cannot_be_written_still_gives_the_dataset(tmp_path, monkeypatch):
    """A full disk, a quota or a read-only root: the dataset built in memory is returned,
    with a warning naming the cache and the way around it, instead of the write's error."""
    import errno

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache_module, "save_cached", full)
    with pytest.warns(UserWarning, match=r"could not write betty's cache at .*No space left.*cache=False"):
        ds = load_dataset("synthetic", root=tmp_path, **OPTS)
    assert ds.num_nodes == 600 and ds.feat.shape[0] == 600
