"""A dataset's options checked before anything is loaded: their names, each value on its
own, the options together, and whether a generated graph fits this machine's memory.

Standard library only (no numpy, no torch), so that a spec is checked in an instant.
Each problem names the option it belongs to (:class:`OptionProblem`); an error the
defaults alone give (such as dgl-file's missing ``path``) is not blamed on another
option.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_SEED", "OptionProblem", "option_problems", "generated_config"]

MAX_SEED = 2**32 - 1
"""Largest seed an option (or a spec) may give: seeds derived from it (``seed * 7919 +
epoch``, ``seed + repeat``) stay inside torch's 64-bit range."""


@dataclass(frozen=True)
class OptionProblem:
    """One thing wrong with a dataset's options.

    Attributes:
        key: the option, or ``None`` for the options together.
        value: the option's value (the whole options mapping when ``key`` is ``None``).
        message: what is wrong and what is allowed.
        unknown: ``key`` is not an option of the dataset (its value is not worth echoing).
    """

    key: str | None
    value: Any
    message: str
    unknown: bool = False


def _refusal(name: str, options: dict) -> str | None:
    """Why the data layer refuses ``options`` for dataset ``name``, or ``None``."""
    from betty.data.registry import resolve_options

    try:
        resolve_options(name, options)
    except (ValueError, ArithmeticError, TypeError) as err:
        return str(err)
    return None


def _value_problem(key: str, value: Any) -> OptionProblem | None:
    """Bounds every option shares: finite numbers, seeds up to :data:`MAX_SEED`."""
    if isinstance(value, float) and not math.isfinite(value):
        return OptionProblem(key, value, "must be a finite number")
    if key == "seed" and isinstance(value, int) and not isinstance(value, bool) and value > MAX_SEED:
        return OptionProblem(key, value, f"allowed: an integer from 0 to {MAX_SEED}")
    return None


def generated_config(name: str, options: dict):
    """The generator's :class:`~betty.data.synthetic_config.SyntheticConfig` of a
    generated dataset (``None`` for any other), from its resolved options less the
    options every dataset takes; ``options`` must be valid."""
    from betty.data.registry import COMMON_OPTIONS, resolve_options
    from betty.data.synthetic_config import SYNTHETIC_PRESETS, SyntheticConfig

    if name not in SYNTHETIC_PRESETS:
        return None
    resolved = resolve_options(name, options)
    return SyntheticConfig(**{k: v for k, v in resolved.items() if k not in COMMON_OPTIONS})


def _size_problem(name: str, options: dict) -> OptionProblem | None:
    """A generated dataset whose features and edges alone (float32 features, int64 edge
    ends in both directions) would not fit this machine's memory."""
    from betty.machine import machine_memory
    from betty.sizes import format_bytes

    config = generated_config(name, options)
    if config is None:
        return None
    n, edges = config.scaled_num_nodes, config.target_num_undirected_edges
    need = 4 * n * config.num_features + 2 * 2 * 8 * edges
    have = machine_memory()
    if have is None or need <= have:
        return None
    return OptionProblem(None, options, f"generates {n:,} nodes with {config.num_features:,} features "
                         f"and {edges:,} edges: at least {format_bytes(need)}, more than this machine's "
                         f"memory ({format_bytes(have)}); lower num_nodes, scale or num_features")


def option_problems(name: str, options: dict) -> list[OptionProblem]:
    """Everything wrong with ``options`` for dataset ``name`` (a known name), in this
    order, stopping at the first kind that finds something: unknown option names; the
    shared bounds of each value; each option on its own (against the defaults'
    baseline); the options together; the size of what a generator would make."""
    from betty.data.registry import allowed_options

    allowed = allowed_options(name)
    hint = ", ".join(allowed) if allowed else "none"
    out = [OptionProblem(str(key), value, f"unknown option for dataset {name!r}; allowed options: {hint}",
                         unknown=True) for key, value in options.items() if key not in allowed]
    if out:
        return out
    out = [p for key, value in options.items() if (p := _value_problem(key, value))]
    if out:
        return out
    baseline = _refusal(name, {})
    for key, value in options.items():
        error = _refusal(name, {key: value})
        if error is not None and error != baseline:
            out.append(OptionProblem(key, value, error))
    if out:
        return out
    error = _refusal(name, options)
    if error is not None:
        return [OptionProblem(None, options, error)]
    problem = _size_problem(name, options)
    return [problem] if problem else []
