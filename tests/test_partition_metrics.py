"""split_metrics (no carving) against brute force through betty.microbatch.split."""

import pytest
import torch

from betty.microbatch import split
from betty.partition import split_metrics
from betty.partition.membership import micro_batch_membership
from betty.partition.planted import planted_community_graph
from betty.sampling import sample_full_batch


def _batch(fanouts, seed):
    graph, _ = planted_community_graph(500, 5, avg_degree=7.0, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    outputs = torch.sort(torch.randperm(500, generator=gen)[:80]).values
    return sample_full_batch(graph, outputs, fanouts, seed=seed)


def _brute_force(batch, groups, k):
    micro_batches = split(batch, groups, k)
    per_layer = [
        sum(mb.layers[l].num_src for mb in micro_batches) / batch.layers[l].num_src
        for l in range(batch.num_layers)
    ]
    inputs = [mb.layers[0].num_src for mb in micro_batches]
    return per_layer, inputs, [mb.num_outputs for mb in micro_batches]


@pytest.mark.parametrize("fanouts", [[3, 5], [2, 3, 4], [-1]])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_split_metrics_equal_carving(fanouts, k):
    batch = _batch(fanouts, seed=k)
    gen = torch.Generator().manual_seed(k)
    groups = torch.randint(0, k, (batch.num_outputs,), generator=gen)
    groups[:k] = torch.arange(k)  # no empty micro-batch
    m = split_metrics(batch, groups, k)
    per_layer, inputs, outputs = _brute_force(batch, groups, k)
    assert m["redundancy_per_layer"] == pytest.approx(per_layer, rel=0, abs=1e-12)
    assert m["redundancy"] == m["redundancy_per_layer"][0]
    assert m["input_nodes_per_micro_batch"] == inputs
    assert m["outputs_per_micro_batch"] == outputs
    assert m["imbalance"] == pytest.approx(max(inputs) / (sum(inputs) / k), abs=1e-12)
    if k == 1:
        assert per_layer == [1.0] * batch.num_layers


def test_micro_batch_membership_lists_the_carved_sources():
    batch = _batch([3, 4], seed=11)
    k = 4
    groups = torch.arange(batch.num_outputs) % k
    members = micro_batch_membership(batch, groups, k)
    for p, mb in enumerate(split(batch, groups, k)):
        for l in range(batch.num_layers):
            row = members[l][p]
            carved = set(mb.full_src_index[l].tolist())
            assert set(row.indices.tolist()) == carved
            assert members[l].shape == (k, batch.layers[l].num_src)


def test_split_metrics_rejects_an_invalid_partition():
    batch = _batch([3], seed=0)
    with pytest.raises(ValueError, match="empty"):
        split_metrics(batch, torch.zeros(batch.num_outputs, dtype=torch.int64), 2)
