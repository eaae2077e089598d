"""Artifact files: tables as CSV and JSON (a sampled batch's ``batch.npz``:
:mod:`betty.batchfile`)."""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["write_csv", "write_json"]


def write_csv(path: str | Path, rows: Sequence[Mapping], columns: Sequence[str] | None = None) -> Path:
    """Rows (dicts) as CSV; columns default to the union of keys in first-seen order."""
    path = Path(path)
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(columns), restval="", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_json(path: str | Path, obj) -> Path:
    path = Path(path)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    return path

