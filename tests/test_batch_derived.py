"""What is derived from one sampled batch is built once and shared: layer incidences,
the REG of a K search, the micro-batch membership of the latest split."""

import copy

import pytest
import torch

from betty.batch import SampledBatch
from betty.memory.sizes import split_sizes
from betty.partition import incidence, partition_batch, reg, split_metrics
from betty.partition.membership import micro_batch_membership
from betty.partition.planted import planted_community_graph
from betty.sampling import sample_full_batch


def _batch(seed=3):
    graph, _ = planted_community_graph(600, 6, avg_degree=8.0, seed=seed)
    outputs = torch.sort(torch.randperm(600, generator=torch.Generator().manual_seed(seed))[:120]).values
    return graph, sample_full_batch(graph, outputs, [4, 6], seed=seed)


def _fresh(batch: SampledBatch) -> SampledBatch:
    """The same batch with nothing derived yet."""
    return SampledBatch(layers=copy.deepcopy(batch.layers), fanouts=list(batch.fanouts))


def _counting(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def test_derived_computes_once_per_key_and_a_slot_keeps_only_the_latest():
    _, batch = _batch()
    made = []
    assert batch.derived(("a",), lambda: made.append("a") or 1) == 1
    assert batch.derived(("a",), lambda: made.append("a") or 2) == 1
    batch.derived(("s", 1), lambda: made.append("s1") or "one", slot="s")
    batch.derived(("s", 2), lambda: made.append("s2") or "two", slot="s")
    assert batch.derived(("s", 1), lambda: made.append("s1 again") or "one", slot="s") == "one"
    assert made == ["a", "s1", "s2", "s1 again"]
    assert ("s", 2) not in batch._derived and ("a",) in batch._derived


def test_estimate_and_split_metrics_of_one_split_build_the_membership_once(monkeypatch):
    _, batch = _batch()
    k = 4
    groups = torch.arange(batch.num_outputs) % k
    layer_calls = _counting(monkeypatch, incidence, "needed_sources")
    sizes = split_sizes(batch, groups, k)
    metrics = split_metrics(batch, groups, k)
    assert len(layer_calls) == batch.num_layers  # each layer's incidence built once
    assert micro_batch_membership(batch, groups, k) is micro_batch_membership(batch, groups, k)
    fresh = _fresh(batch)
    assert split_metrics(fresh, groups, k) == metrics
    assert [x.tolist() for x in split_sizes(fresh, groups, k).n_src] == [x.tolist() for x in sizes.n_src]


def test_another_split_gets_its_own_membership():
    _, batch = _batch()
    k = 4
    first = torch.arange(batch.num_outputs) % k
    second = torch.flip(first, [0]).roll(1)
    split_metrics(batch, first, k)
    assert split_metrics(batch, second, k) == split_metrics(_fresh(batch), second, k)
    assert split_metrics(batch, second[: batch.num_outputs] % 3, 3) == split_metrics(_fresh(batch), second % 3, 3)


def test_a_k_search_builds_the_reg_once_and_splits_as_a_fresh_batch_would(monkeypatch):
    graph, batch = _batch()
    built = _counting(monkeypatch, reg, "redundancy_graph")
    results = {k: partition_batch(batch, k, "reg", seed=0, graph=graph) for k in (2, 4, 8)}
    assert len(built) == 1
    for k, result in results.items():
        assert torch.equal(result.groups, partition_batch(_fresh(batch), k, "reg", seed=0, graph=graph).groups)
    reg.reg_partition(batch, 4, seed=0, max_hub_degree=3)  # another REG: rebuilt
    assert len(built) == 1 + 3 + 1
    with pytest.raises(ValueError):
        micro_batch_membership(batch, torch.zeros(batch.num_outputs + 1, dtype=torch.int64), 2)
