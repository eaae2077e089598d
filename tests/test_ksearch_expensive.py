"""``k: auto`` with an expensive partitioner: K is searched with ``reg``, the expensive
method splits once at that K, is re-estimated and steps K up while it does not fit."""

from __future__ import annotations

import pytest
import torch

from betty.memory import ModelSpec, estimate_micro_batch, search_k
from betty.partition import PartitionResult, partition_batch
from betty.sampling import sample_full_batch
from graphs import power_law_graph


@pytest.fixture(scope="module")
def setup():
    g, _, _, train = power_law_graph(num_nodes=700, avg_degree=8, num_feats=12, seed=2)
    batch = sample_full_batch(g, train, [4, 6, 8], seed=0)
    spec = ModelSpec.from_config("sage", 12, 5, hidden=32, layers=3, aggregator="lstm")
    budget = estimate_micro_batch(batch, spec, "adam", fresh_grads=True).peak // 4
    return batch, spec, budget


def _spy(calls, skew_at=None):
    """A partition_fn recording (method, K); with ``skew_at = (method, K)`` that split
    puts all but K - 1 outputs into micro-batch 0 (so it cannot fit)."""

    def fn(batch, k, method, *, seed, weights, graph):
        calls.append((method, k))
        if skew_at == (method, k):
            groups = torch.zeros(batch.num_outputs, dtype=torch.int64)
            groups[: k - 1] = torch.arange(1, k)
            return PartitionResult(groups, k, method)
        return partition_batch(batch, k, method, seed=seed, weights=weights, graph=graph,
                               options={"threads": 1, "deterministic": True})

    return fn


@pytest.mark.parametrize("method", ["hypergraph", "reg-all"])
def test_expensive_method_runs_once_at_the_k_reg_chose(setup, method):
    batch, spec, budget = setup
    calls: list = []
    res = search_k(batch, spec, "adam", memory_budget=budget, safety_margin=0.0,
                   method=method, partition_fn=_spy(calls))
    reg = search_k(batch, spec, "adam", memory_budget=budget, safety_margin=0.0, method="reg")
    expensive = [k for m, k in calls if m == method]
    assert [m for m, _ in calls[: len(calls) - len(expensive)]] == ["reg"] * (len(calls) - len(expensive))
    assert expensive[0] == reg.k
    assert res.partition.method == method and res.k == expensive[-1]
    assert res.max_peak <= res.usable_budget
    if res.k == reg.k:
        assert len(expensive) == 1


def test_expensive_split_over_budget_steps_k_up(setup):
    batch, spec, budget = setup
    reg = search_k(batch, spec, "adam", memory_budget=budget, safety_margin=0.0, method="reg")
    calls: list = []
    res = search_k(batch, spec, "adam", memory_budget=budget, safety_margin=0.0,
                   method="hypergraph", partition_fn=_spy(calls, skew_at=("hypergraph", reg.k)))
    expensive = [k for m, k in calls if m == "hypergraph"]
    assert expensive[0] == reg.k and len(expensive) >= 2
    assert res.k > reg.k and res.partition.method == "hypergraph"
    assert res.max_peak <= res.usable_budget
    assert (reg.k, max(m for k, m in res.tried if k == reg.k)) in res.tried


def test_screen_method_none_searches_with_the_method_itself(setup):
    batch, spec, budget = setup
    calls: list = []
    search_k(batch, spec, "adam", memory_budget=budget, safety_margin=0.0, method="reg-all",
             partition_fn=_spy(calls), screen_method=None)
    assert {m for m, _ in calls} == {"reg-all"}
