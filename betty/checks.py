"""Checks of argument values shared by the library: an integer or a real number as a user
would pass one (Python's or NumPy's), never a ``bool``; a tensor of integer IDs."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the spec's checks use this module without numpy or torch
    import torch

__all__ = ["is_integer", "is_number", "integer_ids", "check_dropout"]


def is_integer(value) -> bool:
    """A Python or NumPy integer, not a ``bool`` (``2.0`` and ``"2"`` are not)."""
    if isinstance(value, bool):
        return False
    np = sys.modules.get("numpy")  # a NumPy value exists only once NumPy is imported
    return isinstance(value, int) or (np is not None and isinstance(value, np.integer))


def is_number(value) -> bool:
    """A Python or NumPy real number (integer or float), not a ``bool`` or a string."""
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    np = sys.modules.get("numpy")  # a NumPy value exists only once NumPy is imported
    return np is not None and isinstance(value, np.number) and not isinstance(value, np.complexfloating)


def integer_ids(values: "torch.Tensor", name: str, what: str, upper: int | None = None) -> "torch.Tensor":
    """``values`` (a tensor) as int64 after refusing what cannot name ``what``: another
    shape than 1-D, a floating, complex or boolean dtype (a float was truncated, a mask
    read as IDs 0 and 1) and, with ``upper``, a value outside ``[0, upper)``."""
    import torch

    if not isinstance(values, torch.Tensor):
        raise ValueError(f"{name} must be a 1-D integer tensor of {what}, got a {type(values).__name__}")
    if values.dim() != 1 or values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer tensor of {what}, got a {values.dim()}-D "
                         f"{values.dtype} tensor (a boolean mask: pass mask.nonzero().flatten())")
    values = values.to(torch.int64)
    if upper is not None and values.numel() and not (0 <= int(values.min()) and int(values.max()) < upper):
        raise ValueError(f"{name} must lie in [0, {upper}), got [{int(values.min())}, {int(values.max())}]")
    return values


def check_dropout(p, name: str = "dropout") -> float:
    """``p`` as a float after checking it is a drop probability in ``[0,
    catalog.MAX_DROPOUT]`` (hash dropout's 24-bit threshold must stay below ``2^24``)."""
    from betty.catalog import MAX_DROPOUT

    if not is_number(p) or not 0.0 <= p <= MAX_DROPOUT:
        raise ValueError(f"{name} must be a probability in [0, 1 - 2^-24] (hash dropout draws 24-bit "
                         f"uniforms), got {p!r}")
    return float(p)
