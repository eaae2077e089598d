"""Byte sizes written by people: ``512MiB``, ``24GiB``, ``1.5GB``, ``1048576``
(:data:`UNITS`; decimal and binary, any case, rounded down to whole bytes).
"""

from __future__ import annotations

import math
import re

__all__ = ["UNITS", "parse_bytes", "format_bytes", "BYTE_SIZE_HELP"]

UNITS: dict[str, int] = {
    "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}

BYTE_SIZE_HELP = (
    "an integer number of bytes or a number with a unit: B, KB, MB, GB, TB (powers of "
    "1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 24GiB, 512MiB, 1.5GB"
)

_PATTERN = re.compile(r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[A-Za-z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """``value`` as a non-negative number of bytes.

    Args:
        value: an ``int`` (bytes), a whole ``float``, or a string such as ``"24GiB"``.

    Raises:
        ValueError: the value is negative, fractional without a unit, or not a size
            (the message lists the allowed forms).
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a byte size; allowed: {BYTE_SIZE_HELP}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{value!r} is negative; allowed: {BYTE_SIZE_HELP}")
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0 or value != int(value):
            raise ValueError(f"{value!r} is not a whole number of bytes; allowed: {BYTE_SIZE_HELP}")
        return int(value)
    if isinstance(value, str):
        match = _PATTERN.match(value)
        if match:
            unit = match["unit"].lower() or "b"
            if unit in UNITS:
                number = float(match["num"])
                if unit == "b" and number != int(number):
                    raise ValueError(f"{value!r} is not a whole number of bytes; allowed: {BYTE_SIZE_HELP}")
                return int(number * UNITS[unit])
    raise ValueError(f"{value!r} is not a byte size; allowed: {BYTE_SIZE_HELP}")


def binary_unit(n: int | float) -> tuple[str, int]:
    """``(unit, scale)``: the binary unit in which ``n`` bytes is a number below 1024
    (``B``, ``KiB``, ``MiB``, ``GiB``; ``TiB`` from 1 TiB on) and its size in bytes."""
    for power, unit in enumerate(("B", "KiB", "MiB", "GiB")):
        if abs(n) < 1024 ** (power + 1):
            return unit, 1024 ** power
    return "TiB", 1024 ** 4


def format_bytes(n: int | float | None) -> str:
    """``n`` bytes in binary units with three significant digits (``"1.50 GiB"``);
    ``"-"`` for ``None``."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    unit, scale = binary_unit(float(n))
    return f"{n:.0f} B" if unit == "B" else f"{n / scale:.3g} {unit}"
