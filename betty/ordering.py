"""Argsort for the index arrays preparation builds: a few ascending runs laid end to end.

A sampled layer lists its sources as its destinations followed by the other sources in
ascending global ID (:func:`betty.sampling.sample_full_batch`), recursively, so layer
``l``'s ``src_nid`` is ``L - l + 1`` ascending runs; a micro-batch's input IDs are the
same. NumPy's stable sort for 64-bit integers is a timsort, which finds those runs and
merges them in O(n log r) for ``r`` runs, where ``torch.argsort`` sorts from scratch:
on 2.45M IDs in three runs, 0.04 s against 0.45 s (one thread).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["argsort_runs"]


def argsort_runs(values: torch.Tensor) -> torch.Tensor:
    """``(n,)`` int64 positions that sort the 1-D tensor ``values`` ascending, ties in
    their original order (the same as ``torch.argsort(values, stable=True)``), on
    ``values``' device (off the CPU: ``torch.argsort`` there)."""
    if values.dim() != 1:
        raise ValueError(f"values must be 1-D, got shape {tuple(values.shape)}")
    if values.device.type != "cpu":
        return torch.argsort(values, stable=True)
    order = np.argsort(values.numpy(), kind="stable")
    return torch.from_numpy(order.astype(np.int64, copy=False))
