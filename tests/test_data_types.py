"""GraphDataset enforces its conventions and summarizes itself in plain numbers."""

from __future__ import annotations

import pytest
import torch

from betty.data import GraphDataset
from betty.data.graph_build import canonical_edges
from betty.graph import Graph


def _fields(**override) -> dict:
    g = Graph(torch.tensor([0, 1, 2, 2]), torch.tensor([1, 0, 0, 2]), 4)
    fields = dict(
        name="t",
        graph=g,
        feat=torch.zeros(4, 3),
        label=torch.tensor([0, 0, 1, -1]),
        train_idx=torch.tensor([0, 1]),
        valid_idx=torch.tensor([2]),
        test_idx=torch.tensor([3]),
        num_classes=2,
    )
    fields.update(override)
    return fields


def test_valid_dataset_stats():
    stats = GraphDataset(**_fields()).stats()
    assert stats["num_nodes"] == 4 and stats["num_edges"] == 4
    assert stats["max_in_degree"] == 2 and stats["num_zero_in_degree"] == 1  # node 3
    assert stats["num_self_loops"] == 1 and stats["mean_in_degree"] == 1.0
    # labelled-both-ends edges: 0->1 (same), 1->0 (same), 2->0 (differ), 2->2 (same)
    assert stats["edge_homophily"] == pytest.approx(3 / 4)
    assert all(type(v) in (int, float) for v in stats.values())


@pytest.mark.parametrize(
    "override, message",
    [
        (dict(feat=torch.zeros(4, 3, dtype=torch.float64)), "feat must be (4, F) float32"),
        (dict(label=torch.zeros(4, dtype=torch.int32)), "label must be (4,) int64"),
        (dict(label=torch.zeros(4, 2), multilabel=True, num_classes=3), "label must be (4, 3) float32"),
        (dict(train_idx=torch.tensor([0, 4])), "train_idx holds node IDs outside [0, 4)"),
        (dict(valid_idx=torch.tensor([[1]])), "valid_idx must be (n,) int64"),
        (dict(graph=object()), "graph must be a betty.graph.Graph"),
    ],
)
def test_contract_violations_are_reported(override, message):
    with pytest.raises(ValueError) as err:
        GraphDataset(**_fields(**override))
    assert message in str(err.value)


def test_canonical_edges_bidirected_simple():
    src = torch.tensor([0, 1, 1, 2, 3])
    dst = torch.tensor([1, 0, 2, 2, 0])
    s, d = canonical_edges(src, dst, 4, to_bidirected=True)
    assert list(zip(s.tolist(), d.tolist())) == [(0, 1), (0, 3), (1, 0), (1, 2), (2, 1), (3, 0)]
    s, d = canonical_edges(src, dst, 4)
    assert list(zip(s.tolist(), d.tolist())) == [(0, 1), (1, 0), (1, 2), (3, 0)]
