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

__all__ = ["update_difference", "update_tolerance"]

def update_tolerance(dtype: torch.dtype, precision=None) -> float:
    """The exactness bound of ``dtype`` (:func:`betty.verify.default_tol`: 1e-10 float64,
    1e-5 float32), or under a mixed ``precision`` its :data:`betty.verify.MIXED_TOL`."""
    from betty.precision import Precision
    from betty.verify import MIXED_TOL, default_tol

    prec = Precision.parse(precision if precision is not None else "32")
    return MIXED_TOL[prec.name] if prec.mixed else default_tol(dtype)


def update_difference(before: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
                      other: Mapping[str, torch.Tensor]) -> float:
    """Largest relative difference between the updates ``other - before`` and
    ``reference - before`` (see the module docstring); the dicts are ``name -> tensor``."""
    ref = {n: reference[n].double() - before[n].double() for n in before}
    got = {n: other[n].double() - before[n].double() for n in before}
    return max_relative_difference(got, ref)
