"""Facts about this machine that several layers read (standard library only)."""

from __future__ import annotations

import functools
import os

__all__ = ["machine_memory"]


@functools.lru_cache(maxsize=1)
def machine_memory() -> int | None:
    """This machine's memory in bytes (``MemTotal``, else the OS's physical pages), read
    once; ``None`` where the OS does not say."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # pragma: no cover
        return None
