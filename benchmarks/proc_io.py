"""This process's I/O counters, for the benchmarks that report bytes read (a module they
import, not a script)."""

from __future__ import annotations

__all__ = ["process_io"]


def process_io() -> dict[str, int]:
    """``/proc/self/io`` as ``{counter: value}`` (``rchar``, ``read_bytes``, ...; bytes),
    or ``{}`` where the file is not readable (not Linux)."""
    try:
        with open("/proc/self/io") as fh:
            return {k: int(v) for k, v in (line.split(":") for line in fh)}
    except OSError:
        return {}
