"""Environment variables set for a stretch of code (standard library only)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["environ"]


@contextmanager
def environ(**values: str) -> Iterator[None]:
    """``os.environ`` with ``values`` set for the duration (restored afterwards)."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
