"""The file system's clock, as tests that compare ``ctime``/``mtime`` ticks need it."""

from __future__ import annotations

import time
from pathlib import Path


def wait_past(ctime_ns: int, where: Path) -> None:
    """Return once the file system's clock (the ``ctime`` of a new file under ``where``)
    is past ``ctime_ns``; file times move in ticks of a few milliseconds."""
    probe = Path(where) / ".clock-probe"
    while True:
        probe.write_bytes(b"")
        now = probe.stat().st_ctime_ns
        probe.unlink()
        if now > ctime_ns:
            return
        time.sleep(0.001)
