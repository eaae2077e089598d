"""The partitioner interface and registry."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any
from dataclasses import dataclass, field

import torch

from betty.batch import SampledBatch
from betty.catalog import REG_PARTITIONERS
from betty.checks import is_integer, is_number
from betty.microbatch import validate_groups
from betty.partition.balance import checked_weights

__all__ = [
    "PartitionResult",
    "PARTITIONERS",
    "PARTITION_OPTIONS",
    "EXPENSIVE_METHODS",
    "register",
    "partition_batch",
]


@dataclass
class PartitionResult:
    """A K-way split of a batch's output nodes.

    Attributes:
        groups: ``(n_out,)`` int64 micro-batch index of each output node, in the order of
            ``batch.output_nid``.
        k: number of micro-batches.
        method: the partitioner's registry name.
        time_build_s: seconds spent building the graph/hypergraph the partitioner cuts.
        time_partition_s: seconds spent in the partitioner itself.
        info: method-specific extras (e.g. the cut or km1 the partitioner reports).
    """

    groups: torch.Tensor
    k: int
    method: str
    time_build_s: float = 0.0
    time_partition_s: float = 0.0
    info: dict = field(default_factory=dict)


PartitionFn = Callable[..., PartitionResult]
PARTITIONERS: dict[str, PartitionFn] = {}
#: Per method, the names of the ``options`` of :func:`partition_batch` it accepts (as
#: keyword arguments); options a method does not declare are ignored for it.
PARTITION_OPTIONS: dict[str, frozenset[str]] = {}
#: What the cuts derive from a batch and keep on it (:meth:`betty.batch.SampledBatch.derived`:
#: layer incidences, the multi-hop incidence, the REG): needed while a split is made (a
#: K search cuts several from one REG), not after it (:meth:`~betty.batch.SampledBatch.forget`).
CUT_STRUCTURES = ("layer_incidence", "needed_sources", "multi_hop_incidence", "redundancy_graph")
#: Methods whose split costs far more than ``reg``'s: ``k: auto`` searches K with
#: ``reg`` first and runs these once at the chosen K (``betty.memory.search_k``).
EXPENSIVE_METHODS = frozenset({"hypergraph", "reg-all"})
#: Options whose ``None`` is a setting, not "the method's default": passed on as given.
NONE_IS_A_VALUE = frozenset({"max_hub_degree"})


def register(name: str, *, options: tuple[str, ...] = ()) -> Callable[[PartitionFn], PartitionFn]:
    """Decorator: make a partition function available under ``name``; ``options`` names
    the keyword arguments it takes from :func:`partition_batch`'s ``options``."""

    def deco(fn: PartitionFn) -> PartitionFn:
        PARTITIONERS[name] = fn
        PARTITION_OPTIONS[name] = frozenset(options)
        return fn

    return deco


def c_int_seed(seed: int) -> int:
    """``seed`` folded into ``[0, 2**31)``, for a partitioner whose seed is a C ``int``
    (Mt-KaHyPar, KaMinPar): a spec's seed may be up to 2**32 - 1, and an epoch's or a
    repeat's seed adds to it. Seeds already in range are kept."""
    return int(seed) % (1 << 31)


def _count_or_none(value: Any) -> bool:
    return value is None or (is_integer(value) and value >= 1)


def _seconds_or_none(value: Any) -> bool:
    return value is None or (is_number(value) and math.isfinite(value) and value > 0)


#: What each option of :func:`partition_batch` may be: ``(check, allowed)``; options
#: not listed here are checked by the method that declares them.
OPTION_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "time_limit_s": (_seconds_or_none, "> 0 seconds or None (a finite number; None: no limit)"),
    "threads": (_count_or_none, ">= 1 or None (an integer; None: the library's default)"),
    "trainer_threads": (lambda value: value is None or (is_integer(value) and value >= 0),
                        ">= 0 or None (an integer: the cores the trainer keeps)"),
    "max_hub_degree": (_count_or_none, ">= 1 or None (an integer; None: no hub cap)"),
    "hub_links": (lambda value: is_integer(value) and value >= 1, ">= 1 (an integer)"),
    "deterministic": (lambda value: isinstance(value, bool), "True or False"),
    "partitioner": (lambda value: value in REG_PARTITIONERS, f"one of {list(REG_PARTITIONERS)}"),
}


def check_options(options: Mapping[str, Any] | None) -> None:
    """Refuse an option of :func:`partition_batch` that no method declares (a misspelt key
    would otherwise be dropped unseen) or a value :data:`OPTION_VALUES` does not allow
    (which would otherwise fail only when a batch is split, on the preparation thread).
    ``None`` is the method's default for every option but :data:`NONE_IS_A_VALUE`'s."""
    known = frozenset().union(*PARTITION_OPTIONS.values())
    unknown = sorted(set(options or {}) - known)
    if unknown:
        raise ValueError(f"unknown partition option(s) {unknown}; allowed: {sorted(known)}")
    for name, value in (options or {}).items():
        if value is None and name not in NONE_IS_A_VALUE:
            continue
        check, allowed = OPTION_VALUES.get(name, (lambda _: True, ""))
        if not check(value):
            raise ValueError(f"partition option {name} must be {allowed}, got {value!r}")


def partition_batch(
    batch: SampledBatch,
    k: int,
    method: str = "random",
    *,
    seed: int = 0,
    weights: torch.Tensor | None = None,
    graph=None,
    options: Mapping[str, Any] | None = None,
) -> PartitionResult:
    """Split ``batch``'s output nodes into ``k`` non-empty micro-batches with ``method``.

    Args:
        batch: the full sampled batch.
        k: number of micro-batches, ``1 <= k <= batch.num_outputs``.
        method: a key of :data:`PARTITIONERS`.
        seed: seed for randomized methods.
        weights: optional ``(n_out,)`` non-negative vertex weights to balance
            (default: balance the number of output nodes).
        graph: the original graph, needed by methods that cut it (``metis``).
        options: method options (``partition.*`` keys of a spec), e.g. ``time_limit_s``,
            ``deterministic``, ``threads`` for ``hypergraph``; each method receives only
            those it declares (:data:`PARTITION_OPTIONS`); ``None`` means the method's
            default and is dropped, except where it is a value itself
            (:data:`NONE_IS_A_VALUE`: ``max_hub_degree=None`` is no hub cap).

    Raises:
        ValueError: unknown method, ``k`` not an integer or outside ``[1, n_out]``, ``weights`` that are
            not one finite, non-negative weight per output, or an option no method
            declares (a misspelt key would otherwise be dropped unseen).
    """
    if method not in PARTITIONERS:
        raise ValueError(
            f"unknown partition method {method!r}; allowed: {sorted(PARTITIONERS)}"
        )
    if not is_integer(k):
        raise ValueError(f"k must be an integer, got {k!r}")
    k = int(k)
    n = batch.num_outputs
    if not 1 <= k <= n:
        raise ValueError(f"k must be between 1 and the number of output nodes ({n}), got {k}")
    if weights is not None:
        checked_weights(weights, n)  # every method balances what it is given: one check for all
    check_options(options)
    if k == 1:
        return PartitionResult(torch.zeros(n, dtype=torch.int64), 1, method)
    start = time.perf_counter()
    accepted = PARTITION_OPTIONS.get(method, frozenset())
    extra = {key: v for key, v in (options or {}).items()
             if key in accepted and (v is not None or key in NONE_IS_A_VALUE)}
    result = PARTITIONERS[method](batch, k, seed=seed, weights=weights, graph=graph, **extra)
    if result.time_build_s == 0.0 and result.time_partition_s == 0.0:
        result.time_partition_s = time.perf_counter() - start
    result.groups = validate_groups(result.groups, n, k)
    return result
