"""Compare an N-rank optimizer update with the single-process full-batch one.

With parameters ``θ0`` before a step, ``θ_ref`` after the single-process full-batch
(K = 1) step and ``θ_N`` after the N-rank K-way step, the reported difference is

    max over parameters p of ||Δ_N[p] - Δ_ref[p]|| / max(||Δ_ref[p]||, tiny),
    Δ = θ_after - θ0,

i.e. the update itself is compared, not the parameters (whose size would hide an error).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from betty.train import max_relative_difference

__all__ = ["UPDATE_TOLERANCE", "update_difference", "update_tolerance"]

UPDATE_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
"""Largest relative update difference accepted per dtype (the exactness tests' bounds)."""


def update_tolerance(dtype: torch.dtype) -> float:
    """:data:`UPDATE_TOLERANCE` of ``dtype``.

    Raises:
        ValueError: a dtype without a bound.
    """
    if dtype not in UPDATE_TOLERANCE:
        raise ValueError(f"no update tolerance for {dtype}; known: {list(UPDATE_TOLERANCE)}")
    return UPDATE_TOLERANCE[dtype]


def update_difference(before: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
                      other: Mapping[str, torch.Tensor]) -> float:
    """Largest relative difference between the updates ``other - before`` and
    ``reference - before`` (see the module docstring); the dicts are ``name -> tensor``."""
    ref = {n: reference[n].double() - before[n].double() for n in before}
    got = {n: other[n].double() - before[n].double() for n in before}
    return max_relative_difference(got, ref)
