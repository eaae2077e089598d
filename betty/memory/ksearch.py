"""Choose K from the memory model: a small K whose largest micro-batch fits.

With usable budget ``U = memory_budget · (1 − safety_margin)`` and ``M(K)`` the largest
estimated peak over the micro-batches of the K-way partition (:func:`~betty.memory.estimator.
estimate_micro_batches`), :func:`search_k` looks for a small K with ``M(K) <= U``. It never
trains: it only partitions and estimates.

1. **Start.** Estimate the full batch (K = 1): ``M(1) = F + A`` with ``F`` the fixed
   part (parameters, gradients, optimizer state: it does not shrink with K) and ``A`` the
   rest. If ``F >= U`` no K can help (:class:`KSearchError`). Otherwise micro-batches need
   ``A / K <= U − F``, so the search starts at ``K_0 = ceil(A / (U − F))`` (a lower bound
   when splitting adds no redundancy).
2. **Grow.** While ``M(K)`` is over budget, jump by the overshoot ratio,
   ``K ← max(K + 1, ceil(K · (M(K) − F) / (U − F) · 1.05))``, capped at the number of
   output nodes; from the second jump that still does not fit, ``K`` at least doubles
   (where ``M(K) − F`` shrinks slower than ``1 / K``, e.g. toward a floor that no split
   removes, the jumps alone would creep up by 5% a step). If even one output per
   micro-batch does not fit, one output's sampled neighbourhood alone exceeds the budget:
   :class:`KSearchError` names the largest component of the worst micro-batch and the
   smallest budget that would work, that of the cheapest K tried (which may be K = 1:
   every micro-batch after the first holds a second gradient while it accumulates).
3. **Refine.** Binary search between the largest K tried that failed and the smallest
   that fit, down to adjacent integers.

Smallest K (``min_k``, data-parallel training on N ranks: ``min_k = N``): steps 1-3 start
from ``K_lo = min(min_k, outputs)`` instead of 1, so the K returned is ``>= K_lo`` and every
rank gets a micro-batch. The start estimate is ``M(K_lo)``; when it is over budget the first jump
is ``K ← max(K_lo + 1, ceil(K_lo · (M(K_lo) − F) / (U − F)))`` (step 1 for ``K_lo = 1``).
Each rank runs its micro-batches one after another, so its peak is its largest micro-batch's: a K
whose every micro-batch fits ``U`` fits every rank (all ranks have the same budget); the
all-reduce's gradient bucket is left to the safety margin (docs/distributed.md).

Non-monotonicity rule: a K-way partition's largest micro-batch is not always smaller than a
(K − 1)-way one (partitioners are heuristics, balance is in output nodes, redundancy
varies). The binary search uses monotonicity only to decide which K to try next; the
K returned is always one whose actual partition was estimated to fit. A smaller K that
would also fit may be skipped, never an unfit one returned. Every K tried is recorded
with its ``M(K)`` (:attr:`KSearchResult.tried`).

Expensive methods (:data:`betty.partition.EXPENSIVE_METHODS`: ``hypergraph``,
``reg-all``): steps 1-3 run with ``reg`` (``screen_method``), then the expensive method
partitions once at the K found; that split is estimated again and, while it does not
fit, K steps up by the same overshoot rule as step 2 (each step one more expensive
split). The K returned is one whose expensive split was estimated to fit; ``tried``
lists the ``reg`` rounds, then the expensive ones.

The loop itself (steps 1-3, and the stepping of the expensive split) is
:func:`smallest_fitting_k`, over a callable ``split_and_estimate(K) -> (split,
per-micro-batch estimates)``: the sampled-batch search here and the RevGNN one
(:func:`betty.rev.memory.search_k_rev`, cluster parts of the whole graph) both call it.

``balance: memory``: :func:`memory_balance_weights` gives each output node a weight
proportional to its estimated memory (the size of its sampled L-hop neighbourhood per
layer, times the widths that layer stores per node and per edge), passed as
``weights=`` to the partitioner so micro-batches are balanced in memory, not in output count.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from betty.batch import SampledBatch
from betty.checks import is_integer, is_number
from betty.memory.estimator import MemoryEstimate, estimate_micro_batches, persistent_bytes, step_bytes
from betty.memory.spec import as_model_spec, as_optimizer_spec
from betty.precision import Precision

__all__ = [
    "KSearchError",
    "BudgetExceeded",
    "check_fixed_k",
    "check_step_fits",
    "check_memory_budget",
    "check_safety_margin",
    "KSearchResult",
    "search_k",
    "memory_balance_weights",
    "make_k_chooser",
    "make_estimator",
    "usable_budget",
    "smallest_fitting_k",
    "KLoopResult",
    "SplitAndEstimate",
    "DEFAULT_SAFETY_MARGIN",
]

_JUMP_SLACK = 1.05

DEFAULT_SAFETY_MARGIN = 0.05
"""The one default fraction of the memory budget every K search keeps free
(:func:`search_k`, :func:`betty.rev.memory.search_k_rev`, the plans and the spec)."""


class KSearchError(RuntimeError):
    """A K search failed: no K makes the largest micro-batch fit the budget, or the search
    stopped before finding one (``max_evaluations``). Every K-search failure raises
    this class (:class:`betty.rev.memory.RevKSearchError` is a subclass).

    Attributes:
        budget: the memory budget (bytes).
        usable: ``budget · (1 − safety_margin)``.
        dominant: the largest component of the micro-batch that does not fit (``None`` when
            the search stopped before deciding).
        smallest_budget: the smallest budget (bytes, margin included) with which the
            search would succeed at the largest K possible (``None`` when unknown).
        tried: ``[(K, max estimated peak), ...]``.
    """

    def __init__(self, message: str, *, budget: float | None = None, usable: float | None = None,
                 dominant: str | None = None, smallest_budget: int | None = None,
                 tried: list[tuple[int, int]] | None = None) -> None:
        super().__init__(message)
        self.budget, self.usable = budget, usable
        self.dominant, self.smallest_budget = dominant, smallest_budget
        self.tried = list(tried or [])


class BudgetExceeded(KSearchError):
    """A fixed K (``partition.k`` an integer) whose largest micro-batch is estimated over the
    memory budget: training it would silently run past the budget."""


def check_step_fits(step_peak: float, memory_budget: float, safety_margin: float) -> None:
    """Refuse a budget the optimizer step cannot fit whatever K is: ``step_peak`` (the
    parameters, gradients and optimizer state, and the step's temporaries:
    :func:`~betty.memory.estimator.step_bytes`) over ``memory_budget · (1 − safety_margin)``.
    The step runs after every micro-batch, its activations freed, so this is the one
    peak no split lowers."""
    usable = usable_budget(memory_budget, safety_margin)
    if step_peak <= usable:
        return
    need = smallest_budget(step_peak, safety_margin)
    raise KSearchError(
        f"the optimizer step alone ({int(step_peak)} bytes: parameters, gradients, optimizer state "
        f"and the step's temporaries) exceeds the usable budget {int(usable)} bytes (memory_budget "
        f"{int(memory_budget)} with safety_margin {safety_margin}); no K can fit. Smallest budget: "
        f"at least {need} bytes", budget=memory_budget, usable=usable, dominant="optimizer_step",
        smallest_budget=need)


def check_fixed_k(estimates: Sequence[float], k: int, memory_budget: float, safety_margin: float,
                  micro_batch_name: str = "micro-batch") -> None:
    """Refuse a fixed ``k`` whose largest estimated micro-batch exceeds ``memory_budget · (1 −
    safety_margin)``: :class:`BudgetExceeded` names ``partition.k``, the estimated peak,
    the budget and the two ways on (``k: auto``, or a budget large enough)."""
    usable = usable_budget(memory_budget, safety_margin)
    peak = max(estimates)
    if peak <= usable:
        return
    need = smallest_budget(peak, safety_margin)
    raise BudgetExceeded(
        f"partition.k = {k} does not fit partition.memory_budget: its largest {micro_batch_name} is "
        f"estimated at {int(peak)} bytes, over the usable budget {int(usable)} bytes "
        f"(memory_budget {int(memory_budget)} with safety_margin {safety_margin}). Set "
        f"partition.k: auto to choose a K that fits, or raise partition.memory_budget to at "
        f"least {need} bytes", budget=memory_budget, usable=usable, smallest_budget=need,
        tried=[(k, int(peak))])


@dataclass
class KSearchResult:
    """Outcome of :func:`search_k`.

    Attributes:
        k: the chosen number of micro-batches.
        partition: the chosen :class:`~betty.partition.PartitionResult`.
        estimates: per-micro-batch estimates of that partition.
        tried: every ``(K, max estimated peak bytes)`` evaluated, in order.
        usable_budget: ``memory_budget · (1 − safety_margin)``.
    """

    k: int
    partition: object
    estimates: list[MemoryEstimate]
    tried: list[tuple[int, int]] = field(default_factory=list)
    usable_budget: float = 0.0

    @property
    def max_peak(self) -> int:
        return max(e.peak for e in self.estimates)

    def to_dict(self) -> dict:
        """JSON-ready summary (for logging and the CLI)."""
        worst = max(self.estimates, key=lambda e: e.peak)
        return {
            "k": self.k,
            "method": getattr(self.partition, "method", None),
            "usable_budget_bytes": int(self.usable_budget),
            "max_estimated_peak_bytes": int(worst.peak),
            "estimated_peak_bytes_per_micro_batch": [int(e.peak) for e in self.estimates],
            "worst_micro_batch": worst.to_dict(),
            "tried": [{"k": k, "max_estimated_peak_bytes": int(m)} for k, m in self.tried],
        }


def smallest_budget(peak: float, safety_margin: float) -> int:
    """The fewest bytes whose :func:`usable_budget` holds ``peak``: ``ceil(peak / (1 −
    margin))``, moved by a byte where float rounding puts the product on the other side."""
    need = math.ceil(peak / (1 - safety_margin))
    while need > 1 and usable_budget(need - 1, safety_margin) >= peak:
        need -= 1
    while usable_budget(need, safety_margin) < peak:
        need += 1
    return need


def check_k(k, memory_budget) -> None:
    """Refuse a ``k`` that is neither an integer >= 1 nor ``"auto"``, ``"auto"`` without a
    ``memory_budget`` (the K search needs one), and a budget :func:`check_memory_budget`
    refuses."""
    if k != "auto" and not (is_integer(k) and k >= 1):
        raise ValueError(f"k must be an integer >= 1 or 'auto', got {k!r}")
    if k == "auto" and memory_budget is None:
        raise ValueError("k='auto' needs a memory_budget (bytes)")
    if memory_budget is not None:
        check_memory_budget(memory_budget)


def check_memory_budget(memory_budget) -> None:
    """Refuse a ``memory_budget`` that is not a finite number of bytes >= 1."""
    if not is_number(memory_budget) or not 1 <= memory_budget < math.inf:
        raise ValueError(f"memory_budget must be a finite number of bytes >= 1, got {memory_budget!r}")


def check_safety_margin(safety_margin) -> None:
    """Refuse a ``safety_margin`` that is not a number in [0, 1)."""
    if not is_number(safety_margin) or not 0.0 <= safety_margin < 1.0:
        raise ValueError(f"safety_margin must be a number in [0, 1), got {safety_margin!r}")


def usable_budget(memory_budget: float, safety_margin: float) -> float:
    """``memory_budget · (1 − safety_margin)`` after :func:`check_memory_budget` and
    :func:`check_safety_margin`."""
    check_memory_budget(memory_budget)
    check_safety_margin(safety_margin)
    return float(memory_budget) * (1.0 - float(safety_margin))


def memory_balance_weights(batch: SampledBatch, model) -> torch.Tensor:
    """Per-output weights ``(n_out,)`` proportional to each output's estimated memory.

    With ``P_l`` the reachability matrices of :func:`betty.partition.incidence.
    reachability` (``P_l[s, j] = 1`` iff source s of layer l is in output j's sampled
    neighbourhood) and ``deg_l`` the in-degrees of layer l's destinations,

        n_l(j) = Σ_s P_l[s, j]                        (layer-l sources of output j)
        e_l(j) = Σ_d deg_l(d) · P_{l+1}[d, j]          (layer-l edges of output j)
        w_j    = Σ_l ( n_l(j) · (W_l + W_{l+1}) + e_l(j) · W_l · c_edge )

    where ``W_l`` are the model widths and ``c_edge`` the per-edge factor of the
    aggregator (GAT: heads, LSTM: 24, else 0.25 for the index copies). Outputs sharing
    neighbours are each charged fully (the partitioner balances sums of weights).
    """
    from betty.partition.incidence import reachability

    spec = as_model_spec(model)
    reach = reachability(batch)
    n_out = batch.num_outputs
    if spec.arch == "gat":
        c_edge = float(spec.heads)
    elif spec.aggregator == "lstm":
        c_edge = 24.0
    else:
        c_edge = 0.25
    w = np.zeros(n_out)
    for l, layer in enumerate(batch.layers):
        wi, wo = spec.widths[l], spec.widths[l + 1]
        n_l = np.asarray(reach[l].sum(axis=0)).ravel()
        if l + 1 < batch.num_layers:
            dst = reach[l + 1][: layer.num_dst]
            e_l = np.asarray(dst.T @ layer.in_degrees().numpy().astype(np.float64)).ravel()
        else:
            e_l = layer.in_degrees().numpy().astype(np.float64)
        w += n_l * (wi + wo) + e_l * wi * c_edge
    return torch.from_numpy(w)


def _default_partition(batch, k, method, *, seed, weights, graph, options=None):
    from betty.partition import partition_batch

    return partition_batch(batch, k, method, seed=seed, weights=weights, graph=graph,
                           options=options)


SplitAndEstimate = Callable[[int], "tuple[object, Sequence[MemoryEstimate]]"]
"""``split_and_estimate(k) -> (split, estimates)``: split into k micro-batches (``split``: any
object the engine trains with) and estimate each micro-batch (one :class:`~betty.memory.estimator.
MemoryEstimate` per micro-batch: its ``peak`` bytes and the ``breakdown`` by component)."""


@dataclass
class KLoopResult:
    """Outcome of :func:`smallest_fitting_k`: the K chosen, its split and estimates, and
    every ``(K, largest estimated peak)`` evaluated, in order."""

    k: int
    split: object
    estimates: list[MemoryEstimate]
    tried: list[tuple[int, int]]
    usable_budget: float


def _next_k(k: int, m: float, fixed: float, usable: float, k_max: int) -> int:
    """Overshoot jump: ``min(k_max, max(k + 1, ceil(k · (m − F) / (U − F) · 1.05)))``."""
    return min(k_max, max(k + 1, math.ceil(k * (m - fixed) / (usable - fixed) * _JUMP_SLACK)))


def smallest_fitting_k(split_and_estimate: SplitAndEstimate, *, memory_budget: float,
                       safety_margin: float, fixed: float, k_max: int,
                       max_evaluations: int = 40, start_k: int | None = None,
                       min_k: int = 1, tried: Sequence[tuple[int, int]] = (),
                       limit: str = "one output node per micro-batch",
                       error_cls: type[KSearchError] = KSearchError) -> KLoopResult:
    """The one K-search loop of both engines (module docstring, steps 1-3).

    With ``U = memory_budget · (1 − safety_margin)``, ``F = fixed`` (bytes no split
    removes) and ``M(K) = max`` over the micro-batches of ``split_and_estimate(K)`` of their
    estimated peaks:

    * ``start_k=None``: estimate ``K_lo = min(min_k, k_max)``; fail if ``F >= U``;
      otherwise start at the lower bound ``max(K_lo + 1, ceil(K_lo · (M(K_lo) − F) /
      (U − F)))``, jump by the overshoot
      (:func:`_next_k`; from the second miss on, at least doubling) while ``M(K) > U``, then bisect between the last K that failed
      and the first that fit, down to adjacent integers;
    * ``start_k=K``: evaluate from ``K`` and step up by the same jump until a split fits,
      no bisection (a second, expensive splitter after a screening search).

    Args:
        split_and_estimate: see :data:`SplitAndEstimate` (called at most once per K).
        memory_budget, safety_margin: the budget in bytes and the fraction kept free.
        fixed: ``F`` (parameters, gradients, optimizer state).
        k_max: the largest K possible (``limit`` says why, for the error message).
        max_evaluations: cap on calls to ``split_and_estimate``.
        min_k: the smallest K allowed (capped at ``k_max``; without ``start_k``).
        tried: rounds of an earlier search to prepend to the record.
        error_cls: the :class:`KSearchError` subclass raised.

    Raises:
        KSearchError (``error_cls``): ``F >= U``; ``M(k_max) > U`` (``dominant``: the
            largest component of the worst micro-batch, ``smallest_budget``: the budget that
            would fit it); or ``max_evaluations`` ran out.
    """
    usable = usable_budget(memory_budget, safety_margin)
    record: list[tuple[int, int]] = list(tried)
    cache: dict[int, tuple[object, list[MemoryEstimate]]] = {}

    def evaluate(k: int) -> tuple[object, list[MemoryEstimate]]:
        if k not in cache:
            if len(cache) >= max_evaluations:
                raise error_cls(
                    f"K search stopped after max_evaluations={max_evaluations} split + "
                    f"estimate rounds without settling on a K (tried, as (K, largest micro-batch "
                    f"bytes): {record}; usable budget {int(usable)} bytes); raise "
                    f"max_evaluations or the memory budget",
                    budget=memory_budget, usable=usable, dominant=None,
                    smallest_budget=None, tried=record)
            split, ests = split_and_estimate(k)
            cache[k] = (split, list(ests))
            record.append((k, max(e.peak for e in cache[k][1])))
        return cache[k]

    def peak(k: int) -> int:
        return max(e.peak for e in evaluate(k)[1])

    def need(nbytes: float) -> int:
        return smallest_budget(nbytes, safety_margin)

    if min_k < 1:
        raise ValueError(f"min_k must be >= 1, got {min_k}")
    if start_k is None:
        lo = min(int(min_k), k_max)
        full = peak(lo)
        if fixed >= usable:
            on_device = any("device_store" in e.breakdown for e in evaluate(lo)[1])
            dominant_extra = ", the device store and batch" if on_device else ""
            raise error_cls(
                f"fixed costs alone ({int(fixed)} bytes: parameters, gradients, optimizer "
                f"state{dominant_extra}) exceed the usable budget {int(usable)} bytes (memory_budget "
                f"{int(memory_budget)} with safety_margin {safety_margin}); no K can fit. "
                f"Smallest budget: about {need(full)} bytes for K = {lo}, at least {need(fixed)}",
                budget=memory_budget, usable=usable,
                dominant="parameters+gradients+optimizer_state" + ("+device_store" if on_device else ""),
                smallest_budget=need(full), tried=record)  # K = lo fits it: advice that works
        if full <= usable:
            return KLoopResult(lo, *evaluate(lo), tried=record, usable_budget=usable)
        k_fail: int | None = lo
        k = min(k_max, max(lo + 1, math.ceil(lo * (full - fixed) / (usable - fixed))))
    else:
        k_fail, k = None, min(k_max, max(1, int(start_k)))
    misses = 0
    while (m := peak(k)) > usable:
        k_fail, misses = k, misses + 1
        if k >= k_max:
            worst = max(evaluate(k)[1], key=lambda e: e.peak)
            # the cheapest split tried, not always the finest: with many parameters every
            # micro-batch after the first holds a second gradient while it accumulates
            cheapest = min(cache, key=peak)
            raise error_cls(
                f"even K = {k} ({limit}) leaves a micro-batch of {worst.peak} bytes over the "
                f"usable budget {int(usable)} bytes; its largest component is "
                f"{worst.dominant!r} ({worst.breakdown.get(worst.dominant, 0)} bytes). "
                f"Smallest memory_budget that would work: {need(peak(cheapest))} bytes, at K = "
                f"{cheapest} (safety_margin {safety_margin})",
                budget=memory_budget, usable=usable, dominant=worst.dominant,
                smallest_budget=need(peak(cheapest)), tried=record)
        k = _next_k(k, m, fixed, usable, k_max)
        if start_k is None and misses >= 2:  # the jumps keep falling short: gallop, then bisect
            k = max(k, min(k_max, 2 * k_fail))
    k_fit = k
    if start_k is None:
        while k_fit - k_fail > 1:  # refine between the last failing and the first fitting K
            mid = (k_fit + k_fail) // 2
            if peak(mid) <= usable:
                k_fit = mid
            else:
                k_fail = mid
    return KLoopResult(k_fit, *evaluate(k_fit), tried=record, usable_budget=usable)


def search_k(batch: SampledBatch, model, optimizer="adam", *, memory_budget: float,
             safety_margin: float = DEFAULT_SAFETY_MARGIN, method: str = "random",
             balance: str = "nodes",
             seed: int = 0, graph=None, dtype: torch.dtype | None = None,
             backend: str = "cpu", partition_fn: Callable | None = None,
             max_evaluations: int = 40, partition_options: Mapping | None = None,
             screen_method: str | None = "reg", min_k: int = 1,
             precision: "str | Precision" = "32", feature_dtype: torch.dtype | None = None,
             **estimate_kwargs) -> KSearchResult:
    """Smallest K (see the module docstring) whose partition's largest micro-batch fits.

    Args:
        batch: the full sampled batch.
        model: a :class:`~betty.memory.spec.ModelSpec` or betty model (only its shapes
            are read).
        optimizer: optimizer spec, name or instance (only its kind is read).
        memory_budget: device bytes available for training.
        safety_margin: fraction of the budget kept free.
        method: partitioner name (:data:`betty.partition.PARTITIONERS`).
        balance: ``"nodes"`` or ``"memory"`` (:func:`memory_balance_weights`).
        seed, graph: passed to the partitioner.
        dtype, backend, estimate_kwargs: passed to :func:`~betty.memory.estimator.
            estimate_micro_batches`.
        partition_fn: ``(batch, k, method, *, seed, weights, graph) -> PartitionResult``
            (default :func:`betty.partition.partition_batch` with ``partition_options``).
        max_evaluations: cap on partition + estimate rounds (per method).
        partition_options: ``options`` for the default ``partition_fn``.
        screen_method: for a method in :data:`betty.partition.EXPENSIVE_METHODS`, search
            K with this method first, then split once with ``method`` (module
            docstring); ``None``: search with ``method`` itself at every K.
        min_k: smallest K allowed (capped at the number of outputs); the world size
            for data-parallel training, so each rank has at least one micro-batch.
        precision, feature_dtype: the training precision and the host features' dtype
            (:func:`~betty.memory.estimator.estimate_sizes`).

    Raises:
        KSearchError: no K fits (fixed costs or one output's neighbourhood exceed it),
            ``max_evaluations`` rounds ended without a fitting K, or the optimizer step
            after the micro-batches does not fit (:func:`check_step_fits`); the budget it
            advises covers that step too.
        ValueError: bad arguments.
    """
    usable_budget(memory_budget, safety_margin)  # argument checks before any work
    if min_k < 1:
        raise ValueError(f"min_k must be >= 1, got {min_k}")
    if balance not in ("nodes", "memory"):
        raise ValueError(f"balance must be 'nodes' or 'memory', got {balance!r}")
    partition_fn = partition_fn or functools.partial(_default_partition, options=partition_options)
    estimate_kwargs = dict(estimate_kwargs, precision=precision, feature_dtype=feature_dtype)
    weights = memory_balance_weights(batch, model) if balance == "memory" else None
    fixed = persistent_bytes(model, optimizer, backend)
    step_peak = fixed + step_bytes(model, optimizer, backend)
    if estimate_kwargs.get("device_store_bytes") is not None:  # preparation on the device
        from betty.memory.constants import load_constants
        from betty.memory.device_preparation import fixed_bytes

        granule = (estimate_kwargs.get("constants") or load_constants(backend)).granule_bytes
        fixed += fixed_bytes(batch, estimate_kwargs["device_store_bytes"], granule)

    def split_with(name: str) -> SplitAndEstimate:
        def split_and_estimate(k: int):
            part = partition_fn(batch, k, name, seed=seed, weights=weights, graph=graph)
            return part, estimate_micro_batches(batch, part.groups, part.k, model, optimizer, dtype,
                                                backend, **estimate_kwargs)
        return split_and_estimate

    loop = functools.partial(smallest_fitting_k, memory_budget=memory_budget,
                             safety_margin=safety_margin, fixed=fixed,
                             k_max=batch.num_outputs, max_evaluations=max_evaluations)
    try:
        found = _search(loop, split_with, method, screen_method, min_k)
    except KSearchError as err:  # the budget advised must fit the optimizer step too
        step_need = smallest_budget(step_peak, safety_margin)
        if err.smallest_budget is not None and step_need > err.smallest_budget:
            err.smallest_budget = step_need
            err.args = (f"{err.args[0]}; the optimizer step after the micro-batches needs a budget of at "
                        f"least {step_need} bytes",)
        raise
    check_step_fits(step_peak, memory_budget, safety_margin)
    return KSearchResult(k=found.k, partition=found.split, estimates=found.estimates,
                         tried=found.tried, usable_budget=found.usable_budget)


def _search(loop: Callable, split_with: Callable, method: str, screen_method: str | None,
            min_k: int) -> KLoopResult:
    """:func:`search_k`'s loop: ``method`` alone, or an expensive method started from the
    K a ``screen_method`` search chose."""
    from betty.partition import EXPENSIVE_METHODS

    if screen_method is not None and method in EXPENSIVE_METHODS and method != screen_method:
        screen = loop(split_with(screen_method), min_k=min_k)
        return loop(split_with(method), start_k=screen.k, tried=screen.tried,
                    limit=f"one output node per micro-batch, {method!r} split after "
                          f"{screen_method!r} chose K = {screen.k}")
    return loop(split_with(method), min_k=min_k)


def make_k_chooser(model, optimizer="adam", *, graph=None, dtype: torch.dtype | None = None,
                   backend: str = "cpu", partition_fn: Callable | None = None,
                   on_search: Callable[[KSearchResult], None] | None = None,
                   precision: "str | Precision" = "32", feature_dtype: torch.dtype | None = None,
                   **estimate_kwargs):
    """A :data:`betty.engine.KChooser`: ``(batch, plan, seed) -> (partition, per-micro-batch
    estimated peak bytes)`` running :func:`search_k` with the plan's ``method``,
    ``memory_budget``, ``safety_margin`` and ``balance``. ``on_search`` receives each
    :class:`KSearchResult` (e.g. to log the K tried). The plan's ``min_k`` (default 1) is
    the smallest K allowed (the world size in data-parallel training)."""
    optimizer = as_optimizer_spec(optimizer)  # an optimizer the model does not know: refused now

    def choose(batch: SampledBatch, plan, seed: int):
        if plan.memory_budget is None:
            raise ValueError("k='auto' needs plan.memory_budget (bytes)")
        result = search_k(batch, model, optimizer, memory_budget=plan.memory_budget,
                          safety_margin=plan.safety_margin, method=plan.method,
                          balance=plan.balance, seed=seed, graph=graph, dtype=dtype,
                          backend=backend, partition_fn=partition_fn,
                          partition_options=getattr(plan, "options", None),
                          min_k=getattr(plan, "min_k", 1), precision=precision,
                          feature_dtype=feature_dtype, **estimate_kwargs)
        if on_search is not None:
            on_search(result)
        return result.partition, [int(e.peak) for e in result.estimates]

    return choose


def make_estimator(model, optimizer="adam", *, dtype: torch.dtype | None = None,
                   backend: str = "cpu", precision: "str | Precision" = "32",
                   feature_dtype: torch.dtype | None = None, **estimate_kwargs):
    """A :data:`betty.engine.Estimator`: ``(batch, groups, k) -> per-micro-batch estimated peak
    bytes`` (``precision``, ``feature_dtype``: those of
    :func:`~betty.memory.estimator.estimate_sizes`)."""
    estimate_kwargs = dict(estimate_kwargs, precision=precision, feature_dtype=feature_dtype)
    optimizer = as_optimizer_spec(optimizer)  # an optimizer the model does not know: refused now

    def estimate(batch: SampledBatch, groups, k: int) -> list[int]:
        return [int(e.peak) for e in estimate_micro_batches(batch, groups, k, model, optimizer, dtype,
                                                     backend, **estimate_kwargs)]

    return estimate
