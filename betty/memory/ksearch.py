"""Choose K from the memory model: the fewest micro-batches whose largest piece fits.

With usable budget ``U = memory_budget · (1 − safety_margin)`` and ``M(K)`` the largest
estimated peak over the pieces of the K-way partition (:func:`~betty.memory.estimator.
estimate_pieces`), :func:`search_k` looks for a small K with ``M(K) <= U``. It never
trains: it only partitions and estimates.

1. **Start.** Estimate the full batch (K = 1): ``M(1) = F + A`` with ``F`` the fixed
   part (parameters, gradients, optimizer state: it does not shrink with K) and ``A`` the
   rest. If ``F >= U`` no K can help (:class:`KSearchError`). Otherwise pieces need
   ``A / K <= U − F``, so the search starts at ``K_0 = ceil(A / (U − F))`` (a lower bound
   when splitting adds no redundancy).
2. **Grow.** While ``M(K)`` is over budget, jump by the overshoot ratio,
   ``K ← max(K + 1, ceil(K · (M(K) − F) / (U − F) · 1.05))``, capped at the number of
   output nodes. If even one output per piece does not fit, one output's sampled
   neighbourhood alone exceeds the budget: :class:`KSearchError` names the largest
   component of the worst piece and the smallest budget that would work.
3. **Refine.** Binary search between the largest K tried that failed and the smallest
   that fit, down to adjacent integers.

Smallest K (``min_k``, data-parallel training on N ranks: ``min_k = N``): steps 1-3 start
from ``K_lo = min(min_k, outputs)`` instead of 1, so the K returned is ``>= K_lo`` and every
rank gets a piece. The start estimate is ``M(K_lo)``; when it is over budget the first jump
is ``K ← max(K_lo + 1, ceil(K_lo · (M(K_lo) − F) / (U − F)))`` (step 1 for ``K_lo = 1``).
Each rank runs its pieces one after another, so its peak is its largest piece's: a K
whose every piece fits ``U`` fits every rank (all ranks have the same budget).

Non-monotonicity rule: a K-way partition's largest piece is not always smaller than a
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

``balance: memory``: :func:`memory_balance_weights` gives each output node a weight
proportional to its estimated memory (the size of its sampled L-hop neighbourhood per
layer, times the widths that layer stores per node and per edge), passed as
``weights=`` to the partitioner so pieces are balanced in memory, not in output count.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from betty.batch import SampledBatch
from betty.memory.estimator import MemoryEstimate, estimate_pieces, persistent_bytes
from betty.memory.spec import as_model_spec

__all__ = [
    "KSearchError",
    "KSearchResult",
    "search_k",
    "memory_balance_weights",
    "make_k_chooser",
    "make_estimator",
    "usable_budget",
    "DEFAULT_SAFETY_MARGIN",
]

_JUMP_SLACK = 1.05

DEFAULT_SAFETY_MARGIN = 0.05
"""The one default fraction of the memory budget every K search keeps free
(:func:`search_k`, :func:`betty.memory.rev.search_k_rev`, the plans and the spec)."""


class KSearchError(RuntimeError):
    """A K search failed: no K makes the largest piece fit the budget, or the search
    stopped before finding one (``max_evaluations``). Every K-search failure raises
    this class (:class:`betty.memory.rev.RevKSearchError` is a subclass).

    Attributes:
        budget: the memory budget (bytes).
        usable: ``budget · (1 − safety_margin)``.
        dominant: the largest component of the piece that does not fit (``None`` when
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


@dataclass
class KSearchResult:
    """Outcome of :func:`search_k`.

    Attributes:
        k: the chosen number of micro-batches.
        partition: the chosen :class:`~betty.partition.PartitionResult`.
        estimates: per-piece estimates of that partition.
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
            "estimated_peak_bytes_per_piece": [int(e.peak) for e in self.estimates],
            "worst_piece": worst.to_dict(),
            "tried": [{"k": k, "max_estimated_peak_bytes": int(m)} for k, m in self.tried],
        }


def usable_budget(memory_budget: float, safety_margin: float) -> float:
    """``memory_budget · (1 − safety_margin)`` with argument checks."""
    if memory_budget is None or not memory_budget > 0:
        raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget!r}")
    if not 0.0 <= safety_margin < 1.0:
        raise ValueError(f"safety_margin must be in [0, 1), got {safety_margin!r}")
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


def _expensive_search(batch, model, optimizer, *, method: str, screen_method: str,
                      partition_fn: Callable, weights, memory_budget: float,
                      safety_margin: float, seed: int, graph, dtype, backend: str,
                      max_evaluations: int, search_kwargs: dict,
                      estimate_kwargs: dict) -> "KSearchResult":
    """K found with ``screen_method``, then ``method`` once at that K, stepping K up
    until its split fits (see the module docstring)."""
    screen = search_k(batch, model, optimizer, memory_budget=memory_budget,
                      safety_margin=safety_margin, method=screen_method, seed=seed,
                      graph=graph, dtype=dtype, backend=backend, partition_fn=partition_fn,
                      max_evaluations=max_evaluations, screen_method=None, **search_kwargs,
                      **estimate_kwargs)
    usable = screen.usable_budget
    fixed = persistent_bytes(model, optimizer, backend)
    tried = list(screen.tried)
    n_out, k = batch.num_outputs, screen.k
    for _ in range(max_evaluations):
        part = partition_fn(batch, k, method, seed=seed, weights=weights, graph=graph)
        ests = estimate_pieces(batch, part.groups, part.k, model, optimizer, dtype, backend,
                               **estimate_kwargs)
        m = max(e.peak for e in ests)
        tried.append((k, m))
        if m <= usable:
            return KSearchResult(k=k, partition=part, estimates=ests, tried=tried,
                                 usable_budget=usable)
        if k >= n_out:
            worst = max(ests, key=lambda e: e.peak)
            need = math.ceil(worst.peak / (1 - safety_margin))
            raise KSearchError(
                f"{method!r} at K = {k} (one output node per piece) leaves a piece of "
                f"{worst.peak} bytes over the usable budget {int(usable)} bytes; its largest "
                f"component is {worst.dominant!r}. Smallest memory_budget that would work: "
                f"{need} bytes (safety_margin {safety_margin})",
                budget=memory_budget, usable=usable, dominant=worst.dominant,
                smallest_budget=need, tried=tried)
        k = min(n_out, max(k + 1, math.ceil(k * (m - fixed) / (usable - fixed) * _JUMP_SLACK)))
    raise KSearchError(
        f"{method!r}: no K fitting the usable budget {int(usable)} bytes within "
        f"{max_evaluations} splits after the {screen_method!r} search chose K = {screen.k}",
        budget=memory_budget, usable=usable, dominant="unknown",
        smallest_budget=math.ceil(tried[-1][1] / (1 - safety_margin)), tried=tried)


def search_k(batch: SampledBatch, model, optimizer="adam", *, memory_budget: float,
             safety_margin: float = DEFAULT_SAFETY_MARGIN, method: str = "random",
             balance: str = "nodes",
             seed: int = 0, graph=None, dtype: torch.dtype | None = None,
             backend: str = "cpu", partition_fn: Callable | None = None,
             max_evaluations: int = 40, partition_options: Mapping | None = None,
             screen_method: str | None = "reg", min_k: int = 1, **estimate_kwargs) -> KSearchResult:
    """Smallest K (see the module docstring) whose partition's largest piece fits.

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
            estimate_pieces`.
        partition_fn: ``(batch, k, method, *, seed, weights, graph) -> PartitionResult``
            (default :func:`betty.partition.partition_batch` with ``partition_options``).
        max_evaluations: cap on partition + estimate rounds.
        partition_options: ``options`` for the default ``partition_fn``.
        screen_method: for a method in :data:`betty.partition.EXPENSIVE_METHODS`, search
            K with this method first, then split once with ``method`` (module
            docstring); ``None``: search with ``method`` itself at every K.
        min_k: smallest K allowed (capped at the number of outputs); the world size
            for data-parallel training, so each rank has at least one piece.

    Raises:
        KSearchError: no K fits (fixed costs or one output's neighbourhood exceed it),
            or ``max_evaluations`` rounds ended without a fitting K.
        ValueError: bad arguments.
    """
    usable = usable_budget(memory_budget, safety_margin)
    if min_k < 1:
        raise ValueError(f"min_k must be >= 1, got {min_k}")
    if balance not in ("nodes", "memory"):
        raise ValueError(f"balance must be 'nodes' or 'memory', got {balance!r}")
    partition_fn = partition_fn or functools.partial(_default_partition, options=partition_options)
    weights = memory_balance_weights(batch, model) if balance == "memory" else None
    from betty.partition import EXPENSIVE_METHODS

    if screen_method is not None and method in EXPENSIVE_METHODS and method != screen_method:
        return _expensive_search(
            batch, model, optimizer, method=method, screen_method=screen_method,
            partition_fn=partition_fn, weights=weights, memory_budget=memory_budget,
            safety_margin=safety_margin, seed=seed, graph=graph, dtype=dtype, backend=backend,
            max_evaluations=max_evaluations, search_kwargs={"balance": balance, "min_k": min_k},
            estimate_kwargs=estimate_kwargs)
    n_out = batch.num_outputs
    tried: list[tuple[int, int]] = []
    cache: dict[int, tuple[object, list[MemoryEstimate]]] = {}

    def evaluate(k: int):
        if k not in cache:
            if len(cache) >= max_evaluations:
                raise KSearchError(
                    f"K search stopped after max_evaluations={max_evaluations} partition + "
                    f"estimate rounds without settling on a K (tried, as (K, largest piece "
                    f"bytes): {tried}; usable budget {int(usable)} bytes); raise "
                    f"max_evaluations or the memory budget",
                    budget=memory_budget, usable=usable, tried=tried)
            part = partition_fn(batch, k, method, seed=seed, weights=weights, graph=graph)
            ests = estimate_pieces(batch, part.groups, part.k, model, optimizer, dtype, backend,
                                   **estimate_kwargs)
            cache[k] = (part, ests)
            tried.append((k, max(e.peak for e in ests)))
        return cache[k]

    def peak(k: int) -> int:
        return max(e.peak for e in evaluate(k)[1])

    lo = min(min_k, n_out)
    start = peak(lo)
    fixed = persistent_bytes(model, optimizer, backend)
    if fixed >= usable:
        raise KSearchError(
            f"fixed costs alone ({fixed} bytes: parameters, gradients, optimizer state) exceed the "
            f"usable budget {int(usable)} bytes (memory_budget {int(memory_budget)} with "
            f"safety_margin {safety_margin}); no K can fit. Smallest budget: about "
            f"{math.ceil(start / (1 - safety_margin))} bytes for K = {lo}, at least "
            f"{math.ceil(fixed / (1 - safety_margin))}",
            budget=memory_budget, usable=usable, dominant="parameters+gradients+optimizer_state",
            smallest_budget=math.ceil(fixed / (1 - safety_margin)), tried=tried)

    if start <= usable:
        k_fit, k_fail = lo, lo - 1
    else:
        k = min(n_out, max(lo + 1, math.ceil(lo * (start - fixed) / (usable - fixed))))
        k_fail, k_fit = lo, None
        while True:
            m = peak(k)
            if m <= usable:
                k_fit = k
                break
            k_fail = k
            if k >= n_out:
                worst = max(evaluate(k)[1], key=lambda e: e.peak)
                need = math.ceil(worst.peak / (1 - safety_margin))
                raise KSearchError(
                    f"even K = {k} (one output node per piece) leaves a piece of {worst.peak} "
                    f"bytes over the usable budget {int(usable)} bytes: one output's sampled "
                    f"neighbourhood alone is too large; its largest component is "
                    f"{worst.dominant!r} ({worst.breakdown.get(worst.dominant, 0)} bytes). "
                    f"Smallest memory_budget that would work: {need} bytes (safety_margin "
                    f"{safety_margin}); or reduce fanouts/hidden width",
                    budget=memory_budget, usable=usable, dominant=worst.dominant,
                    smallest_budget=need, tried=tried)
            ratio = (m - fixed) / (usable - fixed)
            k = min(n_out, max(k + 1, math.ceil(k * ratio * _JUMP_SLACK)))
        # refine between the last failing and the first fitting K
        while k_fit - k_fail > 1:
            mid = (k_fit + k_fail) // 2
            if peak(mid) <= usable:
                k_fit = mid
            else:
                k_fail = mid
    part, ests = evaluate(k_fit)
    return KSearchResult(k=k_fit, partition=part, estimates=ests, tried=tried, usable_budget=usable)


def make_k_chooser(model, optimizer="adam", *, graph=None, dtype: torch.dtype | None = None,
                   backend: str = "cpu", partition_fn: Callable | None = None,
                   on_search: Callable[[KSearchResult], None] | None = None,
                   **estimate_kwargs):
    """A :data:`betty.engine.KChooser`: ``(batch, plan, seed) -> (partition, per-piece
    estimated peak bytes)`` running :func:`search_k` with the plan's ``method``,
    ``memory_budget``, ``safety_margin`` and ``balance``. ``on_search`` receives each
    :class:`KSearchResult` (e.g. to log the K tried). The plan's ``min_k`` (default 1) is
    the smallest K allowed (the world size in data-parallel training)."""

    def choose(batch: SampledBatch, plan, seed: int):
        if plan.memory_budget is None:
            raise ValueError("k='auto' needs plan.memory_budget (bytes)")
        result = search_k(batch, model, optimizer, memory_budget=plan.memory_budget,
                          safety_margin=plan.safety_margin, method=plan.method,
                          balance=plan.balance, seed=seed, graph=graph, dtype=dtype,
                          backend=backend, partition_fn=partition_fn,
                          partition_options=getattr(plan, "options", None),
                          min_k=getattr(plan, "min_k", 1), **estimate_kwargs)
        if on_search is not None:
            on_search(result)
        return result.partition, [int(e.peak) for e in result.estimates]

    return choose


def make_estimator(model, optimizer="adam", *, dtype: torch.dtype | None = None,
                   backend: str = "cpu", **estimate_kwargs):
    """A :data:`betty.engine.Estimator`: ``(batch, groups, k) -> per-piece estimated peak
    bytes``."""

    def estimate(batch: SampledBatch, groups, k: int) -> list[int]:
        return [int(e.peak) for e in estimate_pieces(batch, groups, k, model, optimizer, dtype,
                                                     backend, **estimate_kwargs)]

    return estimate
