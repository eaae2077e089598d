"""argsort_runs against torch's stable argsort, on runs, ties and arbitrary order."""

import pytest
import torch

from betty.ordering import argsort_runs


@pytest.mark.parametrize("make", [
    lambda g: torch.cat([torch.sort(torch.randint(0, 1000, (n,), generator=g)).values for n in (50, 300, 7)]),
    lambda g: torch.randint(0, 20, (400,), generator=g),  # many ties: their order must hold
    lambda g: torch.randperm(500, generator=g),
    lambda g: torch.empty(0, dtype=torch.int64),
])
def test_argsort_runs_is_torch_stable_argsort(make):
    values = make(torch.Generator().manual_seed(0))
    order = argsort_runs(values)
    assert order.dtype == torch.int64
    assert torch.equal(order, torch.argsort(values, stable=True))


def test_argsort_runs_rejects_a_matrix():
    with pytest.raises(ValueError, match="1-D"):
        argsort_runs(torch.zeros(2, 2, dtype=torch.int64))
