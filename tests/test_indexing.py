"""argsort_runs, take and put against the torch ops they replace."""

import pytest
import torch

from betty.indexing import argsort_runs, put, put_rows, take, take_rows


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


def test_take_and_put_are_torch_indexing():
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.int32, torch.int64, torch.float32, torch.bool):
        table = torch.randint(0, 2, (500,), generator=gen).to(dtype)
        index = torch.randint(0, 500, (900,), generator=gen)
        assert torch.equal(take(table, index), table[index])
        assert take(table, index).dtype == dtype
    table = torch.zeros(100, dtype=torch.int64)
    index = torch.tensor([3, 7, 7, 99])
    put(table, index, 5)
    want = torch.zeros(100, dtype=torch.int64)
    want[index] = 5
    assert torch.equal(table, want)
    values = torch.arange(4) + 10
    put(table, index[:2], values[:2])
    want[index[:2]] = values[:2]
    assert torch.equal(table, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_take_rows_and_put_rows_are_torch_indexing(dtype):
    gen = torch.Generator().manual_seed(2)
    table = (torch.randn(300, 4, generator=gen) * 100).to(dtype)
    index = torch.randint(0, 300, (500,), generator=gen)
    rows = take_rows(table, index)
    assert rows.dtype == dtype and torch.equal(rows, table[index])
    out, want = torch.zeros(600, 4, dtype=dtype), torch.zeros(600, 4, dtype=dtype)
    at = torch.randperm(600, generator=gen)[:500]
    put_rows(out, at, rows)
    want[at] = rows
    assert torch.equal(out, want)
