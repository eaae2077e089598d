"""betty's processed-dataset cache: hits, misses on option changes, atomic writes."""

from __future__ import annotations

import pytest
import torch

import betty.data.synthetic as synthetic_module
from betty.data import cache_path, load_dataset
from betty.data import cache as cache_module

OPTS = dict(num_nodes=600, avg_degree=6.0, num_communities=10, num_classes=4)


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
    assert path.is_file() and path.parent == tmp_path / "betty-cache"
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
    assert len(generator_calls) == 2 and changed.is_file()
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
    def crash_midway(obj, fh, *args, **kwargs):
        fh.write(b"partial bytes of a cache file")
        raise KeyboardInterrupt

    monkeypatch.setattr(cache_module.torch, "save", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        load_dataset("synthetic", root=tmp_path, **OPTS)
    assert list((tmp_path / "betty-cache").iterdir()) == []  # no final file, no temp file
    monkeypatch.undo()
    load_dataset("synthetic", root=tmp_path, **OPTS)
    assert cache_path("synthetic", tmp_path, **OPTS).is_file()


def test_damaged_cache_is_recomputed(tmp_path, generator_calls):
    first = load_dataset("synthetic", root=tmp_path, **OPTS)
    path = cache_path("synthetic", tmp_path, **OPTS)
    path.write_bytes(b"not a torch file")
    with pytest.warns(UserWarning, match="ignoring dataset cache .*content differs from its recorded SHA-256"):
        again = load_dataset("synthetic", root=tmp_path, **OPTS)
    assert len(generator_calls) == 2
    _same(first, again)
    load_dataset("synthetic", root=tmp_path, **OPTS)  # the rewritten file is good
    assert len(generator_calls) == 2


def test_changed_cache_content_is_rebuilt(tmp_path, generator_calls):
    """A cache file that still loads but whose labels were shifted is not used."""
    first = load_dataset("synthetic", root=tmp_path, **OPTS)
    path = cache_path("synthetic", tmp_path, **OPTS)
    state = torch.load(path, weights_only=True)
    state["label"] = (state["label"] + 1) % state["num_classes"]
    torch.save(state, path)
    with pytest.warns(UserWarning, match="content differs from its recorded SHA-256"):
        again = load_dataset("synthetic", root=tmp_path, **OPTS)
    assert len(generator_calls) == 2
    _same(first, again)
    load_dataset("synthetic", root=tmp_path, **OPTS)  # the rebuilt file and digest agree
    assert len(generator_calls) == 2


def test_cache_without_digest_is_rebuilt(tmp_path, generator_calls):
    load_dataset("synthetic", root=tmp_path, **OPTS)
    cache_module.digest_file(cache_path("synthetic", tmp_path, **OPTS)).unlink()
    with pytest.warns(UserWarning, match="has no readable content digest"):
        load_dataset("synthetic", root=tmp_path, **OPTS)
    assert len(generator_calls) == 2


def test_directory_in_place_of_the_cache_file_is_rebuilt(tmp_path, generator_calls):
    first = load_dataset("synthetic", root=tmp_path, **OPTS)
    path = cache_path("synthetic", tmp_path, **OPTS)
    path.unlink()
    (path / "inner").mkdir(parents=True)
    with pytest.warns(UserWarning, match="is not a regular file"):
        again = load_dataset("synthetic", root=tmp_path, **OPTS)
    assert path.is_file() and len(generator_calls) == 2
    _same(first, again)


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
