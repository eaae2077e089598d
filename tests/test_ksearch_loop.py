"""The one K-search loop (betty.memory.ksearch.smallest_fitting_k) on synthetic
split-and-estimate callables: no model, no graph, exact expectations."""

from __future__ import annotations

import math

import pytest

from betty.memory.estimator import MemoryEstimate
from betty.memory.ksearch import KSearchError, smallest_fitting_k

FIXED = 1_000


def _model(activation: int, *, bumps: dict[int, int] | None = None, calls: list | None = None,
           floor: int = 0, micro_batches: int | None = None):
    """Micro-batches whose peak is ``FIXED + floor + ceil(activation / k)`` (+ ``bumps[k]``);
    ``micro_batches``: how many of the k (all equal) are returned (default all)."""

    def split_and_estimate(k: int):
        if calls is not None:
            calls.append(k)
        peak = FIXED + floor + math.ceil(activation / k) + (bumps or {}).get(k, 0)
        est = MemoryEstimate(peak=peak, breakdown={"parameters": FIXED, "activations": peak - FIXED})
        n = k if micro_batches is None else micro_batches
        return [f"micro-batch{i}" for i in range(n)], [est] * n

    return split_and_estimate


@pytest.mark.parametrize("activation,budget", [(100_000, 5_000), (100_000, 1_900), (7_777, 2_000),
                                               (50_000, 60_000)])
def test_returns_the_smallest_fitting_k_of_a_monotone_model(activation, budget):
    calls: list[int] = []
    found = smallest_fitting_k(_model(activation, calls=calls), memory_budget=budget,
                               safety_margin=0.0, fixed=FIXED, k_max=10_000)
    expected = next(k for k in range(1, 10_001) if FIXED + math.ceil(activation / k) <= budget)
    assert found.k == expected and len(found.split) == expected
    assert max(e.peak for e in found.estimates) <= budget
    assert [k for k, _ in found.tried] == calls and calls[0] == 1
    assert len(set(calls)) == len(calls), "each K is split and estimated once"
    if expected > 1:
        assert dict(found.tried)[expected - 1] > budget  # K - 1 was estimated and failed
        assert len(calls) < 12  # lower bound + jumps + bisection, not a linear scan


def test_never_returns_an_unfit_k_when_the_model_is_not_monotone():
    # K = 20 is the lower bound but its split is unusually bad: the search must go past it
    found = smallest_fitting_k(_model(100_000, bumps={20: 10_000}), memory_budget=6_000,
                               safety_margin=0.0, fixed=FIXED, k_max=1_000)
    assert found.k == 21 and dict(found.tried)[20] > 6_000


def test_start_k_steps_up_without_bisecting():
    calls: list[int] = []
    found = smallest_fitting_k(_model(100_000, calls=calls), memory_budget=6_000,
                               safety_margin=0.0, fixed=FIXED, k_max=1_000, start_k=30,
                               tried=[(7, 123)])
    assert calls == [30] and found.k == 30 and found.tried == [(7, 123), (30, FIXED + 3334)]
    calls.clear()  # K = 17 does not fit (6883 bytes): one overshoot jump, to 22
    found = smallest_fitting_k(_model(100_000, calls=calls), memory_budget=6_000,
                               safety_margin=0.0, fixed=FIXED, k_max=1_000, start_k=17)
    assert calls == [17, 22] and found.k == 22 and max(e.peak for e in found.estimates) <= 6_000


def test_the_budget_an_error_advises_is_the_smallest_that_fits():
    """``smallest_budget`` is exact where float rounding of ``budget · (1 − margin)`` would
    put ``ceil(peak / (1 − margin))`` a byte short (a case found by a random search)."""
    from betty.memory.ksearch import BudgetExceeded, check_fixed_k, smallest_budget, usable_budget

    peak, margin = 7_582_861_706, 0.3
    need = smallest_budget(peak, margin)
    assert usable_budget(need, margin) >= peak > usable_budget(need - 1, margin)
    check_fixed_k([peak], 4, need, margin)  # the advised budget fits
    with pytest.raises(BudgetExceeded) as err:
        check_fixed_k([peak], 4, need - 1, margin)
    assert err.value.smallest_budget == need


def test_errors_name_the_cause_and_a_budget_that_works():
    with pytest.raises(KSearchError, match="fixed costs") as err:
        smallest_fitting_k(_model(10), memory_budget=900, safety_margin=0.0, fixed=FIXED, k_max=5)
    assert err.value.smallest_budget == FIXED + 10 and err.value.tried == [(1, FIXED + 10)]  # K = 1 fits it
    assert smallest_fitting_k(_model(10), memory_budget=err.value.smallest_budget, safety_margin=0.0, fixed=FIXED,
                              k_max=5).k == 1

    with pytest.raises(KSearchError, match="one output node per micro-batch") as err:
        smallest_fitting_k(_model(100_000), memory_budget=5_000, safety_margin=0.5, fixed=FIXED,
                           k_max=8)
    worst = FIXED + 12_500
    assert err.value.dominant == "activations" and err.value.smallest_budget == 2 * worst
    assert smallest_fitting_k(_model(100_000), memory_budget=2 * worst, safety_margin=0.5,
                              fixed=FIXED, k_max=8).k == 8

    # every K >= 2 costs more than the whole batch (a second gradient while accumulating):
    # the advice is the budget of K = 1, and that budget then fits
    dearer = _model(500, bumps={k: 800 - math.ceil(500 / k) for k in range(2, 9)})
    with pytest.raises(KSearchError, match="one output node per micro-batch") as err:
        smallest_fitting_k(dearer, memory_budget=FIXED + 400, safety_margin=0.0, fixed=FIXED, k_max=8)
    assert err.value.smallest_budget == FIXED + 500 and "at K = 1 " in str(err.value)
    assert smallest_fitting_k(dearer, memory_budget=err.value.smallest_budget, safety_margin=0.0,
                              fixed=FIXED, k_max=8).k == 1

    class Custom(KSearchError):
        pass

    with pytest.raises(Custom, match="max_evaluations=2") as err:
        smallest_fitting_k(_model(100_000), memory_budget=1_100, safety_margin=0.0, fixed=FIXED,
                           k_max=10_000, max_evaluations=2, error_cls=Custom)
    assert len(err.value.tried) == 2



def test_a_floor_no_split_removes_is_crossed_in_few_evaluations():
    """Where ``M(K) − F`` shrinks toward a floor (not like ``1 / K``), the overshoot jumps
    alone creep up by about 5% a step and ran out of ``max_evaluations`` before K = 10^6;
    doubling after two short jumps reaches it, and the bisection still returns the
    smallest fitting K."""
    calls: list[int] = []
    budget = 2_000  # FIXED + 990 + ceil(10^7 / K) fits from K = 10^6
    found = smallest_fitting_k(_model(10**7, floor=990, calls=calls, micro_batches=1), memory_budget=budget,
                               safety_margin=0.0, fixed=FIXED, k_max=2 * 10**6)
    assert found.k == 10**6 and dict(found.tried)[10**6 - 1] > budget
    assert len(calls) <= 30
