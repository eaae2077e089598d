"""synthetic-papers: generated straight to disk in bounded memory, and trainable."""

from __future__ import annotations

import json
import tracemalloc

import pytest
import torch

from betty.data import cache_path, load_dataset
from betty.data.store import gather_rows
from betty.data.synthetic_papers import papers_counts, write_synthetic_papers

OPTS = {"scale": 2e-4, "seed": 0, "feature_snr": 0.5, "chunk_edges": 1 << 13}


def _peak_bytes(folder, opts) -> tuple[int, int]:
    """(tracemalloc peak while generating, bytes written)."""
    tracemalloc.start()
    try:
        write_synthetic_papers(folder, opts)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak, sum(p.stat().st_size for p in folder.iterdir())


def test_generator_memory_is_bounded_by_its_block_not_the_output(tmp_path):
    small, small_out = _peak_bytes(tmp_path / "a", OPTS)
    large, large_out = _peak_bytes(tmp_path / "b", {**OPTS, "scale": 4 * OPTS["scale"]})
    assert large_out > 3.5 * small_out
    assert large < small_out / 4, (large, small_out)  # far below even the smaller output
    assert large < 1.6 * small, (small, large)  # grows with the splits only, not the graph


def test_generated_store_has_the_shape_and_is_canonical(tmp_path):
    ds = load_dataset("synthetic-papers", tmp_path, **OPTS)
    counts = papers_counts(OPTS["scale"])
    assert ds.num_nodes == counts["num_nodes"] and ds.feat.shape == (ds.num_nodes, 128)
    assert abs(ds.num_edges / counts["num_edges"] - 1) < 0.05 and ds.num_classes == 172
    assert [ds.train_idx.numel(), ds.valid_idx.numel(), ds.test_idx.numel()] == [
        counts["num_train"], counts["num_valid"], counts["num_test"]]
    split = torch.cat([ds.train_idx, ds.valid_idx, ds.test_idx])
    assert torch.unique(split).numel() == split.numel()
    labelled = torch.nonzero(ds.label >= 0).view(-1)
    assert torch.equal(labelled, torch.sort(split).values)  # only the split nodes are labelled
    indptr, indices, eid = ds.graph.in_csr
    assert eid is None and indices.dtype == torch.int32 and "src" not in ds.graph.__dict__
    rows = torch.repeat_interleave(torch.arange(ds.num_nodes), torch.diff(indptr))
    key = rows * ds.num_nodes + indices.to(torch.int64)
    assert bool((key[1:] >= key[:-1]).all())  # canonical order: by row, then source
    manifest = json.loads((cache_path("synthetic-papers", tmp_path, **OPTS) / "manifest.json").read_text())
    again = tmp_path / "again"
    write_synthetic_papers(again, OPTS)
    assert json.loads((again / "manifest.json").read_text())["arrays"] == manifest["arrays"]  # seeded
    with pytest.raises(ValueError, match="cache=False"):
        load_dataset("synthetic-papers", tmp_path, cache=False, **OPTS)
    with pytest.raises(ValueError, match="scale"):
        load_dataset("synthetic-papers", tmp_path, scale=0)


@pytest.mark.parametrize("workers", [1, 3])
def test_gather_rows_reads_sorted_chunks_and_equals_indexing(workers, monkeypatch):
    import betty.data.store as store
    from betty import workers as prep

    ids = torch.randint(0, 1000, (777,))
    monkeypatch.setattr(prep, "_count", workers)  # restored after the test
    for table in (torch.randn(1000, 3), torch.randn(1000, 2, 2).to(torch.bfloat16),
                  torch.arange(1000, dtype=torch.int32)[:, None]):
        for chunk in (1, 7, 10_000):
            got = gather_rows(table, ids, chunk_rows=chunk)
            assert got.dtype == table.dtype and torch.equal(got, table[ids])

    prep.set_prep_workers(1)  # one thread: the chunks come in order
    seen = []
    take_rows = store.take_rows

    def recording(rows_of, at):
        seen.append(at.clone())
        return take_rows(rows_of, at)

    monkeypatch.setattr(store, "take_rows", recording)
    gather_rows(torch.randn(1000, 3), ids, chunk_rows=100)
    flat = torch.cat(seen)
    assert len(seen) == 8 and bool((flat[1:] >= flat[:-1]).all())  # front to back, in chunks



def test_gather_rows_into_a_kept_buffer_reuses_its_storage():
    table = torch.randn(1000, 3)
    buf = torch.empty(800, 3)
    ptr = buf.data_ptr()
    for n in (777, 800, 5, 801, 900):
        ids = torch.randint(0, 1000, (n,))
        got = gather_rows(table, ids, out=buf)
        assert got.shape == (n, 3) and torch.equal(got, table[ids])
        assert (got.data_ptr() == ptr) == (n <= 800)  # its storage while it is large enough
        buf = got
    assert buf.untyped_storage().nbytes() == (801 + 801 // 8) * 3 * 4  # outgrown: room to grow
    with pytest.raises(ValueError, match="out is torch.float64, the table torch.float32"):
        gather_rows(table, ids, out=torch.empty(5, 3, dtype=torch.float64))


@pytest.mark.slow
def test_an_epoch_of_sage_mean_trains_with_k_from_the_memory_model(tmp_path, monkeypatch):
    """Read out of core (any mapped table counts, here): K from the memory model, and no
    page of the features or the CSR stays mapped after the epoch."""
    import betty.pages
    from betty.engine import PartitionPlan, Trainer
    from betty.models import build_model

    monkeypatch.setattr(betty.pages, "OUT_OF_CORE_FRACTION", 0.0)

    ds = load_dataset("synthetic-papers", tmp_path, **OPTS)
    torch.manual_seed(0)
    model = build_model("sage", 128, 172, hidden=16, layers=2, aggregator="mean")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    plan = PartitionPlan(method="random", k="auto", memory_budget=3 << 20)
    trainer = Trainer(model, optimizer, ds, [5, 10], plan, seed=0)
    record = trainer.train_epoch(0)
    assert record.k > 1  # the budget forced a split
    assert torch.isfinite(torch.tensor(record.loss))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # the pages the sampler and the gathers read were handed back: the process holds none
    from betty.pages import resident_bytes

    assert resident_bytes([ds.feat, *ds.graph.in_csr[1:]]) == 0


def test_bfloat16_features_are_written_block_by_block_and_mapped(tmp_path, monkeypatch):
    """``feature_dtype=bfloat16``: the generator casts each block's float32 draw as it
    appends it (every chunk reaching the feature file's writer is one block, never the
    whole matrix), the entry is its own, the float32 one's key unchanged, and the
    loaded features are the float32 entry's cast to bfloat16, mapped from the file."""
    from betty.data import dataset_digest
    from betty.data import store as store_module
    from betty.data.cache import cache_key
    from test_data_cache import _mapped_file

    opts = {**OPTS, "scale": 4 * OPTS["scale"]}
    f32_key = cache_key({"name": "synthetic-papers", "options": opts, "source": []})
    assert dataset_digest("synthetic-papers", tmp_path, **opts) == f32_key
    feat_chunks = []
    real = store_module.ArrayWriter.append

    def spy(self, chunk):
        if self.path.name == "feat.bin":
            feat_chunks.append((self.dtype, len(chunk)))
        real(self, chunk)

    monkeypatch.setattr(store_module.ArrayWriter, "append", spy)
    bf16 = load_dataset("synthetic-papers", tmp_path, feature_dtype="bfloat16", **opts)
    n = papers_counts(opts["scale"])["num_nodes"]
    assert len(feat_chunks) > 1 and {d for d, _ in feat_chunks} == {torch.bfloat16}
    assert max(rows for _, rows in feat_chunks) < n and sum(rows for _, rows in feat_chunks) == n
    path = cache_path("synthetic-papers", tmp_path, feature_dtype=torch.bfloat16, **opts)
    assert path.name != f"synthetic-papers-{f32_key}"
    assert json.loads((path / "manifest.json").read_text())["arrays"]["feat"]["dtype"] == "bfloat16"
    assert bf16.feat.dtype == torch.bfloat16 and _mapped_file(bf16.feat) == str(path / "feat.bin")
    f32 = load_dataset("synthetic-papers", tmp_path, **opts)
    assert cache_path("synthetic-papers", tmp_path, **opts).name == f"synthetic-papers-{f32_key}"
    assert f32.feat.dtype == torch.float32
    assert torch.equal(bf16.feat.view(torch.int16), f32.feat.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(bf16.graph.in_csr[1], f32.graph.in_csr[1]) and torch.equal(bf16.label, f32.label)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_gather_rows_into_pinned_memory_for_a_device_copy():
    table = torch.randn(1000, 3)
    ids = torch.randint(0, 1000, (777,))
    rows = gather_rows(table, ids, pin=True)
    assert rows.is_pinned() and torch.equal(rows, table[ids])
    assert torch.equal(rows.to("cuda", non_blocking=True).cpu(), table[ids])


def test_a_root_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    """synthetic-papers is generated straight into the cache: where that cannot be
    written the error says so (an OSError keeping its errno), not a bare traceback."""
    import errno

    import betty.data.synthetic_papers as papers

    def refuse(folder, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(folder))

    monkeypatch.setattr(papers, "write_synthetic_papers", refuse)
    with pytest.raises(OSError, match="generated straight into betty's cache and could not be written") as err:
        load_dataset("synthetic-papers", tmp_path, **OPTS)
    assert err.value.errno == errno.EACCES
