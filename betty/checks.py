"""Type checks of argument values shared by the library's checks: an integer or a real
number as a user would pass one (Python's or NumPy's), never a ``bool``."""

from __future__ import annotations

import numpy as np

__all__ = ["is_integer", "is_number"]


def is_integer(value) -> bool:
    """A Python or NumPy integer, not a ``bool`` (``2.0`` and ``"2"`` are not)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A Python or NumPy real number (integer or float), not a ``bool`` or a string."""
    return isinstance(value, (int, float, np.number)) and not isinstance(value, (bool, np.complexfloating))
